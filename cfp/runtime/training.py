"""A training run of the heterogeneous engine on any `LayeredModel`: data, checkpoints, timeline, verification,
reporting.

``train_pipelines(model, optimizer, layout, batches, ...)`` is the Python API for a user's model;
``run_training(TrainOptions(...))`` is what ``cfp train`` calls for the zoo's models (an AdamW of ``--lr`` and
``--weight-decay``, the stdlib / file / synthetic data; the zoo model is resolved once, at the entry). Both run the
same named steps (`_run`): check the job, plan the stages (`_plan_stages`: the rules table, saved plans or the CFP
search per stage, from `cfp.runtime.stage.plan_sources`), build the stages (`_build_stages`: the trainer), start or
resume, train (`_train`), report (`_report`), verify. Batches depend only on the step,
so a resumed run sees the same data as an uninterrupted one; checkpoints hold the layout-independent state (the
model's parameter tree and its optax state), so a run can resume onto a different layout.
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
from cfp.runtime import heap
from cfp.runtime.measured_tables import (TableSource, gather_events, generate_from_measured, replay_timeline,
                                         simulated_line)
from cfp.recompute import Recompute, StageRecompute, parse_stage_recompute, resolve
from cfp.runtime.vstages import expand, per_pipeline
from cfp.schedules.registry import SCHEDULES, ScheduleName, ScheduleSpec

if TYPE_CHECKING:
    import optax

    from cfp.layered.model import LayeredModel
    from cfp.runtime.stage.cache import CompileCache
    from cfp.runtime.stage.plans import StagePlanOptions


def _check_no_ignored_options(o: "RunOptions") -> None:
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
    ]
    for bad, message in ignored:
        if bad:
            raise ConfigError(message)


def _searches_stage_plans(o: "RunOptions") -> bool:
    """Whether the run searches stage plans (it keeps them in ``<checkpoint_dir>/stage_plans``)."""
    from cfp.runtime.stage.plans import StagePlanMode
    return o.stage_plans is not None and o.stage_plans.mode is StagePlanMode.SEARCH


class DataSource(str, enum.Enum):
    STDLIB = "stdlib"        # Python standard library sources, byte-level
    SYNTHETIC = "synthetic"  # cfp.models.make_batch random tokens
    FILES = "files"          # --data-path files/directories, byte-level


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """How a pipeline run goes, whatever the model: its layout and schedule, steps, checkpoints, timeline,
    verification against one device and stage plans (None: the rules table)."""
    layout: Layout
    # defaults shared with `cfp train` (cfp/cli/common.py; a test keeps them equal)
    schedule: ScheduleName = ScheduleName.ONE_F_ONE_B
    v: int = 0            # virtual stages per stage (0: the schedule's own; ``schedule="interleaved:3"`` sets it too)
    steps: int = 5
    checkpoint_dir: Optional[str] = None
    checkpoint_every: int = 0
    keep_checkpoints: Optional[int] = 3   # newest checkpoints kept (orbax retention); None keeps all
    resume: bool = False
    timeline_dir: Optional[str] = None
    verify: bool = False
    verify_tol: Optional[float] = None
    stop_after: Optional[int] = None  # stop (as if killed) after this many steps; for tests
    stage_plans: Optional["StagePlanOptions"] = None  # None: the rules table on the model's logical dim names
    tables: TableSource = TableSource.GENERATED   # adaptable schedules: pattern, or generated from measured times
    # what each stage's backward recomputes (`cfp.recompute`): one policy, ``auto`` (the layout file's per-stage
    # choice where it has one, else none), or per pipeline one policy per stage
    recompute: Any = Recompute.AUTO
    # per pipeline, its own schedule (a layout file's plan); empty: ``schedule`` (with ``v``) for every pipeline
    schedules: tuple = ()

    def __post_init__(self):
        if not isinstance(self.layout, Layout):
            raise ConfigError(f"layout={self.layout!r} must be a cfp.Layout")
        spec = ScheduleSpec.parse(self.schedule)
        spec = ScheduleSpec(spec.name, self.v) if self.v else spec
        object.__setattr__(self, "schedule", spec.name)
        object.__setattr__(self, "v", spec.v)
        try:
            object.__setattr__(self, "tables", TableSource(self.tables))
        except ValueError:
            raise ConfigError(f"tables={self.tables!r} is invalid (valid: "
                              f"{', '.join(t.value for t in TableSource)})") from None
        if self.verify_tol is not None and not (math.isfinite(self.verify_tol) and self.verify_tol > 0):
            raise ConfigError(f"verify_tol={self.verify_tol!r} is invalid (must be a finite number > 0)")
        for name in ("steps", "stop_after"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ConfigError(f"{name}={v!r} is invalid (must be a positive integer)")
        if not isinstance(self.checkpoint_every, int) or self.checkpoint_every < 0:
            raise ConfigError(f"checkpoint_every={self.checkpoint_every!r} is invalid (must be an integer >= 0)")
        k = self.keep_checkpoints
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
            raise ConfigError(f"keep_checkpoints={k!r} is invalid (must be a positive integer, or None to keep all)")
        stages = [p.num_stages for p in self.layout.pipelines]
        if self.schedules:
            object.__setattr__(self, "schedules", per_pipeline(tuple(self.schedules), len(stages)))
        object.__setattr__(self, "recompute", self.recompute if isinstance(self.recompute, Recompute) else (
            parse_stage_recompute(self.recompute, stages, "recompute")
            if isinstance(self.recompute, (list, tuple)) else Recompute.parse(self.recompute)))
        _check_no_ignored_options(self)

    @property
    def stage_recompute(self) -> StageRecompute:
        """Every stage's recompute policy (``auto`` resolved: none)."""
        return resolve(self.recompute, [p.num_stages for p in self.layout.pipelines])

    @property
    def spec(self) -> ScheduleSpec:
        """The schedule with its virtual stages per stage (pipeline 0's, where the pipelines have their own)."""
        return self.specs[0]

    @property
    def specs(self) -> tuple[ScheduleSpec, ...]:
        """Each pipeline's schedule."""
        return self.schedules or (ScheduleSpec(self.schedule, self.v),) * len(self.layout.pipelines)


