"""A user's batches as a run's steps take them (`train_pipelines`, a factory's second value): step -> global batch,
from any of the forms a data loader gives, each batch checked against the example batch (step 0's) before it runs.

The forms of ``batches`` (`FORMS`):

* a callable ``batches(step, rows) -> batch``: step ``step``'s global batch of ``rows`` rows;
* one batch (a pytree of arrays sharing a leading batch dim): step ``s`` takes rows ``s*rows ..`` of it, wrapping;
* a list or tuple of per-step batches: step ``s`` takes item ``s`` (wrapping around after the last);
* an iterator or other iterable of per-step batches (a generator, a grain ``DataLoader``, a ``tf.data`` dataset
  yielding numpy or jax arrays): step ``s`` takes the ``s``-th item; a resumed run reads the items before its
  first step again and drops them, so give it the iterator the first run started from.

In a multi-process job each process feeds its own share (`process_share`, `Share`): the rows of the pipelines
whose first or last stage (the stages that read a batch: the inputs, the labels) has devices on it, in pipeline
order, as ``jax.make_array_from_process_local_data`` takes each process's rows of the devices it hosts. A per-step
batch of a process is its share or the whole global batch (then the engine reads its share of it); the one-batch
form and a callable's ``rows`` stay global. Every process's batch of a step has the same structure, dtypes and dims
after the rows (checked each step across the processes); ``verify`` gathers the whole batch for its replay.

A list or tuple is taken as the form the model accepts (`LayeredModel.check`, abstract: nothing runs): per-step
batches when its first item is a batch the model takes, one batch when the whole value is; both or neither is a
one-line error. Every batch of a per-step form has the layout's global batch of rows, and every batch has the
example batch's structure and dtypes (other dims may change: a new shape is checked with the model again).
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import jax
import numpy as np

from cfp.errors import ConfigError

if TYPE_CHECKING:
    from cfp.layout import Layout

FORMS = ("a callable batches(step, rows) -> batch", "one batch (a pytree of arrays sharing a leading batch dim)",
         "a list or tuple of per-step batches", "an iterator or iterable of per-step batches (a generator, a "
         "data loader)")


def _forms() -> str:
    return "; ".join(FORMS)


def _host(batch: Any) -> Any:
    return jax.tree_util.tree_map(np.asarray, batch)


def _signature(batch: Any) -> tuple:
    leaves, tree = jax.tree_util.tree_flatten(batch)
    return tree, tuple((np.shape(a), np.result_type(a).name) for a in leaves)


def _describe(batch: Any, limit: int = 200) -> str:
    pairs = jax.tree_util.tree_flatten_with_path(batch)[0]
    text = "{" + ", ".join(f"{jax.tree_util.keystr(p) or 'batch'}: {np.result_type(a).name}{list(np.shape(a))}"
                           for p, a in pairs) + "}" if pairs else repr(batch)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _model_error(model: Any, batch: Any) -> Optional[str]:
    """None when ``model`` takes ``batch`` (traced abstractly), else the one-line reason."""
    try:
        model.check(batch)
    except ConfigError as e:
        return str(e)
    return None


def _rows(batch: Any) -> Optional[int]:
    leaves = jax.tree_util.tree_leaves(batch)
    rows = {np.shape(a)[0] if np.ndim(a) else None for a in leaves}
    return rows.pop() if len(rows) == 1 else None


# ---------------------------------------------------------------- the sources: step -> the batch as given
class _Called:
    per_step = True

    def __init__(self, fn: Callable[[int, int], Any]):
        self.fn = fn

    def get(self, step: int, rows: int) -> Any:
        return self.fn(step, rows)


class _Rows:
    per_step = False

    def __init__(self, batch: Any):
        from cfp.runtime.user_model import cycled_rows
        self.fn = cycled_rows(batch)

    def get(self, step: int, rows: int) -> Any:
        return self.fn(step, rows)


class _Listed:
    per_step = True

    def __init__(self, items: Any):
        self.items = items

    def get(self, step: int, rows: int) -> Any:
        return self.items[step % len(self.items)]


class _Iterated:
    """The ``s``-th item of an iterable: read once, in order; the items a run still needs are kept (step 0's, the
    example, and from the last step taken on; every step's for a run that replays them)."""
    per_step = True

    def __init__(self, iterable: Iterable, name: str):
        self.iterable, self.name = iterable, name
        self.it: Optional[Iterator] = None
        self.read = 0                       # items read so far
        self.kept: dict[int, Any] = {}
        self.replay = True

    def get(self, step: int, rows: int) -> Any:
        if step in self.kept:
            return self.kept[step]
        if step < self.read:
            raise ConfigError(f"{self.name}: step {step}'s batch was read from the iterator and not kept (an "
                              "iterator is read once): give a fresh iterator for each run, a list or a callable")
        if self.it is None:
            self.it = iter(self.iterable)
        for item in itertools.islice(self.it, step - self.read + 1):
            if self.replay or self.read in (0, step):
                self.kept[self.read] = _host(item)
            self.read += 1
        if step not in self.kept:
            raise ConfigError(f"{self.name}: the iterator ended after {self.read} batches; the run needs step "
                              f"{step}'s (give as many batches as steps, or a callable)")
        return self.kept[step]

    def forget_before(self, step: int) -> None:
        for s in [s for s in self.kept if 0 < s < step]:
            del self.kept[s]


class StepBatches:
    """``(step, rows) -> global batch`` from one of `FORMS`, each batch checked against the example (step 0's):
    the model takes the example (`LayeredModel.check`), and every later batch has its structure and dtypes (and,
    in a per-step form, ``rows`` rows). Errors are one-line ConfigErrors naming the step."""

    def __init__(self, source: Any, model: Any, name: str):
        self.source, self.model, self.name = source, model, name
        self._example: Any = None
        self.checked: set = set()           # signatures the model was checked on
        self.share: Optional[Share] = None  # this process's rows (`for_run` with a layout)

    def __call__(self, step: int, rows: int) -> Any:
        batch = _host(self.source.get(step, rows))
        if self._example is None:
            self._check_example(batch)
            if isinstance(self.source, _Listed):    # every item checked before anything compiles
                for s in range(1, len(self.source.items)):
                    self._check(s, _host(self.source.items[s]), rows)
        self._check(step, batch, rows)
        return batch

    def example(self, rows: int) -> Any:
        """Step 0's batch with ``rows`` rows (its rows cycled or cut: for planning, which needs its shapes only)."""
        own = isinstance(self.source, (_Listed, _Iterated))      # batches of their own rows
        batch = self(0, _rows(_host(self.source.get(0, rows))) if own else rows)
        idx = np.arange(rows) % _rows(batch)
        return jax.tree_util.tree_map(lambda a: a[idx], batch)

    def for_run(self, run: "int | Layout", replay: bool) -> Callable[[int], Any]:
        """Step -> the global batch a run's trainer takes; ``run``: the run's layout (its global batch and this
        process's `Share` of it: a per-step batch may be either, a share is placed at its rows) or the global
        batch's rows. ``replay``: the run reads its steps again (its verification), so an iterator's items are
        kept for it, and in a multi-process job the whole batch is gathered on every process."""
        from cfp.layout import Layout
        if isinstance(self.source, _Iterated):
            self.source.replay = replay
        layout = run if isinstance(run, Layout) else None
        rows = layout.global_batch if layout else run
        shares: list[Share] = []        # every process's, once the run takes its first batch (its layout checked)

        def batch(step: int) -> Any:
            if layout and not shares:
                shares.extend(process_share(layout, p) for p in range(jax.process_count()))
                self.share = shares[jax.process_index()]
            out = self(step, rows)
            if not replay and isinstance(self.source, _Iterated):
                self.source.forget_before(step)
            if not layout:
                return out
            out = self.share.fill(out)
            if len(shares) > 1:         # every process calls it for the same steps in the same order
                _agree(self.name, step, out)
                out = _whole(out, shares) if replay else out
            return out
        return batch

    def _check_example(self, batch: Any) -> None:
        error = _model_error(self.model, batch)
        if error:
            raise ConfigError(f"{self.name}: step 0's batch {_describe(batch)}: {error}")
        self._example = batch
        self.checked.add(_signature(batch))

    def _check(self, step: int, batch: Any, rows: int) -> None:
        sig = _signature(batch)
        fits = {rows} if self.share is None else {rows, self.share.rows}
        if sig in self.checked and (not self.source.per_step or _rows(batch) in fits):
            return
        want = _signature(self._example)
        if sig[0] != want[0] or [d for _, d in sig[1]] != [d for _, d in want[1]]:
            raise ConfigError(f"{self.name}: step {step}'s batch {_describe(batch)} differs from the example batch "
                              f"(step 0's) {_describe(self._example)}; every batch needs its structure and dtypes")
        if self.source.per_step and _rows(batch) not in fits:
            mine = "" if self.share is None or self.share.whole else (
                f", this process's share {self.share.rows} (process {self.share.process} feeds pipelines "
                f"{list(self.share.pipelines)}: cfp.process_share)")
            raise ConfigError(f"{self.name}: step {step}'s batch {_describe(batch)} has "
                              f"{_rows(batch)} rows; the layout's global batch is {rows} rows (its pipelines' "
                              f"batch sizes summed){mine}")
        error = _model_error(self.model, batch)
        if error:
            raise ConfigError(f"{self.name}: step {step}'s batch {_describe(batch)}: {error}")
        self.checked.add(sig)


def step_batches(batches: Any, model: Any, name: str = "batches") -> StepBatches:
    """``batches`` in any of `FORMS` as a `StepBatches` for ``model``; a value of none of them, or one a list or
    tuple leaves ambiguous, is a one-line ConfigError naming the forms."""
    if isinstance(batches, StepBatches):
        return batches
    return StepBatches(_source(batches, model, name), model, name)


def _source(batches: Any, model: Any, name: str) -> Any:
    if callable(batches):
        return _Called(batches)
    if isinstance(batches, (np.ndarray, jax.Array, Mapping)):
        return _Rows(batches)
    if isinstance(batches, (list, tuple)):
        return _sequence(batches, model, name)
    if isinstance(batches, (str, bytes)) or batches is None:
        raise ConfigError(f"{name}={batches!r} is not batches; give {_forms()}")
    if isinstance(batches, Iterable):
        return _Iterated(batches, name)
    if _rows(_host(batches)):       # a registered pytree (a dataclass batch): one batch
        return _Rows(batches)
    raise ConfigError(f"{name} of type {type(batches).__name__} is not batches; give {_forms()}")


def _sequence(items: Any, model: Any, name: str) -> Any:
    """A list or tuple as per-step batches or as one batch: whichever the model takes."""
    kind = type(items).__name__
    if not items:
        raise ConfigError(f"{name} is an empty {kind}; give {_forms()}")
    as_steps = _model_error(model, _host(items[0]))
    as_one = _model_error(model, _host(items))
    if as_steps is None and as_one is None:
        raise ConfigError(f"{name}: a {kind} of {len(items)} the model takes both as per-step batches and as one "
                          f"batch; say which: iter({name}) for per-step batches, or "
                          "a callable (step, rows) -> batch")
    if as_steps is None:
        return _Listed(items)
    if as_one is None:
        return _Rows(tuple(items))      # the engine reads a list as per-pipeline micro-batches
    if _rows(items[0]) is not None and jax.tree_util.tree_leaves(items[0]):
        raise ConfigError(f"{name}: a {kind} of {len(items)} per-step batches, but step 0's batch "
                          f"{_describe(_host(items[0]))}: {as_steps}")
    raise ConfigError(f"{name}: a {kind} taken as one batch {_describe(_host(items))}: {as_one}; give {_forms()}")


# ---------------------------------------------------------------- a process's share of a step's global batch
@dataclasses.dataclass(frozen=True)
class Share:
    """The rows of each step's global batch that process ``process`` feeds: those of ``pipelines`` (the ones whose
    first or last stage has devices on it), each pipeline's rows ``ranges[i]`` = [start, stop) of the global batch,
    in pipeline order."""
    process: int
    pipelines: tuple[int, ...]
    ranges: tuple[tuple[int, int], ...]
    global_rows: int

    @property
    def rows(self) -> int:
        """How many rows a batch of this share has."""
        return sum(b - a for a, b in self.ranges)

    @property
    def whole(self) -> bool:
        return self.rows == self.global_rows

    @property
    def indices(self) -> np.ndarray:
        """The global batch's row of each of the share's rows."""
        return np.concatenate([np.arange(a, b) for a, b in self.ranges] + [np.zeros(0, np.int64)])

    def take(self, batch: Any) -> Any:
        """This process's rows of a global batch."""
        idx = self.indices
        return jax.tree_util.tree_map(lambda a: np.asarray(a)[idx], batch)

    def fill(self, batch: Any) -> Any:
        """The global batch the engine takes: ``batch`` itself when it has the global rows, else (a batch of the
        share's rows) its rows at theirs and zeros in the rows no stage of this process reads (``np.zeros``:
        pages never written take no memory)."""
        if _rows(batch) == self.global_rows:
            return batch

        def placed(a: np.ndarray) -> np.ndarray:
            out = np.zeros((self.global_rows,) + a.shape[1:], a.dtype)
            out[self.indices] = a
            return out
        return jax.tree_util.tree_map(placed, batch)


def process_share(layout: "Layout", process: Optional[int] = None, devices: Optional[Sequence] = None) -> Share:
    """The `Share` of each step's global batch that ``process`` (default: this one) feeds under ``layout``;
    ``devices``: what the layout's device ids index (default ``jax.devices()``, as the engine's)."""
    devices = list(devices) if devices is not None else jax.devices()
    process = jax.process_index() if process is None else process
    layout.validate_for(layout.num_layers, len(devices))       # its device ids index `devices`
    fed = [q for q, pipe in enumerate(layout.pipelines)
           if any(devices[d].process_index == process for st in (pipe.stages[0], pipe.stages[-1]) for d in st.devices)]
    offsets = layout.batch_offsets()
    return Share(process, tuple(fed), tuple((offsets[q], offsets[q] + layout.pipelines[q].batch) for q in fed),
                 layout.global_batch)


def _gather(x: Any) -> Any:
    from cfp.runtime.host_state import process_allgather
    return process_allgather(x)


def _agree(name: str, step: int, batch: Any, gather: Callable[[Any], Any] = _gather) -> None:
    """Every process's batch of ``step`` has the same structure, dtypes and dims (each process derives the other
    processes' activation shapes from its own batch); a one-line ConfigError on every process otherwise."""
    digest = np.frombuffer(hashlib.sha256(repr(_signature(batch)).encode()).digest()[:8], np.int32)
    every = np.asarray(gather(digest))
    odd = [p for p in range(len(every)) if not np.array_equal(every[p], every[0])]
    if odd:
        raise ConfigError(f"{name}: step {step}'s batch differs between the processes: process(es) {odd} fed "
                          f"another structure, dtypes or dims than process 0; this process's is {_describe(batch)} "
                          "(a share has the global batch's dims after the rows)")


def _whole(batch: Any, shares: Sequence[Share], gather: Callable[[Any], Any] = _gather) -> Any:
    """The whole global batch on every process from each process's rows of it (``shares[p]`` process p's): row
    ``r`` from the first process feeding it, its bytes gathered (exact for every dtype)."""
    owner = np.full(shares[0].global_rows, -1)
    for sh in reversed(shares):
        owner[sh.indices] = sh.process
    leaves, tree = jax.tree_util.tree_flatten(batch)
    raw = [np.ascontiguousarray(a).reshape(a.shape[0], int(np.prod(a.shape[1:]))).view(np.uint8) for a in leaves]
    got = [np.asarray(g) for g in gather(raw)]        # per leaf (processes, rows, bytes)
    rows = np.arange(len(owner))
    return jax.tree_util.tree_unflatten(tree, [g[owner, rows].view(a.dtype).reshape(a.shape)
                                               for g, a in zip(got, leaves)])
