"""The captured step compiled under a strategy choice with `jax.jit` (only JAX's public sharding API)."""
from __future__ import annotations

import copy
from typing import Any, Sequence

import jax
from jax.sharding import NamedSharding

from cfp.analysis.analysis import Analysis
from cfp.errors import ConfigError
from cfp.ir.capture import Program
from cfp.ir.state import state_inputs
from cfp.mesh import MeshSpec
from cfp.sharding.constraints import ConstraintHooks
from cfp.sharding.specs import StepShardings, resolve
from cfp.xla.hlo import Collective, parse_collectives
from cfp.xla.log import Rematerialization, capture_log


class ShardedStep:
    """The captured step compiled under `StepShardings` on a mesh; call it like the original step.

    Results of the passes that made it: `plan` (the `cfp.Plan` to read, `save` and reapply; None for a bare
    `apply_choice`), `search` (the `SearchResult` of `autoshard`, else None) and `profile` (its `ProfileTable`,
    else None); `with_results` returns a copy carrying them and sharing the compiled program. With `donate`,
    the state inputs' buffers (`state_inputs`) are handed to the outputs that replace them: a training loop
    feeds the outputs back in and must not reuse the arguments it passed.
    """

    def __init__(self, program: Program, analysis: Analysis, shardings: StepShardings, mesh: jax.sharding.Mesh,
                 plan: Any = None, search: Any = None, profile: Any = None, donate: bool = False):
        mesh = MeshSpec.auto(mesh)
        self.program, self.analysis, self.shardings, self.mesh = program, analysis, shardings, mesh
        self.plan, self.search, self.profile = plan, search, profile
        if shardings.constrained:
            hooks = ConstraintHooks.for_step(analysis, shardings, mesh)
            on_output, on_input, scope_of = hooks.on_output, hooks.on_input, hooks.scope_of
        else:       # a user layout: the input and output shardings alone, XLA propagates the rest
            on_output = on_input = scope_of = None

        def flat_fn(*flat):
            return tuple(program.replay(list(flat), on_output=on_output, scope_of=scope_of, on_input=on_input))
        self.in_shardings = tuple(NamedSharding(mesh, s) for s in shardings.input_specs)
        self.out_shardings = tuple(NamedSharding(mesh, s) for s in shardings.output_specs)
        self.donate = donate
        self._jitted = jax.jit(flat_fn, in_shardings=self.in_shardings, out_shardings=self.out_shardings,
                               donate_argnums=state_inputs(analysis.graph) if donate else ())
        self._compiled = None
        self._remats: tuple[Rematerialization, ...] = ()

    def with_results(self, plan: Any = None, search: Any = None, profile: Any = None) -> "ShardedStep":
        """A copy of this step (same compiled program) whose `plan`, `search` and `profile` are the given ones."""
        out = copy.copy(self)
        out.plan, out.search, out.profile = plan, search, profile
        return out

    def lower(self, *args):
        flat = jax.tree_util.tree_leaves(args)
        return self._jitted.lower(*flat)

    def compile(self, *args):
        if self._compiled is None:
            lowered = self.lower(*args)
            with capture_log(lowered) as log:
                self._compiled = lowered.compile()
            self._remats = log.rematerializations
        return self._compiled

    def rematerializations(self, *args) -> tuple[Rematerialization, ...]:
        """The involuntary full rematerializations XLA's SPMD partitioner reported compiling this step
        (resharding it could only do by replicating the tensor and slicing it again)."""
        self.compile(*args)
        return self._remats

    def shard_args(self, *args):
        """Place the step's arguments with its input shardings (copies, never the callers' buffers: a donating
        step deletes what it is given)."""
        flat, tree = jax.tree_util.tree_flatten(args)
        if self.donate:     # a replicated placement can share the caller's buffer (even with may_alias=False)
            flat = [jax.numpy.array(x, copy=True) for x in flat]
        return jax.tree_util.tree_unflatten(tree, [jax.device_put(x, s) for x, s in zip(flat, self.in_shardings)])

    def __call__(self, *args):
        flat, tree = jax.tree_util.tree_flatten(args)
        if tree != self.program.in_tree:
            raise ConfigError(f"arguments have structure {tree}, the step was captured with {self.program.in_tree}")
        out = self.compile(*args)(*flat)
        return jax.tree_util.tree_unflatten(self.program.out_tree, list(out))

    def collectives(self, *args) -> tuple[Collective, ...]:
        """Collectives XLA inserted in the compiled step, attributed to blocks."""
        return parse_collectives(self.compile(*args).as_text(), self.analysis.mesh.shape)


def apply_choice(program: Program, analysis: Analysis, choice: Sequence[int],
                 mesh: jax.sharding.Mesh | None = None, shard_state=(), donate: bool = False) -> ShardedStep:
    """Build the sharded step for `choice` (one strategy index per ParallelBlock); `shard_state` (True, or
    block indices) stores those blocks' parameters and optimizer state sharded (ZeRO-3), see `resolve`;
    `donate` hands the state inputs' buffers to the step's outputs."""
    if mesh is None:
        mesh = analysis.mesh.make()
    return ShardedStep(program, analysis, resolve(analysis, choice, shard_state), mesh, donate=donate)
