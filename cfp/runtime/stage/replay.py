"""A stage's training step as the CFP passes see it, and the runtime's programs cut from it.

`stage_step` is one stage's step on one micro-batch: the stage forward, its ``jax.vjp`` backward, the
gradient added into the accumulator, and AdamW on the accumulated gradient. The stage-plan search analyses,
profiles and times this program; `StageReplay` then cuts the runtime's three programs out of the same
captured program under the searched choice, every block tensor constrained to its searched layout
(`ConstraintHooks`, as `cfp.sharding.step.ShardedStep` does for the whole step):

* forward  -- the operators the stage output (activation, or the last stage's loss part) and the aux loss need;
* backward -- the operators the new accumulator and the input gradient need (the forward recomputed, as the
  Megatron stage programs do too);
* update   -- the operators the new parameters and optimizer state need, with the summed gradients of all
  micro-batches and pipelines substituted for the accumulator the step computed.

So what runs is what was searched: same operators, same layouts, same named scopes (``cfp_b<N>``).
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from cfp.analysis.analysis import Analysis
from cfp.errors import ConfigError
from cfp.ir.capture import Program
from cfp.sharding.constraints import ConstraintHooks
from cfp.sharding.specs import StepShardings

# flat argument groups of `stage_step`, in order
_HEAD = ("params", "opt", "acc", "x")
_MID_IN = _HEAD + ("g_y", "aux_ct")
_LAST_IN = _HEAD + ("targets", "weights", "total_weight", "aux_ct")


def stage_step(prog: Any, tx: optax.GradientTransformation) -> Callable:
    """The stage's training step on one micro-batch, built from `StageProgram`'s functions.

    First/middle stages: ``(params, opt_state, acc, x, g_y, aux_ct)``; the last stage:
    ``(params, opt_state, acc, x, targets, weights, total_weight, aux_ct)``. Returns
    ``(params, opt_state, acc, [g_x,] out, aux)`` with ``acc + grad`` as the new accumulator, ``g_x`` the
    input gradient (not on the first stage) and ``out`` the activation sent on (the last stage: its loss part).
    """
    st = prog.stage

    def finish(params, opt_state, acc, g_p, g_x, out, aux):
        acc = jax.tree_util.tree_map(jnp.add, acc, g_p)
        updates, opt_state = tx.update(acc, opt_state, params)
        head = (optax.apply_updates(params, updates), opt_state, acc)
        return head + (() if st.is_first else (g_x,)) + (out, aux)

    if st.is_last:
        def step(params, opt_state, acc, x, targets, weights, total_weight, aux_ct):
            fn = lambda p, x_: prog.last_forward(p, x_, targets, weights, total_weight)
            (ce, aux), pull = prog.vjp(fn, params, x)
            g_p, g_x = pull((jnp.ones((), jnp.float32), aux_ct))
            return finish(params, opt_state, acc, g_p, g_x, ce, aux)
    else:
        def step(params, opt_state, acc, x, g_y, aux_ct):
            (y, aux), pull = prog.vjp(prog.forward, params, x)
            g_p, g_x = pull((g_y, aux_ct))
            return finish(params, opt_state, acc, g_p, g_x, y, aux)
    return step


class StageReplay:
    """One stage's analysed `stage_step` under a searched choice (`shardings`, from `resolve`), cut into the
    runtime's forward, backward and update functions; see the module doc. Mesh-independent: `functions(mesh)`
    binds the constraints to one stage's devices."""

    def __init__(self, program: Program, analysis: Analysis, shardings: StepShardings, is_first: bool,
                 is_last: bool):
        self.program, self.analysis, self.shardings = program, analysis, shardings
        self.is_first, self.is_last = is_first, is_last
        names_in = _LAST_IN if is_last else _MID_IN
        names_out = ("params", "opt", "acc") + (() if is_first else ("g_x",)) + ("out", "aux")
        self.inp = _groups(names_in, program.in_tree)
        self.out = _groups(names_out, program.out_tree)
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

    def act_in(self):
        return self._specs("x")[0]

    def act_out(self):
        """The layout the output activation's gradient enters in (P() on the last stage)."""
        return self._specs("g_y")[0] if not self.is_last else jax.sharding.PartitionSpec()

    def out_spec(self):
        """The layout the stage output (activation or loss part) leaves in."""
        return self._specs("out", outputs=True)[0]

    def g_x_spec(self):
        return self._specs("g_x", outputs=True)[0]

    # ------------------------------------------------------------------ programs
    def functions(self, mesh: jax.sharding.Mesh) -> tuple[Callable, Callable, Callable]:
        """(forward, backward, update) for a stage on `mesh`:

        * forward(params, x[, targets, weights, total_weight]) -> (out, aux)
        * backward(params, x, [g_y | targets, weights, total_weight], aux_ct, acc) -> (acc, g_x or None)
        * update(params, opt_state, grads) -> (params, opt_state)
        """
        hooks = ConstraintHooks.for_step(self.analysis, self.shardings, mesh)
        run = lambda inputs, outs, given=None: self.program.replay_part(
            inputs, outs, given, hooks.on_output, hooks.scope_of, hooks.on_input)
        labels = ("targets", "weights", "total_weight") if self.is_last else ()
        fwd_names = ("params", "x") + labels
        bwd_names = ("params", "x") + (labels or ("g_y",)) + ("aux_ct", "acc")

        def forward(*args):
            out, aux = run(self._bind(fwd_names, args), self.out["out"] + self.out["aux"])
            return out, aux

        def backward(*args):
            want = self.out["acc"] + self.out.get("g_x", [])
            flat = run(self._bind(bwd_names, args), want)
            n = len(self.out["acc"])
            acc = jax.tree_util.tree_unflatten(self._params_tree, flat[:n])
            return acc, (flat[n] if not self.is_first else None)

        def update(params, opt_state, grads):
            acc_ids = [self.program.graph.outputs[i] for i in self.out["acc"]]
            given = dict(zip(acc_ids, jax.tree_util.tree_leaves(grads)))
            flat = run(self._bind(("params", "opt"), (params, opt_state)),
                       self.out["params"] + self.out["opt"], given)
            n = len(self.out["params"])
            return (jax.tree_util.tree_unflatten(self._params_tree, flat[:n]),
                    jax.tree_util.tree_unflatten(self._opt_tree, flat[n:]))
        return forward, backward, update

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