@dataclass(frozen=True, kw_only=True)
class TrainOptions(RunOptions):
    """`cfp train`'s run of a zoo model: the model by name, its config and overrides, AdamW's learning rate and
    weight decay, the seed and the data."""
    model: str
    config_name: str = "tiny"
    overrides: dict = field(default_factory=dict)
    learning_rate: float = 1e-3
    weight_decay: float = 0.01
    seed: int = 0
    data: DataSource = DataSource.STDLIB
    data_paths: tuple[str, ...] = ()

    def __post_init__(self):
        for name in ("learning_rate", "weight_decay"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0) or (
                    name == "learning_rate" and v == 0):
                raise ConfigError(f"{name}={v!r} is invalid (must be a finite number "
                                  f"{'> 0' if name == 'learning_rate' else '>= 0'})")
        if self.data_paths and self.data is not DataSource.FILES:
            raise ConfigError(f"data_paths (--data-path) are only read with data=files (--data files), not "
                              f"{self.data.value}")
        super().__post_init__()


@dataclass
class TrainResult:
    losses: dict[int, float]             # step number (1-based) -> loss
    tokens_per_s: Optional[float]        # measured over the steps after the first (which traces); None: no such step
    busy: dict[tuple[int, int], float]   # mean seconds per step each stage computed
    bubbles: dict[int, dict[str, float]]
    verify_error: Optional[float] = None
    verify_ok: bool = True
    step_seconds: list[float] = field(default_factory=list)   # measured, per step after the first
    tokens_per_cpu_s: Optional[float] = None   # the same tokens over the process's CPU time (all threads): the
    # step's work, which other load on a shared host does not inflate as it does wall time
    kept_peak: dict = field(default_factory=dict)       # last step: local stage -> most activation bytes kept
    kept_predicted: dict = field(default_factory=dict)  # ... and its schedule's prediction (bytes per device)
    # per pipeline, the makespan simulated from each stage's median F/B/W, every stage owning its compute (seconds;
    # one process: actions measured one at a time after the timed steps; several: every measured action of them)
    median_makespan: dict = field(default_factory=dict)
    params: Any = None                   # train_pipelines: the trained parameters (host numpy, the model's structure)
    opt_state: Any = None                # ... and the optimizer state


