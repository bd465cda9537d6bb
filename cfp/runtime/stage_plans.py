"""Searched intra-operator plans for every stage of a heterogeneous pipeline (the CFP passes per stage).

For each stage — its layers, its TP sub-mesh, its pipeline's micro-batch and its per-device memory — the
stage's training step on one micro-batch (forward, backward by ``jax.vjp`` and the AdamW update, exactly the
stage functions of `StageProgram`) is analysed, its unique segments are profiled (through the profile cache,
so segments with the same shapes on the same sub-mesh are shared by stages, pipelines and later runs) and
per-block strategies are searched under the memory budget, parameter/optimizer-state sharding (ZeRO-3)
included. Among the verified plans the search's step time plus the boundary transfer — the bytes each of the
stage's devices receives for its incoming activation and outgoing activation's gradient in the layouts that
plan gives them — picks the winner.

The runtime takes from a stage plan its parameters' PartitionSpecs and the layouts in which activations and
their gradients enter and leave the stage (`StageShardings`); GSPMD propagates them through the stage's
fwd/bwd/update programs. Stages of one device need no search (everything replicated).
"""
from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
import time
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from cfp.errors import ConfigError, InfeasibleError
from cfp.analysis.analysis import analyze_with_program
from cfp.profiling.options import ProfileOptions, default_cache_dir
from cfp.profiling.profiler import profile
from cfp.runtime.layout import HeteroLayout, Stage, layout_lists
from cfp.search.options import SearchOptions, parse_bytes
from cfp.search.plan import spec_entries, spec_from_entries
from cfp.search.search import search
from cfp.sharding.specs import resolve
from cfp.runtime.stage import StageProgram, StageShardings

PLANS_FILE = "stage_plans.json"
PLANS_VERSION = 1


class StagePlanMode(enum.Enum):
    MEGATRON = "megatron"   # fixed Megatron rules (cfp.runtime.sharding), activations replicated
    SEARCH = "search"       # CFP analysis + profiling + search per stage
    SAVED = "saved"         # stage plans saved earlier (a directory), reused without searching


@dataclasses.dataclass(frozen=True)
class StagePlanOptions:
    """How stage plans are made. `memory_per_device`: per-device bytes (or "2GB") of every stage, None for
    unbounded; `profiler`: "measure" or "estimate" (with `gpu`); `cache_dir`: the profile cache (None: the
    default cache, so a second run with the same stages profiles nothing)."""

    mode: StagePlanMode = StagePlanMode.MEGATRON
    directory: Optional[str] = None          # SAVED: where the plans are
    memory_per_device: Any = None
    profiler: str = "measure"
    gpu: Optional[str] = None
    cache_dir: Optional[str] = None
    max_combinations: int = 8
    top_k: int = 3
    verify: int = 2
    iters: int = 3
    shard_state: bool = True

    def __post_init__(self):
        mode = self.mode
        if isinstance(mode, str):
            try:
                mode = StagePlanMode(mode)
            except ValueError:
                raise ConfigError(f"stage plans {self.mode!r} is not one of megatron, search or a "
                                  "directory of saved stage plans") from None
            object.__setattr__(self, "mode", mode)
        if (mode is StagePlanMode.SAVED) != bool(self.directory):
            raise ConfigError("saved stage plans need a directory (and only they take one)")
        self.profile_options()
        self.search_options()

    @classmethod
    def parse(cls, text: str, **kw) -> "StagePlanOptions":
        """`megatron`, `search` or a directory of saved stage plans (the CLI's --stage-plans)."""
        if text in (m.value for m in (StagePlanMode.MEGATRON, StagePlanMode.SEARCH)):
            return cls(StagePlanMode(text), **kw)
        if not os.path.isfile(os.path.join(text, PLANS_FILE)):
            raise ConfigError(f"--stage-plans {text!r} is neither megatron, search nor a directory holding "
                              f"{PLANS_FILE}")
        return cls(StagePlanMode.SAVED, directory=text, **kw)

    def profile_options(self):
        return ProfileOptions(kind=self.profiler, gpu=self.gpu, iters=self.iters,
                              cache_dir=self.cache_dir or default_cache_dir(),
                              max_combinations=self.max_combinations, progress=False)

    def search_options(self):
        return SearchOptions(memory_per_device=self.memory_per_device, top_k=self.top_k,
                             verify=self.verify, iters=self.iters, shard_state=self.shard_state)


