"""Every stage of a layout as the stage-plan search and the replayed programs see it (`StageCase`: its rules-table
`StageProgram`, micro-batch, micro-batches per step and activation shapes), and its analysed training step."""
from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Optional

import jax
import numpy as np

from cfp.analysis.analysis import Analysis, analyze_with_program
from cfp.ir.capture import Program
from cfp.layout import Layout, PlacedStage
from cfp.runtime.stage import activations
from cfp.recompute import Recompute
from cfp.runtime.stage.cache import Built, CompileCache, ProgramKey, StepKey
from cfp.runtime.stage.program import StageProgram
from cfp.runtime.stage.replay import StageReplay, stage_step


@dataclasses.dataclass(frozen=True)
class StageCase:
    """One stage of a layout: its rules-table program (from the compile cache), its pipeline's micro-batch size
    and micro-batches per step, its input activation (None on the first stage), the micro-batch it reads (None
    on middle stages) and its output activation (None on the last)."""
    prog: StageProgram
    micro_batch: int
    chunks: int
    x_like: Any
    batch_like: Any
    y_like: Optional[Any]

    @property
    def step_key(self) -> StepKey:
        return StepKey.of(self.prog.stage, self.micro_batch)

    def program_key(self, plan=None) -> ProgramKey:
        return ProgramKey(self.prog.stage, tuple(self.prog.devices), plan)


@dataclasses.dataclass(frozen=True)
class AnalysedStep:
    """A stage's `stage_step` analysed on its sub-mesh: the analysis, the captured program and the concrete
    example arguments the search compiles and times it with."""
    analysis: Analysis
    program: Program
    args: tuple


def megatron_program(st: PlacedStage, devices: list, cache: CompileCache,
                     recompute: Recompute = Recompute.NONE) -> StageProgram:
    """The stage's `StageProgram` under the rules table and recompute policy ``recompute``, built once per cache."""
    key = ProgramKey(st, tuple(devices), None, recompute)
    return cache.get(Built.PROGRAM, key, lambda: StageProgram(cache.model, st, devices,
                                                              cache.optimizer.stage(st), recompute=recompute))


def replay_program(case: StageCase, plan_choice: tuple, applied: Any, cache: CompileCache) -> StageProgram:
    """The stage's `StageProgram` running searched choice `plan_choice` ((choice, shard_state), resolved as
    `applied`), cut from its analysed step; replay and program built once per cache."""
    def build():
        step = analysed_step(case, cache)
        st = case.prog.stage
        replay = cache.get(Built.REPLAY, (case.step_key, plan_choice),
                           lambda: StageReplay(step.program, step.analysis, applied, st.is_first, st.is_last))
        p = case.prog
        return StageProgram(cache.model, st, list(p.devices), p.optimizer, replay)
    return cache.get(Built.PROGRAM, case.program_key(plan_choice), build)


def micro_batch_like(batch_like: Any, rows: int) -> Any:
    """ShapeDtypeStructs of a micro-batch of ``rows`` rows of batches shaped like ``batch_like``."""
    return jax.tree_util.tree_map(lambda l: jax.ShapeDtypeStruct((rows,) + tuple(l.shape[1:]), l.dtype),
                                  batch_like)


def stage_cases(layout: Layout, cache: CompileCache, batch_like: Any,
                devices: Optional[list] = None) -> Iterator[StageCase]:
    """Every stage of `layout` in pipeline order, its activation shapes chained through the stages; `batch_like`:
    the shape of a batch (any rows)."""
    devices = list(devices) if devices is not None else jax.devices()
    for i, pipe in enumerate(layout.pipelines):
        mb = micro_batch_like(batch_like, pipe.micro_batch)
        x_like = None
        for st in layout.placed_in(i):
            prog = megatron_program(st, [devices[d] for d in st.devices], cache)
            b = mb if (st.is_first or st.is_last) else None
            y_like = jax.eval_shape(prog.run, prog.params_like, x_like, b)
            yield StageCase(prog, pipe.micro_batch, pipe.chunks, x_like, b, None if st.is_last else y_like)
            x_like = y_like


def example_args(case: StageCase, cache: CompileCache) -> tuple:
    """Concrete (zero) arguments of `stage_step`: the search compiles and may time the whole step."""
    prog = case.prog
    zeros = lambda t: jax.tree_util.tree_map(lambda s: np.zeros(s.shape, s.dtype), t)
    params = zeros(prog.params_like)
    opt = zeros(prog.optimizer.like)
    g_y = None if case.y_like is None else zeros(activations.gradient_like(case.y_like))
    return (params, opt, zeros(prog.params_like), zeros(case.x_like), zeros(case.batch_like), g_y,
            np.float32(1.0), zeros(prog.optimizer.globals_like))


def analysed_step(case: StageCase, cache: CompileCache) -> AnalysedStep:
    """The stage's `stage_step` analysed on its sub-mesh, once per stage signature and cache."""
    def build():
        args = example_args(case, cache)
        analysis, program = analyze_with_program(stage_step(case.prog), case.prog.mesh, *args)
        return AnalysedStep(analysis, program, args)
    return cache.get(Built.STEP, case.step_key, build)