class _Data:
    """The global batch of each step of a zoo run: byte-level corpus rows or the zoo's synthetic batches."""

    def __init__(self, source: DataSource, paths: tuple[str, ...], seed: int, model_name: str, config: Any,
                 rows: int):
        self.model_name, self.config, self.seed, self.rows = model_name, config, seed, rows
        self.corpus = None
        if source is not DataSource.SYNTHETIC:
            if model_name == "bert":
                raise ConfigError("--data stdlib/files gives next-token batches; BERT needs "
                                  "--data synthetic (masked-LM batches)")
            if config.vocab_size < 256:
                raise ConfigError(f"byte-level data needs vocab_size >= 256, the model has "
                                  f"{config.vocab_size}")
            from cfp.corpus import ByteCorpus
            if source is DataSource.STDLIB:
                self.corpus = ByteCorpus.from_python_stdlib(config.seq_len, seed=seed)
            else:
                if not paths:
                    raise ConfigError("--data files needs --data-path PATH [PATH ...]")
                self.corpus = ByteCorpus.from_paths(list(paths), config.seq_len, seed=seed)

    def batch(self, step: int) -> dict:
        """Global batch of (0-based) ``step``: depends only on the seed and the step."""
        if self.corpus is not None:
            return self.corpus.batch(self.rows, step)
        from cfp.models import make_batch
        key = jax.random.fold_in(jax.random.PRNGKey(self.seed), step)
        with jax.default_device(jax.local_devices(backend="cpu")[0]):
            return jax.tree_util.tree_map(np.asarray,
                                          make_batch(self.model_name, self.config, self.rows, key))


def _print0(*a, **k):
    if jax.process_index() == 0:
        print(*a, **k, flush=True)


def build_config(opts: TrainOptions):
    from cfp.models import get_config
    return get_config(opts.model, opts.config_name, **opts.overrides)


def _check_before_work(opts: RunOptions) -> None:
    """Output paths, the checkpoint to resume and the processes of the job, before any compile."""
    from cfp.runtime.launch import check_layout_fills_processes
    saves_plans = bool(opts.checkpoint_dir) and _searches_stage_plans(opts)
    check_layout_fills_processes(list(opts.layout.devices))  # no idle process
    if opts.resume:
        from cfp.runtime.checkpoint import latest_step
        if latest_step(opts.checkpoint_dir) is None:
            raise ConfigError(f"resume: no complete checkpoint in checkpoint_dir="
                              f"{opts.checkpoint_dir!r}")
    if opts.timeline_dir:
        check_output_dir(opts.timeline_dir, "timeline_dir")
    if opts.checkpoint_every or saves_plans:
        check_output_dir(opts.checkpoint_dir, "checkpoint_dir")


@dataclass(frozen=True)
class _Job:
    """What one run trains: the model, its optimizer, step -> global batch, the checkpoint settings that must match
    on resume, the single-device reference of ``--verify`` and a line describing the model."""
    model: "LayeredModel"
    optimizer: "optax.GradientTransformation"
    batches: Callable[[int], Any]
    settings: dict
    reference: Callable[[], Any]
    describe: str


def train_pipelines(model: "LayeredModel", optimizer: "optax.GradientTransformation", layout: Any, batches: Any, *,
                    steps: int = 5, schedule: "str | ScheduleName" = ScheduleName.ONE_F_ONE_B, verify: bool = False,
                    checkpoint_dir: Optional[str] = None, log: Callable[..., None] = None,
                    cache: Optional["CompileCache"] = None, **run_options: Any) -> "TrainResult":
    """Train ``model`` with ``optimizer`` (any optax transformation) on ``layout`` (a `cfp.Layout` or a layout file)
    for ``steps`` steps. ``batches``: a list or iterable of per-step global batches (a generator, a data loader), one
    batch whose rows the steps take in turn, or ``batches(step, rows) -> global batch`` (`cfp.runtime.feed`; every
    batch checked against step 0's before it runs; in a multi-process job a per-step batch may be this process's share
    of the rows, `cfp.process_share`). ``checkpoint_dir`` with ``checkpoint_every=K`` saves atomic
    checkpoints, with ``resume=True`` continues from the newest (onto any layout); ``verify`` replays the steps on
    one device with the model's own loss and the optimizer and compares; other keywords are `RunOptions` fields
    (``timeline_dir``, ``stage_plans``, ...). Returns the `TrainResult`."""
    from cfp.runtime.feed import step_batches
    from cfp.runtime.user_model import UserModel
    from cfp.layered.model import LayeredModel
    if not isinstance(model, LayeredModel):
        raise ConfigError(f"model={type(model).__name__} must be a cfp.LayeredModel")
    layout, filed = _layout_of(layout)
    if filed and Recompute.parse(run_options.get("recompute", Recompute.AUTO)) is Recompute.AUTO:
        run_options["recompute"] = filed      # the layout file's per-stage choice
    if checkpoint_dir and not (run_options.get("checkpoint_every") or run_options.get("resume")
                               or run_options.get("stage_plans")):
        run_options["checkpoint_every"] = steps
    opts = RunOptions(layout=layout, steps=steps, schedule=ScheduleName.parse(schedule), verify=verify,
                      checkpoint_dir=checkpoint_dir, **run_options)
    user = UserModel(model, step_batches(batches, model), optimizer, model.name)
    return train_user_model(user, opts, log, cache, keep_state=True)