def _entries(spec: P) -> tuple:
    return tuple(tuple(e) if isinstance(e, list) else e for e in spec_entries(spec))


def _spec(entries) -> P:
    return spec_from_entries([list(e) if isinstance(e, (list, tuple)) else e for e in entries])


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """One stage's plan: per-block strategy `choice` (with their notation), blocks whose state is stored
    sharded, each parameter's PartitionSpec entries by key path, the activation layouts at its boundaries,
    and the search's figures (`time`: one micro-batch's step, measured or estimated per `profiler`)."""

    pipeline: int
    stage: int
    tp: int
    layers: tuple[int, int]
    micro_batch_size: int
    choice: tuple[int, ...]
    strategies: tuple[str, ...]
    shard_state: tuple[int, ...]
    params: tuple[tuple[str, tuple], ...]
    act_in: tuple
    act_out: tuple
    time: float = 0.0
    boundary_time: float = 0.0
    memory: int = 0
    profiler: str = ""
    profile_compiles: int = 0
    planning_time: float = 0.0

    @property
    def key(self) -> tuple[int, int]:
        return (self.pipeline, self.stage)

    def shardings(self) -> StageShardings:
        return StageShardings(tuple((k, _spec(e)) for k, e in self.params), _spec(self.act_in),
                              _spec(self.act_out))

    def matches(self, st: Stage, micro_batch_size: int) -> bool:
        return (self.key == st.key and self.tp == st.tp and tuple(self.layers) == (st.layer_start, st.layer_end)
                and self.micro_batch_size == micro_batch_size)

    def summary(self) -> str:
        """How many blocks/parameters the plan shards and the activation layouts at its boundaries."""
        if not self.strategies:
            return "replicated (1 device)"
        sharded = sum(1 for _, e in self.params if any(x is not None for x in e))
        fmt = lambda e: "P(" + ", ".join(map(str, e)) + ")"
        return (f"{len(self.choice)} blocks, {len(set(self.strategies))} distinct strategies, "
                f"{sharded}/{len(self.params)} parameters sharded"
                + (f" (state sharded in {len(self.shard_state)} blocks)" if self.shard_state else "")
                + f", activation in {fmt(self.act_in)} out {fmt(self.act_out)}")


@dataclasses.dataclass(frozen=True)
class StagePlans:
    """Every stage's plan for one model and layout; saved as JSON in a directory."""

    model: str
    layout: dict
    plans: tuple[StagePlan, ...]

    def shardings(self) -> dict:
        return {p.key: p.shardings() for p in self.plans}

    def check(self, layout: HeteroLayout, model: str) -> "StagePlans":
        """Raise ConfigError unless every stage of `layout` has a plan made for it."""
        if model != self.model:
            raise ConfigError(f"stage plans were made for model {self.model!r}, not {model!r}")
        by_key = {p.key: p for p in self.plans}
        for pipe in layout.pipelines:
            for st in pipe.stages:
                p = by_key.get(st.key)
                if p is None or not p.matches(st, pipe.micro_batch_size):
                    raise ConfigError(f"stage plans (layout {self.layout.get('hetero_configs')}, layers "
                                      f"{self.layout.get('layer_partitions')}) have no plan for stage {st.key} "
                                      f"(TP {st.tp}, layers {st.layer_start}..{st.layer_end - 1}, micro-batch "
                                      f"{pipe.micro_batch_size}); search again for this layout")
        return self

    def save(self, directory: str) -> str:
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, PLANS_FILE)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({"version": PLANS_VERSION, **dataclasses.asdict(self)}, f, indent=1)
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, directory: str) -> "StagePlans":
        path = os.path.join(directory, PLANS_FILE)
        try:
            with open(path) as f:
                d = json.load(f)
        except OSError as e:
            raise ConfigError(f"cannot read stage plans {path!r}: {e.strerror}") from None
        except ValueError as e:
            raise ConfigError(f"stage plans {path!r} are not JSON: {e}") from None
        if d.get("version") != PLANS_VERSION:
            raise ConfigError(f"stage plans {path!r} have version {d.get('version')!r}, expected {PLANS_VERSION}")
        try:
            plans = tuple(_plan_from_dict(p) for p in d["plans"])
            return cls(str(d["model"]), dict(d["layout"]), plans)
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"stage plans {path!r} are malformed: {e!r}") from None


