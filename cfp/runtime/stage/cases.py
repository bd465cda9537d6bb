"""Every stage of a layout as the stage-plan search and the replayed programs see it (`StageCase`: its Megatron
`StageProgram`, micro-batch, micro-batches per step and activation shapes), and its analysed training step."""
from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Optional

import jax
import jax.numpy as jnp
import numpy as np

from cfp.analysis.analysis import Analysis, analyze_with_program
from cfp.ir.capture import Program
from cfp.layout import Layout
from cfp.runtime.stage.cache import Built, CompileCache, ProgramKey, StepKey
from cfp.runtime.stage.program import StageProgram
from cfp.runtime.stage.replay import StageReplay, stage_step


@dataclasses.dataclass(frozen=True)
class StageCase:
    """One stage of a layout: its Megatron program (from the compile cache), its pipeline's micro-batch size and
    micro-batches per step, its input activation (the first stage: tokens) and output (None on the last)."""
    model: str
    config: Any
    prog: StageProgram
    micro_batch: int
    chunks: int
    x_like: Any
    y_like: Optional[Any]

    @property
    def step_key(self) -> StepKey:
        return StepKey.of(self.model, self.config, self.prog.stage, self.micro_batch)

    def program_key(self, plan=None) -> ProgramKey:
        return ProgramKey(self.model, self.config, self.prog.stage, tuple(self.prog.devices), plan)


@dataclasses.dataclass(frozen=True)
class AnalysedStep:
    """A stage's `stage_step` analysed on its sub-mesh: the analysis, the captured program and the concrete
    example arguments the search compiles and times it with."""
    analysis: Analysis
    program: Program
    args: tuple


def megatron_program(model: str, config: Any, st, devices: list, params_like: Any, modules: tuple,
                     cache: CompileCache) -> StageProgram:
    """The stage's `StageProgram` under the Megatron rules, built once per cache."""
    key = ProgramKey(model, config, st, tuple(devices))
    return cache.get(Built.PROGRAM, key, lambda: StageProgram(st, modules, devices, params_like, cache.tx))


def replay_program(case: StageCase, plan_choice: tuple, applied: Any, cache: CompileCache) -> StageProgram:
    """The stage's `StageProgram` running searched choice `plan_choice` ((choice, shard_state), resolved as
    `applied`), cut from its analysed step; replay and program built once per cache."""
    def build():
        step = analysed_step(case, cache)
        st = case.prog.stage
        replay = cache.get(Built.REPLAY, (case.step_key, plan_choice),
                           lambda: StageReplay(step.program, step.analysis, applied, st.is_first, st.is_last))
        p = case.prog
        return StageProgram(st, (p.embed, p.layer_mods, p.head), list(p.devices), p.params_like, cache.tx, replay)
    return cache.get(Built.PROGRAM, case.program_key(plan_choice), build)


def stage_cases(model: str, config: Any, layout: Layout, cache: CompileCache,
                devices: Optional[list] = None) -> Iterator[StageCase]:
    """Every stage of `layout` in pipeline order, its activation shapes chained through the stages."""
    from cfp.models import init_params, stage_modules
    devices = list(devices) if devices is not None else jax.devices()
    modules = stage_modules(model, config)
    full_like = jax.eval_shape(lambda: init_params(model, config, 0))
    for i, pipe in enumerate(layout.pipelines):
        mbs = pipe.micro_batch
        x_like = jax.ShapeDtypeStruct((mbs, config.seq_len), jnp.int32)
        for st in layout.placed_in(i):
            params_like = {"params": {n: full_like["params"][n] for n in st.module_names()}}
            prog = megatron_program(model, config, st, [devices[d] for d in st.devices], params_like, modules,
                                    cache)
            y_like = jax.eval_shape(prog.forward, params_like, x_like)[0]
            yield StageCase(model, config, prog, mbs, pipe.chunks, x_like, None if st.is_last else y_like)
            x_like = y_like


def example_args(case: StageCase, tx) -> tuple:
    """Concrete (zero) arguments of `stage_step`: the search compiles and may time the whole step."""
    prog = case.prog
    zeros = lambda s: np.zeros(s.shape, s.dtype)
    params = jax.tree_util.tree_map(zeros, prog.params_like)
    opt = jax.tree_util.tree_map(zeros, jax.eval_shape(tx.init, prog.params_like))
    acc = jax.tree_util.tree_map(zeros, prog.params_like)
    x = zeros(case.x_like)
    one = np.float32(1.0)
    if prog.stage.is_last:
        shape = (case.micro_batch, case.config.seq_len)
        return params, opt, acc, x, np.zeros(shape, np.int32), np.ones(shape, np.float32), one, one
    return params, opt, acc, x, zeros(case.y_like), one


def analysed_step(case: StageCase, cache: CompileCache) -> AnalysedStep:
    """The stage's `stage_step` analysed on its sub-mesh, once per stage signature and cache."""
    def build():
        args = example_args(case, cache.tx)
        analysis, program = analyze_with_program(stage_step(case.prog, cache.tx), case.prog.mesh, *args)
        return AnalysedStep(analysis, program, args)
    return cache.get(Built.STEP, case.step_key, build)