def train_user_model(user: Any, opts: RunOptions, log: Callable[..., None] = None,
                     cache: Optional["CompileCache"] = None, keep_state: bool = False) -> "TrainResult":
    """A user's model, batches and optimizer (`cfp.runtime.user_model.UserModel`) trained as `opts` says;
    ``keep_state``: the result holds the trained parameters and optimizer state."""
    from cfp.runtime.feed import step_batches
    from cfp.runtime.verify import model_reference
    model, rows = user.model, opts.layout.global_batch
    # checked before anything compiles; an iterator's batches kept for the replay of --verify only; this
    # process's share of each step placed at its rows (`cfp.runtime.feed.Share`)
    batches = step_batches(user.batches, model).for_run(opts.layout, replay=opts.verify)
    job = _Job(model, user.optimizer, batches, _model_settings(model, rows),
               lambda: model_reference(model, user.optimizer),
               f"model {model.name}{'' if user.spec == model.name else ' from ' + user.spec} "
               f"({model.num_layers} layers)")
    return _run(job, opts, log or _print0, cache, keep_state)


def _layout_of(layout: Any) -> tuple[Layout, StageRecompute]:
    """The layout, and the per-stage recompute policies its layout file gives (empty for a `Layout`)."""
    if isinstance(layout, Layout):
        return layout, ()
    if isinstance(layout, (str, os.PathLike)):
        from cfp.planner.layout_file import load_layout_file
        lf = load_layout_file(os.fspath(layout))
        return lf.layout, lf.recompute
    raise ConfigError(f"layout={layout!r} must be a cfp.Layout or the path of a layout file")


def _model_settings(model: "LayeredModel", rows: int) -> dict:
    """What a checkpoint of a user's model must match on resume: its name, parameter shapes and batch rows."""
    shapes = [f"{jax.tree_util.keystr(p)}:{np.dtype(jax.numpy.result_type(a)).name}{list(np.shape(a))}"
              for p, a in jax.tree_util.tree_flatten_with_path(model.params)[0]]
    import hashlib
    return {"model": model.name, "params": hashlib.sha256("\n".join(shapes).encode()).hexdigest()[:16],
            "batch_rows": rows}


def run_training(opts: TrainOptions, log: Callable[..., None] = _print0,
                 cache: Optional["CompileCache"] = None) -> "TrainResult":
    """Train the zoo model ``opts.model`` ``opts.steps`` steps with AdamW (continuing from a checkpoint with
    ``resume``); see the module doc. ``cache``: the compile cache to build stage programs through (default a new
    one; runs of one model and optimizer in one process may share one so that they compile each program once)."""
    from cfp.models.layered import zoo_model
    from cfp.runtime.engine import adamw
    from cfp.runtime.verify import zoo_reference
    config = build_config(opts)      # the zoo model, resolved once: what follows takes its config or model
    # the data first: it refuses a model it cannot feed before the model is built
    data = _Data(opts.data, opts.data_paths, opts.seed, opts.model, config, opts.layout.global_batch)
    model = cache.model if cache is not None else zoo_model(opts.model, config, opts.seed)
    tx = cache.tx if cache is not None else adamw(opts.learning_rate, opts.weight_decay)
    lr, wd = opts.learning_rate, opts.weight_decay
    job = _Job(model=model, optimizer=tx, batches=data.batch, settings=checkpoint_settings(opts),
               reference=lambda: zoo_reference(opts.model, config, lr, wd),
               describe=f"model {opts.model}/{opts.config_name} ({config.num_layers} layers, hidden "
                        f"{config.hidden_size}, seq {config.seq_len}, {config.dtype})")
    return _run(job, opts, log, cache)


def _run(job: _Job, opts: RunOptions, log: Callable[..., None], cache: Optional["CompileCache"],
         keep_state: bool = False) -> "TrainResult":
    """The run as named steps: check the job, plan the stages, build the stages, train, report, verify."""
    from cfp.runtime.stage.cache import CompileCache
    _check_before_work(opts)
    # one compile cache: the stage programs the plan search builds are the ones the trainer runs
    cache = cache if cache is not None else CompileCache(job.model, job.optimizer)
    example = job.batches(0)
    plans = _plan_stages(opts, cache, example, log)
    trainer = _build_stages(job, opts, cache, example, plans)
    store = _Checkpoints(opts.checkpoint_dir, opts.checkpoint_every, opts.keep_checkpoints, job.settings,
                         opts.layout)
    start, losses = _initial_state(store, opts.resume, job.model, trainer, log)
    init_state = trainer.state()[:2] if opts.verify else None
    result, last_events, every_event = _train(trainer, job, opts, store, start, losses, log,
                                              packed="segment_ids" in example)
    _report(trainer, job, opts, plans, result, last_events, log)
    result.median_makespan = _median_makespans(trainer, every_event, example, log)
    if opts.verify:
        result.verify_error, result.verify_ok = _verify(job, trainer, init_state, start, losses, opts.verify_tol,
                                                        log)
    if keep_state:
        result.params, result.opt_state, _ = trainer.state()
    return result


