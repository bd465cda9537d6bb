"""Searched intra-operator plans for every stage of a heterogeneous pipeline (the CFP passes per stage).

For each stage — its layers, its TP sub-mesh, its pipeline's micro-batch and its per-device memory — the
stage's training step on one micro-batch (`cfp.runtime.stage_replay.stage_step`: forward, ``jax.vjp``
backward, gradient accumulation and the AdamW update, built from the stage functions of `StageProgram`) is
analysed, its unique segments are profiled (through the profile cache, so segments with the same shapes on
the same sub-mesh are shared by stages, pipelines and later runs) and per-block strategies are searched under
the memory budget, parameter/optimizer-state sharding (ZeRO-3) included. Among the verified plans the search's
step time plus the boundary transfer — the bytes each of the stage's devices receives for its incoming
activation and outgoing activation's gradient in the layouts that plan gives them — picks the winner, which
is then timed side by side with the stage's Megatron sharding (`cfp.runtime.stage_compare`: both stages'
runtime programs, timed in turns); the faster one runs, so a stage plan is never slower than Megatron beyond
the measured noise.

The runtime runs what was searched: its forward, backward and update programs are cut from the analysed
stage step under the plan's choice, every block tensor constrained to its searched layout
(`cfp.runtime.stage_replay.StageReplay`). Stages of one device need no search (everything replicated).
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

from cfp.xla.log import quiet_compiles
from cfp.errors import ConfigError, InfeasibleError
from cfp.files import write_json_atomic
from cfp.analysis.analysis import analyze_with_program
from cfp.profiling.options import ProfileOptions, default_cache_dir
from cfp.profiling.profiler import profile
from cfp.layout import Layout, PlacedStage
from cfp.search.options import SearchOptions
from cfp.search.plan import spec_entries
from cfp.search.search import search
from cfp.sharding.specs import resolve
from cfp.runtime.stage import StageProgram
from cfp.runtime.stage_replay import StageReplay, stage_step

PLANS_FILE = "stage_plans.json"
PLANS_VERSION = 3   # 2: the analysed step accumulates gradients; Megatron may win a stage; 3: `Layout.to_json`


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
    verify: int = 1           # DP solutions verified whole (the uniform ones and Megatron join them)
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


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """One stage's plan: per-block strategy `choice` (with their notation), blocks whose state is stored
    sharded, each parameter's PartitionSpec entries by key path, the activation layouts at its boundaries,
    and the search's figures (`time`: per micro-batch, the stage's runtime programs measured side by side
    with Megatron's — fwd, bwd and a share of the update — or the whole step estimated, per `profiler`).
    `megatron`: the stage's Megatron sharding was faster than the searched choice side by side
    (`megatron_time`, same step and timing method) and runs instead."""

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
    megatron: bool = False
    megatron_time: float = 0.0
    megatron_boundary_time: float = 0.0
    megatron_memory: int = 0

    @property
    def key(self) -> tuple[int, int]:
        return (self.pipeline, self.stage)

    def matches(self, st: PlacedStage, micro_batch_size: int) -> bool:
        return (self.key == st.key and self.tp == st.tp and tuple(self.layers) == (st.layer_start, st.layer_end)
                and self.micro_batch_size == micro_batch_size)

    def summary(self) -> str:
        """How many blocks/parameters the plan shards and the activation layouts at its boundaries."""
        if not self.strategies:
            return "replicated (1 device)"
        if self.megatron:
            return "Megatron sharding (the searched plan was slower side by side, or was the Megatron sharding)"
        sharded = sum(1 for _, e in self.params if any(x is not None for x in e))
        fmt = lambda e: "P(" + ", ".join(map(str, e)) + ")"
        return (f"{len(self.choice)} blocks, {len(set(self.strategies))} distinct strategies, "
                f"{sharded}/{len(self.params)} parameters sharded"
                + (f" (state sharded in {len(self.shard_state)} blocks)" if self.shard_state else "")
                + f", activation in {fmt(self.act_in)} out {fmt(self.act_out)}")


@dataclasses.dataclass(frozen=True)
class StagePlans:
    """Every stage's plan for one model and layout; saved as JSON in a directory. `config`: the model config
    the stages were searched for (its fields), `device`: the kind of device their times were taken on
    ("cpu" here), so `cfp plan --stage-times` can use measured stage times for stages of the same shape."""

    model: str
    layout: Layout
    plans: tuple[StagePlan, ...]
    config: dict = dataclasses.field(default_factory=dict)
    device: str = ""

    def check(self, layout: Layout, model: str) -> "StagePlans":
        """Raise ConfigError unless every stage of `layout` has a plan made for it."""
        if model != self.model:
            raise ConfigError(f"stage plans were made for model {self.model!r}, not {model!r}")
        by_key = {p.key: p for p in self.plans}
        for st in layout.placed:
            p, mb = by_key.get(st.key), layout.pipelines[st.pipeline].micro_batch
            if p is None or not p.matches(st, mb):
                raise ConfigError(f"stage plans (layout {self.layout.summary()}) have no plan for stage {st.key} "
                                  f"(TP {st.tp}, layers {st.layer_start}..{st.layer_end - 1}, micro-batch "
                                  f"{mb}); search again for this layout")
        return self

    def save(self, directory: str) -> str:
        os.makedirs(directory, exist_ok=True)
        return write_json_atomic(os.path.join(directory, PLANS_FILE),
                                 {"version": PLANS_VERSION, **dataclasses.asdict(self),
                                  "layout": self.layout.to_json()})

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
        layout = Layout.from_json(d.get("layout"), f"stage plans {path!r}: layout")
        try:
            plans = tuple(_plan_from_dict(p) for p in d["plans"])
            return cls(str(d["model"]), layout, plans, dict(d.get("config", {})),
                       str(d.get("device", "")))
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
def example_args(prog: StageProgram, tx, micro_batch: int, seq_len: int, x_like, y_like) -> tuple:
    """Concrete (zero) arguments of `stage_step`: the search compiles and may time the whole step."""
    zeros = lambda s: np.zeros(s.shape, s.dtype)
    params = jax.tree_util.tree_map(zeros, prog.params_like)
    opt = jax.tree_util.tree_map(zeros, jax.eval_shape(tx.init, prog.params_like))
    acc = jax.tree_util.tree_map(zeros, prog.params_like)
    x = zeros(x_like)
    one = np.float32(1.0)
    if prog.stage.is_last:
        return (params, opt, acc, x, np.zeros((micro_batch, seq_len), np.int32),
                np.ones((micro_batch, seq_len), np.float32), one, one)
    return params, opt, acc, x, zeros(y_like), one


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


def _pick(analysis, result, prog, x_like, y_like, budget, n_act: int):
    """(verified plan, resolved plan, boundary seconds) with the least step time plus boundary transfer;
    `n_act`: flat position of the input activation in the stage step (its output's gradient follows)."""
    best = None
    for v in result.verified:
        if not math.isfinite(v.time) or (budget is not None and v.memory > budget):
            continue
        applied = resolve(analysis, v.choice, v.shard_state)
        act_in = applied.input_specs[n_act]
        act_out = applied.input_specs[n_act + 1] if y_like is not None else P()
        b = boundary_seconds(prog, act_in, act_out, x_like, y_like, result.link_gbps)
        if best is None or v.time + b < best[0].time + best[2]:
            best = (v, applied, b)
    if best is None:
        raise InfeasibleError(f"stage {prog.stage.key}: no verified plan fits {budget} bytes per device")
    return best


# Analysed stage steps by stage signature and optimizer: the search and the runtime's replays share them.
_ANALYSED: dict[tuple, tuple] = {}


def _signature(model_name: str, config: Any, st: PlacedStage, micro_batch: int, tx) -> tuple:
    return (model_name, config, tuple(st.module_names()), st.tp, micro_batch, st.is_first, st.is_last, tx)


def analysed_step(prog: StageProgram, tx, model_name: str, config: Any, micro_batch: int, x_like, y_like):
    """(analysis, program, example args) of the stage's `stage_step` (cached per stage signature)."""
    key = _signature(model_name, config, prog.stage, micro_batch, tx)
    if key not in _ANALYSED:
        args = example_args(prog, tx, micro_batch, config.seq_len, x_like, y_like)
        analysis, program = analyze_with_program(stage_step(prog, tx), prog.mesh, *args)
        _ANALYSED[key] = (analysis, program, args)
    return _ANALYSED[key]


def search_stage(prog: StageProgram, tx, model_name: str, config: Any, micro_batch: int, chunks: int, x_like,
                 y_like, options: StagePlanOptions, log: Callable[[str], None] = print) -> StagePlan:
    """Analyse, profile and search one stage on its own sub-mesh, then time the winner side by side with
    the Megatron sharding; see the module doc."""
    from cfp.runtime.stage_compare import compare_with_megatron
    marks = [time.perf_counter()]
    analysis, program, args = analysed_step(prog, tx, model_name, config, micro_batch, x_like, y_like)
    marks.append(time.perf_counter())
    quiet = lambda *_: None
    sopts = options.search_options()
    n_params = len(jax.tree_util.tree_leaves(args[0]))
    n_act = 2 * n_params + len(jax.tree_util.tree_leaves(args[1]))
    last = prog.stage.is_last
    # candidate compiles: the profile, the verified whole steps and the side by side with Megatron
    with quiet_compiles(f"stage p{prog.stage.pipeline}s{prog.stage.index} candidate compiles"):
        table = profile(program, analysis, options.profile_options(), log=quiet)
        marks.append(time.perf_counter())
        result = search(program, analysis, table, args, sopts, log=quiet, mesh=prog.mesh)
        marks.append(time.perf_counter())
        v, applied, boundary = _pick(analysis, result, prog, x_like, None if last else y_like,
                                     sopts.memory_per_device, n_act)
        meg = compare_with_megatron(prog, tx, args, analysis, result, v, applied, boundary, boundary_seconds(
            prog, P(), P(), x_like, None if last else y_like, result.link_gbps), chunks, options, table.profiler)
    marks.append(time.perf_counter())
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(prog.params_like)[0]]
    st = prog.stage
    plan = StagePlan(
        st.pipeline, st.index, st.tp, (st.layer_start, st.layer_end), micro_batch, tuple(v.choice),
        tuple(analysis.notation(b, c) for b, c in enumerate(v.choice)), tuple(v.shard_state),
        tuple((k, _entries(s)) for k, s in zip(paths, applied.input_specs[:n_params])),
        _entries(applied.input_specs[n_act]), _entries(applied.input_specs[n_act + 1]) if not last else (),
        meg.searched_time if meg and not meg.same_sharding else float(v.time), float(boundary), int(v.memory),
        str(table.profiler), int(table.compiles), marks[-1] - marks[0],
        bool(meg and (meg.megatron_wins or meg.same_sharding)),
        meg.megatron_time if meg else 0.0, meg.megatron_boundary if meg else 0.0,
        meg.megatron_memory if meg else 0)
    log(f"stage p{st.pipeline}s{st.index} (TP {st.tp}, {len(analysis.blocks)} blocks, "
        f"{analysis.num_unique_segments} unique segments): profiled {table.compiles} combinations "
        f"({'nothing compiled, all from the profile cache' if table.compiles == 0 else 'compiled'}), "
        f"planned in {plan.planning_time:.1f} s (analysis {marks[1] - marks[0]:.1f}, profiling "
        f"{marks[2] - marks[1]:.1f}, search with {len(result.verified)} whole steps verified "
        f"{marks[3] - marks[2]:.1f}, Megatron side by side {marks[4] - marks[3]:.1f}; measured)"
        + (f"; {meg.text()}" if meg else "") + f": {plan.summary()}")
    return plan