def _nested(x):
    return tuple(_nested(v) for v in x) if isinstance(x, list) else x


def _plan_from_dict(d: dict) -> StagePlan:
    fields = {f.name for f in dataclasses.fields(StagePlan)}
    d = {k: v for k, v in d.items() if k in fields}
    d["params"] = tuple((str(k), _nested(e)) for k, e in d["params"])
    for k in ("layers", "choice", "strategies", "shard_state", "act_in", "act_out"):
        d[k] = _nested(d[k])
    return StagePlan(**d)


# ---------------------------------------------------------------------------------------------- the stage step
def stage_step(prog: StageProgram, tx: optax.GradientTransformation, aux_coef: float) -> Callable:
    """The stage's training step on one micro-batch, built from its runtime functions: forward, ``jax.vjp``
    backward and the optimizer update. Arguments ``(params, opt_state, x[, g_y])`` (the last stage:
    ``(params, opt_state, x, targets, weights)``); returns ``(params, opt_state[, g_x][, loss])``."""
    st = prog.stage
    aux_ct = jnp.float32(aux_coef)

    def finish(params, opt_state, g_p, g_x, extra=()):
        updates, opt_state = tx.update(g_p, opt_state, params)
        head = (optax.apply_updates(params, updates), opt_state)
        return head + (() if st.is_first else (g_x,)) + extra

    if st.is_last:
        def step(params, opt_state, x, targets, weights):
            fn = lambda p, x_: prog.last_forward(p, x_, targets, weights, jnp.float32(1.0))
            (ce, _), pull = prog.vjp(fn, params, x)
            g_p, g_x = pull((jnp.ones((), jnp.float32), aux_ct))
            return finish(params, opt_state, g_p, g_x, (ce,))
    else:
        def step(params, opt_state, x, g_y):
            _, pull = prog.vjp(prog.forward, params, x)
            g_p, g_x = pull((g_y, aux_ct))
            return finish(params, opt_state, g_p, g_x)
    return step


def example_args(prog: StageProgram, tx, micro_batch: int, seq_len: int, x_like, y_like) -> tuple:
    """Concrete (zero) arguments of `stage_step`: the search compiles and may time the whole step."""
    zeros = lambda s: np.zeros(s.shape, s.dtype)
    params = jax.tree_util.tree_map(zeros, prog.params_like)
    opt = jax.tree_util.tree_map(zeros, jax.eval_shape(tx.init, prog.params_like))
    x = zeros(x_like)
    if prog.stage.is_last:
        return params, opt, x, np.zeros((micro_batch, seq_len), np.int32), np.ones((micro_batch, seq_len),
                                                                                  np.float32)
    return params, opt, x, zeros(y_like)


# ---------------------------------------------------------------------------------------------- searching
def _shards(spec: P, mesh_shape: dict) -> int:
    axes = [a for e in spec if e is not None for a in (e if isinstance(e, tuple) else (e,))]
    return math.prod(mesh_shape[a] for a in axes)


def boundary_seconds(prog: StageProgram, act_in: P, act_out: P, x_like, y_like, link_gbps: float) -> float:
    """Seconds per micro-batch to bring the stage its input activation and its output's gradient: every
    device of the stage receives its shard (a replicated layout costs a full copy per device)."""
    n = prog.mesh.devices.size
    shape = dict(prog.mesh.shape)
    total = n * x_like.size * x_like.dtype.itemsize / _shards(act_in, shape)
    if y_like is not None:
        total += n * y_like.size * y_like.dtype.itemsize / _shards(act_out, shape)
    return total / (link_gbps * 1e9)