def _plan_stages(opts: RunOptions, cache: "CompileCache", example: Any, log) -> Any:
    """The run's stage plans from the source its options name (`cfp.runtime.stage.plan_sources`); None: the rules
    table."""
    from cfp.runtime.stage.plan_sources import PlanRequest, plans_for_run
    from cfp.runtime.stage.plans import StagePlanOptions
    # under virtual stages the programs are per virtual stage (`cfp.runtime.vstages`): so are the plans
    layout = expand(opts.layout, opts.specs).run if any(s.v > 1 for s in opts.specs) else opts.layout
    return plans_for_run(PlanRequest(options=opts.stage_plans or StagePlanOptions(), layout=layout,
                                     cache=cache, batch_like=example, checkpoint_dir=opts.checkpoint_dir,
                                     resume=opts.resume, log=log))


def _build_stages(job: _Job, opts: RunOptions, cache: "CompileCache", example: Any, plans: Any):
    """The trainer holding every stage's program (from `plans` where given, else the rules table)."""
    from cfp.runtime.engine import HeteroTrainer
    return HeteroTrainer(job.model, job.optimizer, opts.layout, opts.specs, example_batch=example, plans=plans,
                         cache=cache, recompute=opts.stage_recompute)


def _train(trainer, job: _Job, opts: RunOptions, store: "_Checkpoints", start: int, losses: dict[int, float],
           log, packed: bool = False):
    """Compile, generate adaptable schedules' tables from measured times, then train the steps left after
    `start` (`packed`: the batches carry segment ids); returns (result, the events of the step the timeline
    shows)."""
    from cfp.models.attention_select import header_line
    log(f"{job.describe}; schedule {schedules_text(trainer.specs)}; recompute {recompute_text(trainer.recompute)}; "
        f"{jax.process_count()} process(es), {opts.layout.num_devices} devices")
    log(header_line(job.model.config, packed))     # the attention the zoo model's stages are traced with
    log(opts.layout.describe())
    if start < opts.steps:
        log(f"compiled {len(trainer.programs)} stages in {trainer.compile():.1f} s")
    if opts.tables is TableSource.GENERATED and any(s.entry.adapts for s in opts.specs) and start < opts.steps:
        generate_from_measured(trainer, job.batches(start), log)
    return _train_steps(trainer, job.batches, range(start, opts.steps), opts.stop_after, store, losses, log)


def _report(trainer, job: _Job, opts: RunOptions, plans: Any, result: "TrainResult", last_events, log) -> None:
    """Stage plans against measured busy times, kept activations against their prediction, the bubble and the
    timeline."""
    from cfp.runtime.stage.plans import report_lines
    for line in report_lines(plans, opts.layout, result.busy) if plans else ():
        log(line)
    if result.kept_peak:
        result.kept_predicted = trainer.kept_prediction()
        log(_kept_line(result.kept_peak, result.kept_predicted))
    if last_events is not None:   # the tables every step ran: set before the first (`generate_from_measured`)
        ran = {q: trainer.table(q) for q in range(len(opts.layout.pipelines))}
        kept = {q: trainer.kept_bytes(q) for q, pipe in enumerate(opts.layout.pipelines) if pipe.chunks}
        result.bubbles = _timeline(opts, job, last_events, log, len(trainer.order), ran, kept)


