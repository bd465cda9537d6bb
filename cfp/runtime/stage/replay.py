"""A stage's training step as the CFP passes see it, and the runtime's programs cut from it.

`stage_step` is one stage's step on one micro-batch: the stage forward, its ``jax.vjp`` backward, the
gradient added into the accumulator, and the stage's part of the optimizer on the scaled accumulator. The stage-plan search analyses,
profiles and times this program; `StageReplay` then cuts the runtime's three programs out of the same
captured program under the searched choice, every block tensor constrained to its searched layout
(`ConstraintHooks`, as `cfp.sharding.step.ShardedStep` does for the whole step):

* forward  -- the operators the stage output (activation, or the last stage's ``(loss_sum, weight)``) needs;
* backward -- the operators the new accumulator and the input gradient need (the forward recomputed, as the
  Megatron stage programs do too);
The update is not cut from it: every stage runs the optimizer partition's per-unit programs
(`cfp.runtime.stage.optim`), so all pipelines compute the same bits; the plan's parameter and optimizer-state
layouts are where those programs find their inputs. So what runs forward and backward is what was searched:
same operators, same layouts, same named scopes (``cfp_b<N>``).
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from cfp.analysis.analysis import Analysis
from cfp.errors import ConfigError
from cfp.ir.capture import Program
from cfp.sharding.constraints import ConstraintHooks
from cfp.sharding.specs import StepShardings

# flat argument and result groups of `stage_step`, in order
_IN = ("params", "opt", "acc", "x", "batch", "g_y", "scale", "globals")
_OUT = ("params", "opt", "acc", "g_x", "out")


def stage_step(prog: Any) -> Callable:
    """The stage's training step on one micro-batch, built from `StageProgram`'s functions:
    ``(params, opt_state, acc, x, batch, g_y, scale, globals) -> (params, opt_state, acc, g_x, out)`` with
    ``acc + grad`` as the new accumulator, ``g_x`` the input gradient (its differentiable leaves; none on the first
    stage), ``out`` the activation sent on (the last stage: ``(loss_sum, weight)``) and the stage's optimizer
    update on ``scale`` times the new accumulator. ``x`` is None on the first stage, ``batch`` on middle stages,
    ``g_y`` on the last."""
    def step(params, opt_state, acc, x, batch, g_y, scale, globals_):
        out, pull = prog.vjp(params, x, batch)
        g_p, g_x = pull(prog.cotangent(out, g_y))
        acc = jax.tree_util.tree_map(jnp.add, acc, g_p)
        grads = jax.tree_util.tree_map(lambda g: g * scale.astype(g.dtype), acc)
        params, opt_state = prog.optimizer.update(grads, opt_state, params, globals_)
        return params, opt_state, acc, list(g_x), out
    return step


class StageReplay:
    """One stage's analysed `stage_step` under a searched choice (`shardings`, from `resolve`), cut into the
    runtime's forward, backward and update functions; see the module doc. Mesh-independent: `functions(mesh)`
    binds the constraints to one stage's devices."""

    def __init__(self, program: Program, analysis: Analysis, shardings: StepShardings, is_first: bool,
                 is_last: bool):
        self.program, self.analysis, self.shardings = program, analysis, shardings
        self.is_first, self.is_last = is_first, is_last
        self.inp = _groups(_IN, program.in_tree)
        self.out = _groups(_OUT, program.out_tree)
        self._params_tree = program.in_tree.children()[0]
        self._opt_tree = program.in_tree.children()[1]

    # ------------------------------------------------------------------ layouts
    def _specs(self, group: str, outputs: bool = False) -> list:
        specs = self.shardings.output_specs if outputs else self.shardings.input_specs
        return [specs[i] for i in (self.out if outputs else self.inp)[group]]

    def param_specs(self) -> Any:
        return jax.tree_util.tree_unflatten(self._params_tree, self._specs("params"))

    def opt_specs(self) -> Any:
        return jax.tree_util.tree_unflatten(self._opt_tree, self._specs("opt"))

    def grad_specs(self) -> Any:
        """The accumulator's (and the summed gradients') layouts."""
        return jax.tree_util.tree_unflatten(self._params_tree, self._specs("acc"))

    def act_in(self) -> list:
        """The input activation's layouts, one per leaf."""
        return self._specs("x")

    def batch_spec(self) -> list:
        """The micro-batch's layouts, one per leaf (none on middle stages)."""
        return self._specs("batch")

    def g_y_spec(self) -> list:
        """The layouts the output activation's gradient enters in, one per differentiable leaf."""
        return self._specs("g_y")

    def act_out(self) -> list:
        """The output activation's layouts (as the next stage's input gradient meets them): those of ``g_y``."""
        return self.g_y_spec()

    def out_spec(self) -> list:
        """The layouts the stage output (activation or ``(loss_sum, weight)``) leaves in, one per leaf."""
        return self._specs("out", outputs=True)

    def g_x_spec(self) -> list:
        return self._specs("g_x", outputs=True)

    # ------------------------------------------------------------------ programs
    def functions(self, mesh: jax.sharding.Mesh) -> tuple[Callable, Callable]:
        """(forward, backward) for a stage on `mesh` (the update is the optimizer partition's, per unit, as on every
        stage: `cfp.runtime.stage.optim`):

        * forward(params, x, batch) -> out
        * backward(params, x, batch, g_y, acc) -> (acc, g_x, done)
        """
        hooks = ConstraintHooks.for_step(self.analysis, self.shardings, mesh)
        run = lambda inputs, outs, given=None: self.program.replay_part(
            inputs, outs, given, hooks.on_output, hooks.scope_of, hooks.on_input)
        out_tree = self.program.out_tree.children()[4]

        def forward(params, x, batch):
            flat = run(self._bind(("params", "x", "batch"), (params, x, batch)), self.out["out"])
            return jax.tree_util.tree_unflatten(out_tree, flat)

        def backward(params, x, batch, g_y, acc):
            flat = run(self._bind(("params", "x", "batch", "g_y", "acc"), (params, x, batch, g_y, acc)),
                       self.out["acc"] + self.out["g_x"])
            n = len(self.out["acc"])
            return (jax.tree_util.tree_unflatten(self._params_tree, flat[:n]), list(flat[n:]),
                    jnp.zeros((), jnp.float32))

        return forward, backward

    def _bind(self, names, args) -> dict[int, Any]:
        """Flat input position -> value for the named argument groups."""
        out = {}
        for name, arg in zip(names, args):
            leaves = jax.tree_util.tree_leaves(arg)
            pos = self.inp[name]
            if len(leaves) != len(pos):
                raise ConfigError(f"stage program argument {name!r} has {len(leaves)} leaves, the analysed "
                                  f"stage step has {len(pos)}")
            out.update(zip(pos, leaves))
        return out


def input_groups(program: Program) -> dict[str, list[int]]:
    """Flat input positions of each argument group of an analysed `stage_step`."""
    return _groups(_IN, program.in_tree)


def _groups(names, tree) -> dict[str, list[int]]:
    """Flat positions of each named top-level argument (or result) of a tuple pytree."""
    children = tree.children()
    if len(children) != len(names):
        raise ConfigError(f"the analysed stage step has {len(children)} top-level values, expected "
                          f"{len(names)} ({', '.join(names)})")
    out, start = {}, 0
    for name, child in zip(names, children):
        out[name] = list(range(start, start + child.num_leaves))
        start += child.num_leaves
    return out