def _pick(analysis, result, prog, x_like, y_like, budget, n_params: int, n_opt: int):
    """(verified plan, resolved plan, boundary seconds) with the least step time plus boundary transfer."""
    best = None
    for v in result.verified:
        if not math.isfinite(v.time) or (budget is not None and v.memory > budget):
            continue
        applied = resolve(analysis, v.choice, v.shard_state)
        act_in = applied.input_specs[n_params + n_opt]
        act_out = applied.input_specs[n_params + n_opt + 1] if y_like is not None else P()
        b = boundary_seconds(prog, act_in, act_out, x_like, y_like, result.link_gbps)
        if best is None or v.time + b < best[0].time + best[2]:
            best = (v, applied, b)
    if best is None:
        raise InfeasibleError(f"stage {prog.stage.key}: no verified plan fits {budget} bytes per device")
    return best


def search_stage(prog: StageProgram, tx, micro_batch: int, seq_len: int, x_like, y_like, aux_coef: float,
                 options: StagePlanOptions, log: Callable[[str], None] = print) -> StagePlan:
    """Analyse, profile and search one stage on its own sub-mesh; see the module doc."""
    t0 = time.perf_counter()
    args = example_args(prog, tx, micro_batch, seq_len, x_like, y_like)
    analysis, program = analyze_with_program(stage_step(prog, tx, aux_coef), prog.mesh, *args)
    quiet = lambda *_: None
    table = profile(program, analysis, options.profile_options(), log=quiet)
    sopts = options.search_options()
    result = search(program, analysis, table, args, sopts, log=quiet, mesh=prog.mesh)
    n_params = len(jax.tree_util.tree_leaves(args[0]))
    n_opt = len(jax.tree_util.tree_leaves(args[1]))
    v, applied, boundary = _pick(analysis, result, prog, x_like, y_like if not prog.stage.is_last else None,
                                 sopts.memory_per_device, n_params, n_opt)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(prog.params_like)[0]]
    st = prog.stage
    plan = StagePlan(
        st.pipeline, st.index, st.tp, (st.layer_start, st.layer_end), micro_batch, tuple(v.choice),
        tuple(analysis.notation(b, c) for b, c in enumerate(v.choice)), tuple(v.shard_state),
        tuple((k, _entries(s)) for k, s in zip(paths, applied.input_specs[:n_params])),
        _entries(applied.input_specs[n_params + n_opt]),
        _entries(applied.input_specs[n_params + n_opt + 1]) if not st.is_last else (),
        float(v.time), float(boundary), int(v.memory), str(table.profiler), int(table.compiles),
        time.perf_counter() - t0)
    log(f"stage p{st.pipeline}s{st.index} (TP {st.tp}, {len(analysis.blocks)} blocks, "
        f"{analysis.num_unique_segments} unique segments): profiled {table.compiles} combinations "
        f"({'nothing compiled, all from the profile cache' if table.compiles == 0 else 'compiled'}), "
        f"searched in {plan.planning_time:.1f} s: {plan.summary()}")
    return plan


def _replicated(st: Stage, micro_batch: int, params_like) -> StagePlan:
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params_like)[0]]
    return StagePlan(st.pipeline, st.index, st.tp, (st.layer_start, st.layer_end), micro_batch, (), (), (),
                     tuple((k, ()) for k in paths), (), ())