def _replicated(st: PlacedStage, micro_batch: int, params_like) -> StagePlan:
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params_like)[0]]
    return StagePlan(st.pipeline, st.index, st.tp, (st.layer_start, st.layer_end), micro_batch, (), (), (),
                     tuple((k, ()) for k in paths), (), ())


def _stage_programs(model_name: str, config: Any, layout: Layout, tx, devices: Optional[list]):
    """(stage, micro-batch, Megatron `StageProgram`, input activation, output activation) of every stage."""
    from cfp.models import init_params, stage_modules
    devices = list(devices) if devices is not None else jax.devices()
    modules = stage_modules(model_name, config)
    full_like = jax.eval_shape(lambda: init_params(model_name, config, 0))
    for i, pipe in enumerate(layout.pipelines):
        mbs = pipe.micro_batch
        x_like = jax.ShapeDtypeStruct((mbs, config.seq_len), jnp.int32)
        for st in layout.placed_in(i):
            params_like = {"params": {n: full_like["params"][n] for n in st.module_names()}}
            prog = StageProgram(st, modules, [devices[d] for d in st.devices], params_like, tx)
            y_like = jax.eval_shape(prog.forward, params_like, x_like)[0]
            yield st, mbs, prog, x_like, y_like
            x_like = y_like


def search_stage_plans(model_name: str, config: Any, layout: Layout, tx: optax.GradientTransformation,
                       options: StagePlanOptions, devices: Optional[list] = None,
                       log: Callable[[str], None] = print) -> StagePlans:
    """Search every stage's plan (stages equal in layers, TP and micro-batch are searched once)."""
    done: dict[tuple, StagePlan] = {}
    plans = []
    for st, mbs, prog, x_like, y_like in _stage_programs(model_name, config, layout, tx, devices):
        key = (tuple(st.module_names()), st.tp, mbs, st.is_first, st.is_last)
        if st.tp == 1:
            plan = _replicated(st, mbs, prog.params_like)
        elif key in done:
            plan = dataclasses.replace(done[key], pipeline=st.pipeline, stage=st.index)
        else:
            chunks = layout.pipelines[st.pipeline].chunks
            plan = done[key] = search_stage(prog, tx, model_name, config, mbs, chunks, x_like, y_like, options,
                                             log)
        plans.append(plan)
    devices = list(devices) if devices is not None else jax.devices()
    return StagePlans(model_name, layout, tuple(plans), dataclasses.asdict(config),
                      device_kind(devices[0]))