def _train_steps(trainer, batches: Callable[[int], Any], steps: range, stop_after: Optional[int],
                 store: "_Checkpoints", losses: dict[int, float], log):
    """The (0-based) `steps` (``stop_after``: stop after that many), each saved when ``store.every`` says;
    returns (result, last events)."""
    start = steps.start
    timed, busy_sum, busy_steps, last_events, full, step, kept = [], {}, {}, None, False, start, {}
    every_event = []      # every measured action of the timed steps
    with heap.steady() as settle:     # the collector off the objects the first step compiled
        for step in steps:
            stats = trainer.step(batches(step))
            settle()
            losses[step + 1] = stats.loss
            log(f"step {step + 1} loss {stats.loss:.8f} tokens/s {stats.tokens / stats.seconds:,.0f} "
                f"measured ({stats.seconds:.3f} s)")
            if step > start:  # the first step still traces (and warms caches); keep it out of rates
                timed.append(stats)
                every_event += stats.events
                for k, v in stats.busy().items():     # a stage's busy time only from steps it was measured in full
                    if k not in stats.unmeasured:
                        busy_sum[k], busy_steps[k] = busy_sum.get(k, 0.0) + v, busy_steps.get(k, 0) + 1
            if not stats.unmeasured or not full:   # the timeline: the last step measured in full, else the last step
                last_events, full = stats.events, not stats.unmeasured
            kept = stats.kept_peak
            if store.every and (step + 1) % store.every == 0:
                _save(store, trainer, losses)
            if stop_after is not None and step + 1 - start >= stop_after:
                break
    result = TrainResult(losses, None, {}, {}, step_seconds=[s.seconds for s in timed], kept_peak=kept)
    if timed:
        result.tokens_per_s = sum(s.tokens for s in timed) / sum(s.seconds for s in timed)
        cpu = sum(s.cpu_seconds for s in timed)
        result.tokens_per_cpu_s = sum(s.tokens for s in timed) / cpu if cpu > 0 else None
        result.busy = {k: v / busy_steps[k] for k, v in busy_sum.items()}
        per_cpu = f", {result.tokens_per_cpu_s:,.0f} per CPU second" if result.tokens_per_cpu_s else ""
        log(f"tokens/s {result.tokens_per_s:,.0f} measured{per_cpu} (mean over steps {start + 2}..{step + 1}; CPU: "
            "the process's threads, its work whatever else runs on the host)")
        line = "busy per stage (s/step, measured; mean over the steps each stage's actions were all measured): " + \
            ", ".join(f"p{k[0]}s{k[1]} {v:.4f} ({busy_steps[k]} of {len(timed)} steps)"
                      for k, v in sorted(result.busy.items()))
        if jax.process_count() > 1:  # each process measured its own stages
            print(f"{line} (process {jax.process_index()})", flush=True)
        else:
            log(line)
    return result, last_events, (every_event, len(timed))


SERIAL_PASSES = 3     # passes run one action at a time after the timed steps (each action's shortest is used)


def _median_makespans(trainer, every: tuple, batch: Any, log) -> dict[int, float]:
    """Per pipeline, the makespan its table gives with each stage's median F, B and W (every stage owning its
    compute). In one process the medians come from `SERIAL_PASSES` passes of ``batch`` (the run's example: an
    iterator's later batches are read once) run one action at a time
    after the timed steps, each action's shortest of them (`measured_alone`: another process preempting a millisecond
    action lengthens it several times): every stage here shares the host's cores, so an action timed beside others
    is stretched by them, the more the fewer bubbles a schedule leaves, which would price a bubble-free schedule by
    its own overlap. Under several processes they come from every measured action of the timed steps (a collective;
    a figure also when the host was too busy to watch every action of a step)."""
    from cfp.runtime.measured_tables import gather_events, measured_alone, median_costs
    from cfp.schedules.simulate import simulate
    events, steps = every
    if not steps:
        return {}
    tl = gather_events(events, len(trainer.order) * steps)
    serial = measured_alone(trainer, batch, SERIAL_PASSES)
    out = {}
    for q in range(len(trainer.run_layout.pipelines)):
        table = trainer.table(q)
        if not any(e.pipeline == q for e in tl.events):
            continue
        side = simulate(table, median_costs(tl.events, q, table.num_vstages)).makespan
        if serial is None or not any(e.pipeline == q for e in serial):
            out[q] = side
            log(f"pipeline {q}: makespan {side:.4f} s simulated from each stage's median F/B/W over "
                f"{sum(e.pipeline == q for e in tl.events)} measured actions of {steps} steps (every stage owning "
                f"its compute; {tl.unmeasured} actions unwatched)")
            continue
        out[q] = simulate(table, median_costs(serial, q, table.num_vstages)).makespan
        log(f"pipeline {q}: makespan {out[q]:.4f} s simulated from each stage's median F/B/W over "
            f"{sum(e.pipeline == q for e in serial)} actions measured one at a time (each the shortest of "
            f"{SERIAL_PASSES} passes after the timed steps; every stage owning its compute); from the timed steps' "
            f"actions, which shared the cores: {side:.4f} s")
    return out


