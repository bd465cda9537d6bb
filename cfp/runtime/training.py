"""A training run of the heterogeneous engine: data, checkpoints, timeline, verification, reporting.

``run_training(TrainOptions(...))`` is what ``cfp train`` calls.  Batches depend only on (seed, step),
so a resumed run sees the same data as an uninterrupted one; checkpoints hold the layout-independent
state (full parameter tree + optax state), so a run can resume onto a different layout.
"""
from __future__ import annotations

import contextlib
import enum
import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

import jax
import numpy as np

from cfp.errors import ConfigError
from cfp.files import check_output_dir
from cfp.layout import Layout
from cfp.runtime.schedules import ScheduleName

if TYPE_CHECKING:
    from cfp.runtime.stage.plans import StagePlanOptions
    from cfp.runtime.stage.cache import CompileCache


def _check_no_ignored_options(o: "TrainOptions") -> None:
    """An option that would have no effect is an error, not silently ignored."""
    ignored = [
        (o.checkpoint_every and not o.checkpoint_dir,
         f"checkpoint_every={o.checkpoint_every} (--checkpoint-every) saves nothing without "
         "checkpoint_dir (--checkpoint-dir)"),
        (o.resume and not o.checkpoint_dir, "resume (--resume) needs checkpoint_dir (--checkpoint-dir)"),
        (o.checkpoint_dir and not (o.checkpoint_every or o.resume or _searches_stage_plans(o)),
         f"checkpoint_dir={o.checkpoint_dir!r} (--checkpoint-dir) is unused without checkpoint_every "
         "(--checkpoint-every K), resume (--resume) or a stage-plan search (--stage-plans search)"),
        (o.verify_tol is not None and not o.verify,
         f"verify_tol={o.verify_tol} (--verify-tol) is unused without verify (--verify)"),
        (o.data_paths and o.data is not DataSource.FILES,
         f"data_paths (--data-path) are only read with data=files (--data files), not "
         f"{o.data.value}"),
    ]
    for bad, message in ignored:
        if bad:
            raise ConfigError(message)


def _searches_stage_plans(o: "TrainOptions") -> bool:
    """Whether the run searches stage plans (it keeps them in ``<checkpoint_dir>/stage_plans``)."""
    from cfp.runtime.stage.plans import StagePlanMode
    return o.stage_plans is not None and o.stage_plans.mode is StagePlanMode.SEARCH


class DataSource(str, enum.Enum):
    STDLIB = "stdlib"        # Python standard library sources, byte-level
    SYNTHETIC = "synthetic"  # cfp.models.make_batch random tokens
    FILES = "files"          # --data-path files/directories, byte-level