def device_kind(device) -> str:
    """The GPU-catalog-style name of the device stage times were taken on ("cpu" for host devices)."""
    return "cpu" if device.platform == "cpu" else str(device.device_kind)


_REPLAYS: dict[tuple, StageReplay] = {}


def stage_replays(plans: StagePlans, config: Any, layout: Layout, tx: optax.GradientTransformation,
                  devices: Optional[list] = None) -> dict:
    """Stage key -> `StageReplay` of every stage whose plan runs a searched choice (the others run the
    Megatron sharding). Saved plans are re-analysed (no profiling, no search) and checked against the
    analysis: same blocks, same strategies, same parameter layouts."""
    by_key = {p.key: p for p in plans.plans}
    out = {}
    for st, mbs, prog, x_like, y_like in _stage_programs(plans.model, config, layout, tx, devices):
        plan = by_key[st.key]
        if not plan.strategies or plan.megatron:
            continue
        key = _signature(plans.model, config, st, mbs, tx) + (plan.choice, plan.shard_state)
        if key not in _REPLAYS:
            analysis, program, _ = analysed_step(prog, tx, plans.model, config, mbs, x_like, y_like)
            _REPLAYS[key] = StageReplay(program, analysis, _checked(plan, analysis, prog), st.is_first,
                                        st.is_last)
        out[st.key] = _REPLAYS[key]
    return out