def schedules_text(specs) -> str:
    """A run's schedules in one phrase: the schedule where every pipeline runs it, else each pipeline's."""
    specs = tuple(specs)
    if len(set(specs)) == 1:
        return str(specs[0])
    return ", ".join(f"{s} (pipeline {q})" for q, s in enumerate(specs))


def recompute_text(policies) -> str:
    """A run's per-stage recompute policies in one phrase: the policy where all stages share it."""
    flat = {p for row in policies for p in row}
    if len(flat) == 1:
        return flat.pop().value
    return "per stage " + "; ".join(f"pipeline {q}: {', '.join(p.value for p in row)}" for q, row in enumerate(policies))


def _kept_line(measured: dict, predicted: dict) -> str:
    """The last step's activations kept between actions per stage against its schedule's prediction."""
    mb = lambda b: f"{b / 2**20:.3f} MiB"
    return ("activations kept between actions, peak per device (last step, measured from the dispatcher's "
            "buffers; the schedule's prediction from the activation shapes): " + ", ".join(
                f"p{k[0]}s{k[1]} {mb(measured[k])} ({'=' if measured[k] == predicted.get(k) else 'vs'} "
                f"{mb(predicted.get(k, 0))} predicted)" for k in sorted(measured)))


def checkpoint_settings(opts: TrainOptions) -> dict:
    """The model, data and optimizer settings a checkpoint of a zoo run was written with (JSON)."""
    return {"model": opts.model, "config": opts.config_name, "overrides": dict(opts.overrides),
            "data": opts.data.value, "batch_rows": opts.layout.global_batch,
            "data_paths": [os.path.abspath(p) for p in opts.data_paths],
            "seed": opts.seed, "learning_rate": opts.learning_rate,
            "weight_decay": opts.weight_decay}


@dataclass(frozen=True)
class _Checkpoints:
    """Where a run keeps its checkpoints, every how many steps it saves one (0: never), how many it keeps, and
    what it records in each: the job's settings (which a resumed checkpoint must match) and the layout."""
    directory: Optional[str]
    every: int
    keep: Optional[int]
    settings: dict
    layout: Layout


def _initial_state(store: _Checkpoints, resume: bool, model: "LayeredModel", trainer,
                   log) -> tuple[int, dict[int, float]]:
    """A fresh start (step 0), or the newest checkpoint of ``store`` loaded onto the trainer; with its losses."""
    if not resume:
        trainer.init()
        return 0, {}
    from cfp.runtime.checkpoint import latest_step, restore_checkpoint
    step = latest_step(store.directory)
    like = model.abstract().params
    target = {"params": like, "opt_state": jax.eval_shape(trainer.tx.init, like)}
    state, meta = restore_checkpoint(store.directory, step, target,
                                     check_metadata=lambda m: _check_settings(store, step, m))
    trainer.load_state(state["params"], state["opt_state"], step)
    old = _saved_layout(meta.get("layout"))
    moved = "" if isinstance(old, Layout) and old.same_run(store.layout) else (
        f"; resharded from layout {old.summary() if isinstance(old, Layout) else old} onto "
        f"{store.layout.summary()}")
    log(f"resumed from {store.directory} step {step}{moved}")
    return step, {int(k): float(v) for k, v in meta.get("losses", {}).items()}


def _saved_layout(saved: Any) -> Any:
    """The layout a checkpoint was written under (its saved JSON as is when it is not a layout's)."""
    try:
        return Layout.from_json(saved, "checkpoint layout")
    except ConfigError:
        return saved


def _check_settings(store: _Checkpoints, step: int, meta: dict) -> None:
    """Refuse a checkpoint written with other model, data or optimizer settings."""
    saved, now = meta.get("settings"), store.settings
    if not isinstance(saved, dict):
        raise ConfigError(f"checkpoint step {step} in {store.directory!r} does not record the "
                          "settings it was written with (written by an older cfp?)")
    for k in now:
        if saved.get(k) != now[k]:
            raise ConfigError(f"checkpoint step {step} in {store.directory!r} was written with "
                              f"{k}={saved.get(k)!r}, this run has {k}={now[k]!r}; resume with the "
                              "same settings or use another checkpoint_dir")


def _save(store: _Checkpoints, trainer, losses: dict[int, float]) -> None:
    from cfp.runtime.checkpoint import save_checkpoint
    params, opt_state, step = trainer.state()  # gathered onto every process
    if jax.process_index() != 0:
        return
    meta = {"step": step, "settings": store.settings, "layout": store.layout.to_json(),
            "losses": {str(k): v for k, v in losses.items()}}
    save_checkpoint(store.directory, step, {"params": params, "opt_state": opt_state}, meta,
                    keep=store.keep, overwrite=True)


