"""The cost model against the runtime's compiled stage programs on this machine.

For every stage of a layout it lowers and compiles the runtime's forward, backward and update programs
(`cfp.runtime.stage.StageProgram`, abstract arguments, nothing runs) and sets the cost model's figures
beside XLA's: per-device FLOPs of one micro-batch's forward and backward (`cost_analysis()["flops"]`)
and the bytes of the backward and update programs (`cfp.xla.compiled.compiled_memory`: arguments + outputs
+ temporaries - aliased). FLOPs are the programs the cost model prices (each stage's recompute policy, here
`none`: no forward in the backward); the backward's bytes are those of its `full` recomputation program, the
working set the model's figure describes: the params and gradient accumulator, the stage input and its gradient,
and one micro-batch's stage activations (what a `none` stage keeps per micro-batch instead is
`CostModel.residual_bytes`, checked against the dispatcher's buffers by the runtime's kept-memory prediction). The
update figure is params, optimizer state and one gradient per pipeline.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cfp.layout import Layout
from cfp.planner.costmodel import CostModel
from cfp.xla.compiled import compiled_memory


@dataclass(frozen=True)
class StageCheck:
    stage: tuple[int, int]
    flops_fwd: tuple[float, float]     # (estimated, compiled)
    flops_bwd: tuple[float, float]
    bytes_bwd: tuple[float, float]
    bytes_update: tuple[float, float]

    def errors(self) -> dict[str, float]:
        """Relative error of the estimate per figure: (estimated - compiled) / compiled."""
        return {name: (e - c) / c for name, (e, c) in (
            ("flops_fwd", self.flops_fwd), ("flops_bwd", self.flops_bwd),
            ("bytes_bwd", self.bytes_bwd), ("bytes_update", self.bytes_update))}


def _model_figures(cm: CostModel, layout: Layout, p: int, i: int) -> tuple[float, float, float, float]:
    pipe = layout.pipelines[p]
    st, n = pipe.stages[i], len(layout.pipelines)
    first, last = i == 0, i == len(pipe.stages) - 1
    ff, fb = cm.stage_flops(st, first, last, pipe.micro_batch)
    t = cm.memory_terms(st, i, pipe, n)
    params, state = t.s0 + st.layers * t.s1, t.o0 + st.layers * t.o1
    mb, m = pipe.micro_batch, cm.model
    x_in = mb * (m.token_bytes() if first else m.boundary_bytes())
    g_out = 0 if last else mb * m.boundary_bytes()
    acts = mb * (st.layers * m.layer_activation_bytes(st.tp) + (m.head_activation_bytes(st.tp) if last else 0))
    acts += m.embed_backward_bytes(st.tp) if first else 0.0
    bwd = 2 * params + x_in + g_out + (0 if first else x_in) + acts
    update = params * (1 + n) + state
    return ff, fb, bwd, update


def check_compiled_stages(model_name: str, config: Any, cm: CostModel, layout: Layout) -> list[StageCheck]:
    """Compile every stage of `layout` (devices of this process) and compare; see the module doc."""
    from cfp.models import make_batch
    from cfp.recompute import Recompute
    from cfp.runtime.engine import zoo_trainer

    example = make_batch(model_name, config, 1, 0)
    trainers = {rc: zoo_trainer(model_name, config, layout, abstract=True, example_batch=example, recompute=rc)
                for rc in (Recompute.NONE, Recompute.FULL)}
    out = []
    for p, i in sorted(trainers[Recompute.NONE].programs):
        (fwd, fwd_args), (bwd, bwd_args), _, (upd, upd_args) = trainers[Recompute.NONE].compile_jobs((p, i))
        fwd, bwd, upd = (f.lower(*a).compile() for f, a in ((fwd, fwd_args), (bwd, bwd_args), (upd, upd_args)))
        full, full_args = trainers[Recompute.FULL].compile_jobs((p, i))[1]
        ff, fb, mb, mu = _model_figures(cm, layout, p, i)
        out.append(StageCheck((p, i), (ff, fwd.cost_analysis()["flops"]), (fb, bwd.cost_analysis()["flops"]),
                              (mb, compiled_memory(full.lower(*full_args).compile(), donated=True)),
                              (mu, compiled_memory(upd, donated=True))))
    return out