def _checked(plan: StagePlan, analysis, prog: StageProgram):
    """The plan's `StepShardings` on the re-analysed stage step; ConfigError if the plan does not fit it."""
    notation = tuple(analysis.notation(b, c) for b, c in enumerate(plan.choice)) if len(plan.choice) == len(
        analysis.blocks) and all(c < len(b.strategies) for b, c in zip(analysis.blocks, plan.choice)) else None
    applied = resolve(analysis, plan.choice, plan.shard_state) if notation == plan.strategies else None
    specs = applied and tuple(_entries(s) for s in applied.input_specs[:len(plan.params)])
    if applied is None or specs != tuple(e for _, e in plan.params):
        raise ConfigError(f"stage plan of stage {plan.key} does not fit the analysed stage step "
                          f"({len(analysis.blocks)} blocks): it was made by another cfp or model code; "
                          "search again")
    return applied


def plans_for_run(options: Optional[StagePlanOptions], model_name: str, config: Any, layout: Layout,
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


def _fits(directory: str, layout: Layout, model_name: str, log) -> bool:
    """Whether `directory` holds stage plans for this layout (a run may resume onto another layout)."""
    if not os.path.isfile(os.path.join(directory, PLANS_FILE)):
        return False
    try:
        StagePlans.load(directory).check(layout, model_name)
        return True
    except ConfigError as e:
        log(f"not reusing the checkpointed stage plans: {e}")
        return False


def report_lines(plans: StagePlans, layout: Layout, busy: dict) -> list[str]:
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
            line += (f"; searched: {p.memory / 2**20:.2f} MiB per device (compiled), step {kind} "
                     f"{p.time * chunks:.4f} s ({chunks} micro-batches) + boundary estimated "
                     f"{p.boundary_time * chunks:.4f} s")
        if p.megatron_time:
            mem = f"{p.megatron_memory / 2**20:.2f} MiB per device (compiled), " if p.megatron_memory else ""
            line += (f"; Megatron side by side: {mem}step {p.megatron_time * chunks:.4f} s + boundary "
                     f"{p.megatron_boundary_time * chunks:.4f} s; {'Megatron' if p.megatron else 'searched'} runs")
        if p.key in busy:
            line += f"; busy measured {busy[p.key]:.4f} s/step"
        out.append(line)
    return out