def _timeline(opts, job, events, log, n_max: int, tables: Optional[dict] = None,
              kept: Optional[dict] = None) -> dict[int, dict[str, float]]:
    """Log the bubble of the last step measured in full and write its timeline where asked; with no such step,
    write what was measured of the last one and say that its bubble is unknown. ``tables``: per pipeline the
    table that step ran (default: its schedule's fixed pattern) and each virtual stage's kept bytes per
    micro-batch (`HeteroTrainer.kept_bytes`; default: units)."""
    from cfp.runtime.timeline import bubble_line
    tl = gather_events(events, n_max)
    summary, sims = {}, {}
    if tl.unmeasured:     # StepClock leaves out actions whose start it could not observe
        log(f"bubble not measured: no step had every action measured ({tl.unmeasured} of {n_max} actions of "
            f"the last step ended no later than they could start as seen: the host was too busy to watch them)")
    else:
        summary = tl.summary([_placement(opts, q) for q in range(len(opts.layout.pipelines))])
        for q, v in summary.items():     # the run's schedule's equal-time bubble (the timeline's is 1F1B's)
            spec = opts.specs[q]
            v["theoretical_bubble"] = spec.entry.equal_bubble(v["stages"], v["microbatches"], spec.v)
            log(bubble_line(q, v))
            table = (tables or {}).get(q) or spec.entry.pattern(v["stages"], v["microbatches"], spec.v)
            line, sims[q] = simulated_line(spec, tl, q, v, table, (kept or {}).get(q))
            log(line)
    if opts.timeline_dir and jax.process_index() == 0:
        _write_timeline(opts.timeline_dir, f"{job.model.name} {schedules_text(opts.specs)} {opts.layout.summary()}",
                        [_placement(opts, q) for q in range(len(opts.layout.pipelines))], tl, log,
                        replay_timeline(sims) if sims else None)
    return summary


def _placement(opts, q: int) -> tuple[int, ...]:
    """The stage of each of pipeline q's virtual stages under the run's schedule."""
    spec = opts.specs[q]
    return spec.entry.placement.stages(opts.layout.pipelines[q].num_stages, spec.v)


def _write_timeline(directory: str, title: str, placements: list, tl, log, replay=None) -> None:
    """timeline.json and timeline.png of the measured step; with ``replay`` (its measured actions replayed with
    every stage owning its compute) also simulated.json and simulated.png beside them."""
    os.makedirs(directory, exist_ok=True)
    for name in ("simulated.json", "simulated.png"):     # no stale replay of another run left beside this one
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(directory, name))
    tl.save_json(os.path.join(directory, "timeline.json"))
    if not len(tl):       # nothing measured: nothing to draw, and no stale picture of another run left
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(directory, "timeline.png"))
        log(f"timeline written to {directory}/timeline.json (no action measured: no timeline.png)")
        return
    tl.plot_png(os.path.join(directory, "timeline.png"), title=title, placements=placements)
    partial = f" ({tl.unmeasured} actions not measured: no bubble)" if tl.unmeasured else ""
    if replay is not None and len(replay):
        replay.save_json(os.path.join(directory, "simulated.json"))
        replay.plot_png(os.path.join(directory, "simulated.png"), placements=placements,
                        title=f"{title}: the measured actions replayed, each stage owning its compute (simulated)")
        partial += ", and its replay with each stage owning its compute in simulated.json and simulated.png"
    log(f"timeline written to {directory}/timeline.json and timeline.png{partial}")


def _verify(job: _Job, trainer, init_state, start: int, losses: dict[int, float], tol: Optional[float],
            log) -> tuple[float, bool]:
    """The run's losses and final parameters against the job's reference replayed on one device from the same
    initial state: (max relative error, within ``tol`` (None: the model's default tolerance))."""
    from cfp.runtime.verify import default_tolerance, loss_error, replay, tree_error
    steps = list(range(start, max(losses) if losses else start))
    loss, tx = job.reference()
    ref_losses, ref_params = replay(loss, tx, init_state[0], init_state[1], (job.batches(s) for s in steps))
    mine = [losses[s + 1] for s in steps]
    # both raise NumericalError on NaN/Inf (Python's max would drop a NaN error)
    err = max(loss_error(mine, ref_losses), tree_error(trainer.state()[0], ref_params))
    tol = tol if tol is not None else default_tolerance(job.model, job.batches(0))
    log(f"verify: max relative error {err:.3e} over {len(steps)} steps "
        f"({'ok' if err <= tol else 'ABOVE'} tolerance {tol:g})")
    return err, err <= tol