@dataclass(frozen=True)
class TrainOptions:
    model: str
    layout: Layout
    config_name: str = "tiny"
    overrides: dict = field(default_factory=dict)
    # defaults shared with `cfp train` (cfp/cli/common.py; a test keeps them equal)
    schedule: ScheduleName = ScheduleName.ONE_F_ONE_B
    steps: int = 5
    learning_rate: float = 1e-3
    weight_decay: float = 0.01
    seed: int = 0
    data: DataSource = DataSource.STDLIB
    data_paths: tuple[str, ...] = ()
    checkpoint_dir: Optional[str] = None
    checkpoint_every: int = 0
    keep_checkpoints: Optional[int] = 3   # newest checkpoints kept (orbax retention); None keeps all
    resume: bool = False
    timeline_dir: Optional[str] = None
    verify: bool = False
    verify_tol: Optional[float] = None
    stop_after: Optional[int] = None  # stop (as if killed) after this many steps; for tests
    stage_plans: Optional["StagePlanOptions"] = None  # None: Megatron stage shardings

    def __post_init__(self):
        for name in ("learning_rate", "weight_decay"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0) or (
                    name == "learning_rate" and v == 0):
                raise ConfigError(f"{name}={v!r} is invalid (must be a finite number "
                                  f"{'> 0' if name == 'learning_rate' else '>= 0'})")
        if self.verify_tol is not None and not (math.isfinite(self.verify_tol) and self.verify_tol > 0):
            raise ConfigError(f"verify_tol={self.verify_tol!r} is invalid (must be a finite number > 0)")
        for name in ("steps", "stop_after"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ConfigError(f"{name}={v!r} is invalid (must be a positive integer)")
        if self.checkpoint_every < 0:
            raise ConfigError(f"checkpoint_every={self.checkpoint_every} is invalid (must be >= 0)")
        k = self.keep_checkpoints
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
            raise ConfigError(f"keep_checkpoints={k!r} is invalid (must be a positive integer, or None to keep all)")
        _check_no_ignored_options(self)


@dataclass
class TrainResult:
    losses: dict[int, float]             # step number (1-based) -> loss
    tokens_per_s: Optional[float]        # measured over the steps after the first (which traces); None: no such step
    busy: dict[tuple[int, int], float]   # mean seconds per step each stage computed
    bubbles: dict[int, dict[str, float]]
    verify_error: Optional[float] = None
    verify_ok: bool = True


class _Data:
    def __init__(self, opts: TrainOptions, config: Any):
        self.opts, self.config = opts, config
        self.rows = opts.layout.global_batch
        self.corpus = None
        if opts.data is not DataSource.SYNTHETIC:
            if opts.model == "bert":
                raise ConfigError("--data stdlib/files gives next-token batches; BERT needs "
                                  "--data synthetic (masked-LM batches)")
            if config.vocab_size < 256:
                raise ConfigError(f"byte-level data needs vocab_size >= 256, the model has "
                                  f"{config.vocab_size}")
            from cfp.data.corpus import ByteCorpus
            if opts.data is DataSource.STDLIB:
                self.corpus = ByteCorpus.from_python_stdlib(config.seq_len, seed=opts.seed)
            else:
                if not opts.data_paths:
                    raise ConfigError("--data files needs --data-path PATH [PATH ...]")
                self.corpus = ByteCorpus.from_paths(list(opts.data_paths), config.seq_len,
                                                    seed=opts.seed)

    def batch(self, step: int) -> dict:
        """Global batch of (0-based) ``step``: depends only on the seed and the step."""
        if self.corpus is not None:
            return self.corpus.batch(self.rows, step)
        from cfp.models import make_batch
        key = jax.random.fold_in(jax.random.PRNGKey(self.opts.seed), step)
        with jax.default_device(jax.local_devices(backend="cpu")[0]):
            return jax.tree_util.tree_map(np.asarray,
                                          make_batch(self.opts.model, self.config, self.rows, key))


def _print0(*a, **k):
    if jax.process_index() == 0:
        print(*a, **k, flush=True)


def build_config(opts: TrainOptions):
    from cfp.models import get_config
    return get_config(opts.model, opts.config_name, **opts.overrides)


def _check_before_work(opts: TrainOptions) -> None:
    """Output paths, the checkpoint to resume and the processes of the job, before any compile."""
    from cfp.runtime.launch import check_layout_fills_processes
    check_layout_fills_processes(list(opts.layout.devices))  # no idle process
    if opts.timeline_dir:
        check_output_dir(opts.timeline_dir, "timeline_dir")
    if opts.checkpoint_every or (opts.checkpoint_dir and _searches_stage_plans(opts)):
        check_output_dir(opts.checkpoint_dir, "checkpoint_dir")
    if opts.resume:
        from cfp.runtime.checkpoint import latest_step
        if latest_step(opts.checkpoint_dir) is None:
            raise ConfigError(f"resume: no complete checkpoint in checkpoint_dir="
                              f"{opts.checkpoint_dir!r}")


def run_training(opts: TrainOptions, log: Callable[..., None] = _print0,
                 cache: Optional["CompileCache"] = None) -> TrainResult:
    """Train ``opts.steps`` steps (continuing from a checkpoint with ``resume``); see module doc. ``cache``: the
    compile cache to build stage programs through (default a new one; runs of one model and optimizer in one
    process may share one so that they compile each program once)."""
    from cfp.runtime.engine import HeteroTrainer, compile_cache
    from cfp.runtime.stage.build import plans_for_run
    from cfp.runtime.stage.plans import report_lines
    _check_before_work(opts)
    config = build_config(opts)
    # one compile cache: the stage programs the search builds are the ones the trainer runs
    cache = cache if cache is not None else compile_cache(opts.learning_rate, opts.weight_decay)
    plans = plans_for_run(opts.stage_plans, opts.model, config, opts.layout, cache, opts.checkpoint_dir,
                          opts.resume, log)
    trainer = HeteroTrainer(opts.model, config, opts.layout, opts.schedule, learning_rate=opts.learning_rate,
                            weight_decay=opts.weight_decay, plans=plans, cache=cache)
    data = _Data(opts, config)
    start, losses = _initial_state(opts, trainer, log)
    init_state = trainer.state()[:2] if opts.verify else None
    log(f"model {opts.model}/{opts.config_name} ({config.num_layers} layers, hidden "
        f"{config.hidden_size}, seq {config.seq_len}, {config.dtype}); schedule "
        f"{trainer.schedule.value}; {jax.process_count()} process(es), "
        f"{opts.layout.num_devices} devices")
    log(opts.layout.describe())
    if start < opts.steps:
        log(f"compiled {len(trainer.programs)} stages in {trainer.compile():.1f} s")
    result, last_events = _train_steps(opts, trainer, data, start, losses, config, log)
    for line in report_lines(plans, opts.layout, result.busy) if plans else ():
        log(line)
    if last_events is not None:
        result.bubbles = _timeline(opts, last_events, log, len(trainer.order))
    if opts.verify:
        _verify(opts, trainer, config, data, init_state, start, losses, result, log)
    return result


def _train_steps(opts, trainer, data, start, losses, config, log):
    """Steps ``start+1 .. opts.steps`` (checkpointing as asked); returns (result, last events)."""
    timed, busy_sum, busy_steps, last_events, full, step = [], {}, {}, None, False, start
    for step in range(start, opts.steps):
        stats = trainer.step(data.batch(step))
        losses[step + 1] = stats.loss
        log(f"step {step + 1} loss {stats.loss:.8f} tokens/s {stats.tokens / stats.seconds:,.0f} "
            f"measured ({stats.seconds:.3f} s)")
        if step > start:  # the first step still traces (and warms caches); keep it out of rates
            timed.append(stats)
            for k, v in stats.busy().items():     # a stage's busy time only from steps it was measured in full
                if k not in stats.unmeasured:
                    busy_sum[k], busy_steps[k] = busy_sum.get(k, 0.0) + v, busy_steps.get(k, 0) + 1
        if not stats.unmeasured or not full:   # the timeline: the last step measured in full, else the last step
            last_events, full = stats.events, not stats.unmeasured
        if opts.checkpoint_every and (step + 1) % opts.checkpoint_every == 0:
            _save(opts, trainer, losses)
        if opts.stop_after is not None and step + 1 - start >= opts.stop_after:
            break
    result = TrainResult(losses, None, {}, {})
    if timed:
        result.tokens_per_s = sum(s.tokens for s in timed) / sum(s.seconds for s in timed)
        result.busy = {k: v / busy_steps[k] for k, v in busy_sum.items()}
        log(f"tokens/s {result.tokens_per_s:,.0f} measured (mean over steps {start + 2}..{step + 1})")
        line = "busy per stage (s/step, measured; mean over the steps each stage's actions were all measured): " + \
            ", ".join(f"p{k[0]}s{k[1]} {v:.4f} ({busy_steps[k]} of {len(timed)} steps)"
                      for k, v in sorted(result.busy.items()))
        if jax.process_count() > 1:  # each process measured its own stages
            print(f"{line} (process {jax.process_index()})", flush=True)
        else:
            log(line)
    return result, last_events


def checkpoint_settings(opts: TrainOptions) -> dict:
    """The model, data and optimizer settings a checkpoint was written with (JSON)."""
    return {"model": opts.model, "config": opts.config_name, "overrides": dict(opts.overrides),
            "data": opts.data.value, "batch_rows": opts.layout.global_batch, "data_paths": [os.path.abspath(p) for p in opts.data_paths],
            "seed": opts.seed, "learning_rate": opts.learning_rate,
            "weight_decay": opts.weight_decay}


def _initial_state(opts, trainer, log) -> tuple[int, dict[int, float]]:
    if not opts.resume:
        trainer.init(opts.seed)
        return 0, {}
    from cfp.runtime.checkpoint import latest_step, restore_checkpoint
    step = latest_step(opts.checkpoint_dir)
    target = {"params": trainer.full_like,
              "opt_state": jax.eval_shape(trainer.tx.init, trainer.full_like)}
    state, meta = restore_checkpoint(opts.checkpoint_dir, step, target,
                                     check_metadata=lambda m: _check_settings(opts, step, m))
    trainer.load_state(state["params"], state["opt_state"], step)
    old = _saved_layout(meta.get("layout"))
    moved = "" if isinstance(old, Layout) and old.same_run(opts.layout) else (
        f"; resharded from layout {old.summary() if isinstance(old, Layout) else old} onto "
        f"{opts.layout.summary()}")
    log(f"resumed from {opts.checkpoint_dir} step {step}{moved}")
    return step, {int(k): float(v) for k, v in meta.get("losses", {}).items()}


def _saved_layout(saved: Any) -> Any:
    """The layout a checkpoint was written under (its saved JSON as is when it is not a layout's)."""
    try:
        return Layout.from_json(saved, "checkpoint layout")
    except ConfigError:
        return saved


def _check_settings(opts: TrainOptions, step: int, meta: dict) -> None:
    """Refuse a checkpoint written with other model, data or optimizer settings."""
    saved, now = meta.get("settings"), checkpoint_settings(opts)
    if not isinstance(saved, dict):
        raise ConfigError(f"checkpoint step {step} in {opts.checkpoint_dir!r} does not record the "
                          "settings it was written with (written by an older cfp?)")
    for k in now:
        if saved.get(k) != now[k]:
            raise ConfigError(f"checkpoint step {step} in {opts.checkpoint_dir!r} was written with "
                              f"{k}={saved.get(k)!r}, this run has {k}={now[k]!r}; resume with the "
                              "same settings or use another checkpoint_dir")


def _save(opts, trainer, losses) -> None:
    from cfp.runtime.checkpoint import save_checkpoint
    params, opt_state, step = trainer.state()  # gathered onto every process
    if jax.process_index() != 0:
        return
    meta = {"step": step, "settings": checkpoint_settings(opts), "layout": opts.layout.to_json(),
            "losses": {str(k): v for k, v in losses.items()}}
    save_checkpoint(opts.checkpoint_dir, step, {"params": params, "opt_state": opt_state}, meta,
                    keep=opts.keep_checkpoints, overwrite=True)


def _all_events(events, n_max: int) -> np.ndarray:
    """Rows (pipeline, stage, microbatch, phase 0/1, start, end) of every process's events.

    Each process measures its own stages against its own clock, from the same step boundary."""
    rows = np.array([[e.pipeline, e.stage, e.microbatch, 0 if e.phase.value == "fwd" else 1,
                      e.start, e.end] for e in events], np.float32).reshape(-1, 6)
    if jax.process_count() == 1:
        return rows
    from jax.experimental import multihost_utils
    padded = np.full((n_max, 6), -1.0, np.float32)
    padded[:len(rows)] = rows
    allrows = np.asarray(multihost_utils.process_allgather(padded)).reshape(-1, 6)
    return allrows[allrows[:, 0] >= 0]


def _timeline(opts, events, log, n_max: int) -> dict[int, dict[str, float]]:
    """Log the bubble of the last step measured in full and write its timeline where asked; with no such step,
    write what was measured of the last one and say that its bubble is unknown."""
    from cfp.runtime.timeline import Timeline, bubble_line
    rows = _all_events(events, n_max)
    tl = Timeline(unmeasured=n_max - len(rows))
    for row in rows:
        tl.record(int(row[0]), int(row[1]), int(row[2]), "fwd" if row[3] == 0 else "bwd",
                  float(row[4]), float(row[5]))
    summary = {}
    if tl.unmeasured:     # StepClock leaves out actions whose start it could not observe
        log(f"bubble not measured: no step had every action measured ({tl.unmeasured} of {n_max} actions of "
            f"the last step ended no later than they could start as seen: the host was too busy to watch them)")
    else:
        summary = tl.summary()
        for q, v in summary.items():
            log(bubble_line(q, v))
    if opts.timeline_dir and jax.process_index() == 0:
        _write_timeline(opts, tl, log)
    return summary


def _write_timeline(opts, tl, log) -> None:
    os.makedirs(opts.timeline_dir, exist_ok=True)
    tl.save_json(os.path.join(opts.timeline_dir, "timeline.json"))
    if not len(tl):       # nothing measured: nothing to draw, and no stale picture of another run left
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(opts.timeline_dir, "timeline.png"))
        log(f"timeline written to {opts.timeline_dir}/timeline.json (no action measured: no timeline.png)")
        return
    tl.plot_png(os.path.join(opts.timeline_dir, "timeline.png"),
                title=f"{opts.model} {opts.schedule.value} {opts.layout.summary()}")
    partial = f" ({tl.unmeasured} actions not measured: no bubble)" if tl.unmeasured else ""
    log(f"timeline written to {opts.timeline_dir}/timeline.json and timeline.png{partial}")


def _verify(opts, trainer, config, data, init_state, start, losses, result, log) -> None:
    from cfp.runtime.verify import loss_error, replay, tree_error
    steps = list(range(start, max(losses) if losses else start))
    ref_losses, ref_params = replay(opts.model, config, init_state[0], init_state[1],
                                    (data.batch(s) for s in steps),
                                    learning_rate=opts.learning_rate, weight_decay=opts.weight_decay)
    mine = [losses[s + 1] for s in steps]
    # both raise NumericalError on NaN/Inf (Python's max would drop a NaN error)
    err = max(loss_error(mine, ref_losses), tree_error(trainer.state()[0], ref_params))
    tol = opts.verify_tol if opts.verify_tol is not None else (
        1e-4 if config.dtype == "float32" else 5e-2)
    result.verify_error, result.verify_ok = err, err <= tol
    log(f"verify: max relative error {err:.3e} over {len(steps)} steps "
        f"({'ok' if err <= tol else 'ABOVE'} tolerance {tol:g})")