def search_stage_plans(model_name: str, config: Any, layout: HeteroLayout, tx: optax.GradientTransformation,
                       options: StagePlanOptions, devices: Optional[list] = None,
                       log: Callable[[str], None] = print) -> StagePlans:
    """Search every stage's plan (stages equal in layers, TP and micro-batch are searched once)."""
    from cfp.models import init_params, stage_modules
    devices = list(devices) if devices is not None else jax.devices()
    modules = stage_modules(model_name, config)
    full_like = jax.eval_shape(lambda: init_params(model_name, config, 0))
    aux_coef = float(getattr(config, "aux_loss_coef", 0.0))
    done: dict[tuple, StagePlan] = {}
    plans = []
    for pipe in layout.pipelines:
        mbs = pipe.micro_batch_size
        x_like = jax.ShapeDtypeStruct((mbs, config.seq_len), jnp.int32)
        for st in pipe.stages:
            names = st.module_names()
            params_like = {"params": {n: full_like["params"][n] for n in names}}
            prog = StageProgram(st, modules, [devices[d] for d in st.devices], params_like, tx)
            y_like = jax.eval_shape(prog.forward, params_like, x_like)[0]
            key = (tuple(names), st.tp, mbs, st.is_first, st.is_last)
            if st.tp == 1:
                plan = _replicated(st, mbs, params_like)
            elif key in done:
                plan = dataclasses.replace(done[key], pipeline=st.pipeline, stage=st.index)
            else:
                plan = done[key] = search_stage(prog, tx, mbs, config.seq_len, x_like, y_like, aux_coef,
                                                options, log)
            plans.append(plan)
            x_like = y_like
    return StagePlans(model_name, layout_lists(layout), tuple(plans))


def plans_for_run(options: Optional[StagePlanOptions], model_name: str, config: Any, layout: HeteroLayout,
                  tx, checkpoint_dir: Optional[str] = None, resume: bool = False,
                  log: Callable[[str], None] = print) -> Optional[StagePlans]:
    """The stage plans of a training run (None: Megatron rules). A resumed run reuses the plans saved next
    to its checkpoints; a searched run saves them there (``<checkpoint_dir>/stage_plans``)."""
    if options is None or options.mode is StagePlanMode.MEGATRON:
        return None
    saved_dir = os.path.join(checkpoint_dir, "stage_plans") if checkpoint_dir else None
    if options.mode is StagePlanMode.SAVED:
        plans = StagePlans.load(options.directory).check(layout, model_name)
        log(f"stage plans loaded from {options.directory} (no search)")
    elif resume and saved_dir and _fits(saved_dir, layout, model_name, log):
        plans = StagePlans.load(saved_dir)
        log(f"stage plans of the checkpointed run reused from {saved_dir} (no search)")
    else:
        if jax.process_count() > 1:
            # the search compiles and times every stage on devices one process cannot all address
            raise ConfigError("--stage-plans search runs in a single process; search there and pass the "
                              "saved stage-plans directory (--stage-plans DIR) to the multi-process run")
        t0 = time.perf_counter()
        plans = search_stage_plans(model_name, config, layout, tx, options, log=log)
        log(f"stage plans searched in {time.perf_counter() - t0:.1f} s")
    if saved_dir and jax.process_index() == 0:
        log(f"stage plans saved to {plans.save(saved_dir)}")
    return plans


def _fits(directory: str, layout: HeteroLayout, model_name: str, log) -> bool:
    """Whether `directory` holds stage plans for this layout (a run may resume onto another layout)."""
    if not os.path.isfile(os.path.join(directory, PLANS_FILE)):
        return False
    try:
        StagePlans.load(directory).check(layout, model_name)
        return True
    except ConfigError as e:
        log(f"not reusing the checkpointed stage plans: {e}")
        return False


def report_lines(plans: StagePlans, layout: HeteroLayout, busy: dict) -> list[str]:
    """Per stage: strategy summary, memory, the search's step time x micro-batches vs the measured busy time.

    The search's time is one micro-batch's forward+backward+update (measured under the `measure` profiler on
    this host, estimated under `estimate`); the runtime's busy time is the stage's measured fwd + bwd (which
    recomputes the forward) over all its micro-batches per step, without the update."""
    out = []
    for p in plans.plans:
        chunks = layout.pipelines[p.pipeline].chunks
        kind = "estimated" if p.profiler.startswith("estimate") else "measured in search"
        line = f"stage plan p{p.pipeline}s{p.stage} TP {p.tp}: {p.summary()}"
        if p.strategies:
            line += (f"; {p.memory / 2**20:.2f} MiB per device (compiled); step {kind} {p.time * chunks:.4f} s "
                     f"({chunks} micro-batches) + boundary estimated {p.boundary_time * chunks:.4f} s")
        if p.key in busy:
            line += f"; busy measured {busy[p.key]:.4f} s/step"
        out.append(line)
    return out
