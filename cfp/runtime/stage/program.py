"""One pipeline stage's jitted programs on its own <CP,TP> sub-mesh, for any `LayeredModel`.

A stage holds the model's parameters for its place (``first`` on the first stage, its layers' slice, ``last`` on
the last stage; `cfp.layered.model.stage_params`) and runs, with one signature for every place (``x`` is None
on the first stage, ``batch`` None on middle stages):

* ``forward(params, x, batch) -> (out, kept)`` -- F: the stage's output activation (the last stage:
  ``(loss_sum, weight)``) and what the micro-batch keeps for its backward under the stage's recompute policy
  (`cfp.recompute`; `cfp.runtime.stage.kept`): the residuals of its VJP (``none``), the dot outputs without batch
  dims (``selective``), or the stage input only (``full``); never a copy of the parameters;
* ``backward(params, kept, batch, g_y, acc) -> (acc, g_x, done)`` -- the whole backward (GPipe, 1F1B): the
  parameter gradient of the *summed* loss added into the accumulator (donated) and the input activation's
  gradient (its floating leaves, `activations`), recomputing only what the policy did not keep; the last stage's
  cotangent is 1 on ``loss_sum`` and 0 on ``weight``;
* ``backward_input(params, kept, batch, g_y) -> (g_x, w_kept, done)`` and ``backward_weight(params, w_kept, batch,
  acc) -> (acc, done)`` -- the backward split for the zero-bubble schedules (`cfp.ir.backward_split`): B runs what
  the input gradient needs and hands W what W reads (the cotangents at the parameter-consuming operations and the
  residuals they use); W runs only the weight-gradient work, never the forward; the first stage's B has no input
  gradient (its W is its whole backward);
* ``gradient(grad_parts, scale)`` -- sums the pipelines' gradients (in pipeline order) and scales them by
  ``1 / total weight``, so they are the gradient of ``sum(loss_sum) / sum(weight)``, the single-device loss;
* ``apply_update(grads, opt_state, params, globals)`` -- the stage's part of the user's optimizer
  (`cfp.runtime.stage.optim`: one compiled program per unit, outside any jit, so every pipeline computes the
  same bits), and per parameter whether its gradient and new value are finite, so NaN/Inf is caught in the
  step it appears.

Under the rules table (`cfp.runtime.sharding`: the model's logical dim names, Megatron-style) activations and
their gradients enter and leave replicated over the stage's ``tp`` axis (and sharded on their sequence dim
over ``cp``); under a searched stage plan the forward and backward are cut from the analysed stage step
(`cfp.runtime.stage.replay.StageReplay`), every layout comes from the plan, and the same policies cut them.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from cfp.errors import ConfigError
from cfp.layered.model import LayeredModel, concat_layers, stage_params
from cfp.layout import PlacedStage
from cfp.models.attention import ContextParallel, CpMethod, context_parallel
from cfp.recompute import Recompute
from cfp.runtime.sharding import CP_AXIS, TP_AXIS, param_shardings, stage_mesh
from cfp.runtime.stage import activations
from cfp.runtime.stage.kept import KeptPrograms, signature
from cfp.runtime.stage.optim import StageOptimizer

if TYPE_CHECKING:
    from cfp.runtime.stage.replay import StageReplay


class StageProgram:
    """Jitted fwd / bwd / zeros / update of one stage: under the rules table, or cut from a searched stage plan's
    analysed step (``replay``) with its layouts."""

    def __init__(self, model: LayeredModel, stage: PlacedStage, devices: list, optimizer: StageOptimizer,
                 replay: Optional["StageReplay"] = None, recompute: Recompute = Recompute.NONE):
        self.model, self.stage, self.optimizer = model, stage, optimizer
        self.recompute = Recompute.policy(recompute)
        self.devices = tuple(devices)
        self.mesh = stage_mesh(devices, stage.cp)
        self.repl = NamedSharding(self.mesh, P())
        self.params_like = optimizer.params_like
        self._cp = _context_parallel(self.mesh, stage, model) if stage.cp > 1 else None
        self.replay = replay
        self.is_local = all(d.process_index == jax.process_index() for d in devices)
        self._kept_like: dict = {}
        # the stage's forward and VJP in one traced program, cut by the policy (a searched plan's backward, cut
        # from its analysed step, recomputes the forward: `backward_split.merged` finds those copies)
        if replay is None:
            self._apply_rules()
            combined = self._combined
        else:
            combined = _replayed(*self._apply_searched_plan(replay), self.params_like, stage.is_last)
        self.kept_programs = KeptPrograms(combined, self.params_like, self.recompute, self._out_like, stage.is_last)
        self._jit()

    # ------------------------------------------------------------------ layouts
    def _apply_rules(self) -> None:
        """The rules table on the model's logical dim names: activations replicated over ``tp``."""
        names = _stage_names(self.model, self.stage)     # None: every parameter replicated
        self.shardings = param_shardings(self.params_like, names, self.mesh)
        self.grad_shardings = self.shardings
        self.opt_shardings = self.optimizer.state_shardings(self.shardings, self.repl)
        spec = _cp_spec if self.stage.cp > 1 else (lambda leaf: P())
        self.act_in_spec = self.act_out_spec = self.g_x_spec = self.g_y_spec = spec
        self.batch_spec = spec
        self.out_spec = (lambda leaf: P()) if self.stage.is_last else spec

    def _apply_searched_plan(self, replay: "StageReplay") -> tuple:
        """A searched stage plan: every layout from the plan, the programs cut from its analysed step."""
        if self.stage.cp > 1:
            raise ConfigError(f"stage {self.stage.key}: a searched stage plan runs without context "
                              f"parallelism (cp={self.stage.cp})")
        self.shardings = self._named(replay.param_specs())
        self.grad_shardings = self._named(replay.grad_specs())
        self.opt_shardings = self._named(replay.opt_specs())
        self.act_in_spec, self.g_x_spec = replay.act_in(), replay.g_x_spec()
        self.act_out_spec, self.g_y_spec, self.out_spec = replay.act_out(), replay.g_y_spec(), replay.out_spec()
        self.batch_spec = replay.batch_spec()
        # the update is the optimizer partition's in every case: one program per unit, the same in every pipeline
        return replay.functions(self.mesh)[:2]

    def _named(self, specs: Any) -> Any:
        return jax.tree_util.tree_map(lambda s: NamedSharding(self.mesh, s), specs,
                                      is_leaf=lambda x: isinstance(x, P))

    def shard(self, like: Any, spec: Any) -> Any:
        """NamedShardings of a tree shaped like ``like`` under ``spec`` (a per-leaf function, or a plan's list)."""
        leaves, treedef = jax.tree_util.tree_flatten(like)
        return jax.tree_util.tree_unflatten(treedef, [NamedSharding(self.mesh, s)
                                                      for s in _per_leaf(spec, leaves)])

    def act_in_shardings(self, like: Any) -> Any:
        return self.shard(like, self.act_in_spec)

    def act_out_shardings(self, like: Any) -> Any:
        """Where the gradient of this stage's output enters (one sharding per differentiable leaf)."""
        return [NamedSharding(self.mesh, s) for s in _per_leaf(self.g_y_spec, activations.gradient_like(like))]

    def batch_shardings(self, like: Any) -> Any:
        return self.shard(like, self.batch_spec)

    def _jit(self) -> None:
        kp = self.kept_programs
        # F keeps what the policy saves and the backward recomputes only the rest (`kept`)
        self.fwd = jax.jit(self._kept_forward)
        self.bwd = jax.jit(self._kept_backward, donate_argnums=(4,))
        self.zeros = jax.jit(lambda: jax.tree_util.tree_map(
            lambda s: jnp.zeros(s.shape, s.dtype), self.params_like), out_shardings=self.grad_shardings)
        self.gradient = jax.jit(self.summed)
        self._finite = jax.jit(_finite_flags)
        self._bwd_input = jax.jit(self._kept_backward_input)
        self._bwd_weight = jax.jit(kp.backward_weight, donate_argnums=(4,))
        # the whole update as one program: for compiling ahead of time and for memory figures only (the runtime
        # runs the partition's per-unit programs, `apply_update`)
        self.fused_update = jax.jit(self._fused_update, donate_argnums=(0, 1),
                                    out_shardings=(self.shardings, self.opt_shardings))

    # ------------------------------------------------------------------ pure stage functions
    def _scope(self):
        return context_parallel(self._cp) if self._cp is not None else contextlib.nullcontext()

    def run(self, params, x, batch):
        """The stage's forward as a plain function: ``first`` on the first stage, its layers, ``last`` on the
        last; named scopes ``first``, ``layers_<i>``, ``last`` (the CFP analysis cuts segments at them)."""
        st, m = self.stage, self.model
        with self._scope():
            if st.is_first:
                with jax.named_scope("first"):
                    x = m.first(params["first"], batch)
            if st.layer_end > st.layer_start:      # a virtual stage may hold no layers: it passes x on
                x = m.run_layers(params["layers"], x, st.layer_start, st.layer_end)
            if st.is_last:
                with jax.named_scope("last"):
                    return tuple(m.last(params["last"], x, batch))
        return x

    def vjp(self, params, x, batch):
        """``(output, pull)`` of the stage with ``pull(cotangent) -> (parameter gradient, input gradient as the
        list of x's differentiable leaves)`` (an empty list on the first stage)."""
        if self.stage.is_first:
            out, pull = jax.vjp(lambda p: self.run(p, None, batch), params)
            return out, lambda ct: (pull(ct)[0], [])
        floats, others, how = activations.split(x)
        out, pull = jax.vjp(lambda p, xf: self.run(p, activations.join(xf, others, how), batch), params, floats)
        return out, pull

    def cotangent(self, out_like, g_y):
        """The output's cotangent: 1 on the last stage's ``loss_sum``, 0 on its weight; else ``g_y``."""
        if self.stage.is_last:
            return (jnp.ones((), out_like[0].dtype), jnp.zeros((), out_like[1].dtype))
        return activations.cotangent(out_like, g_y)

    # ------------------------------------------------------------------ what the dispatcher calls
    def forward(self, params, x, batch):
        """F: ``(output, what the micro-batch keeps for its backward)``."""
        out, produced = self.fwd(params, x, batch)
        return out, self.kept_programs.kept(x, produced)

    def backward(self, params, kept, batch, g_y, acc):
        """The whole backward: ``(acc + the micro-batch's parameter gradient, input gradient, done)``."""
        return self.bwd(params, kept, batch, g_y, acc)

    def backward_input(self, params, kept, batch, g_y):
        """B: ``(input gradient as a list of x's differentiable leaves, what W reads, done)``."""
        g_x, handoff, done = self._bwd_input(params, kept, batch, g_y)
        return g_x, (self.kept_programs.for_weight(kept, g_y), handoff), done

    def backward_weight(self, params, w_kept, batch, acc):
        """W: ``(acc + the micro-batch's parameter gradient, done)`` from what its B kept; runs no forward."""
        residuals, handoff = w_kept
        return self._bwd_weight(params, residuals, batch, handoff, acc)

    def _out_like(self, x_like, batch_like):
        return jax.eval_shape(self.run, self.params_like, x_like, batch_like)

    def _combined(self, params, x, batch, ct):
        """The stage's forward and VJP in one: ``(out, parameter gradient, input gradient)`` for cotangent
        leaves ``ct`` (the last stage: one per output scalar)."""
        out, pull = self.vjp(params, x, batch)
        g_p, g_x = pull(tuple(ct) if self.stage.is_last else activations.cotangent(out, ct))
        return out, g_p, list(g_x)

    def _kept_forward(self, params, x, batch):
        out, produced = self.kept_programs.forward(params, x, batch)
        return _constrain(out, self.mesh, self.out_spec), produced

    def _kept_backward(self, params, kept, batch, g_y, acc):
        acc, g_x, done = self.kept_programs.backward(params, kept, batch, g_y, acc)
        return acc, _constrain_list(g_x, self.mesh, self.g_x_spec), done

    def _kept_backward_input(self, params, kept, batch, g_y):
        g_x, handoff, done = self.kept_programs.backward_input(params, kept, batch, g_y)
        return _constrain_list(g_x, self.mesh, self.g_x_spec), handoff, done

    def update(self, params, opt_state, grad_parts, scale, globals_):
        """New ``(params, opt_state, finite flags)`` from the pipelines' gradient pieces; ``globals_``: the
        optimizer's values over all stages (`cfp.runtime.engine.HeteroTrainer` exchanges them)."""
        return self.apply_update(self.gradient(grad_parts, scale), opt_state, params, globals_)

    def apply_update(self, grads, opt_state, params, globals_):
        """The optimizer on the step's gradient, and per parameter whether its gradient and new value are finite
        ([2, leaves] in tree_leaves order), so NaN/Inf is caught in the step it appears."""
        params, opt_state = self.optimizer.update(grads, opt_state, params, globals_)
        return params, opt_state, self._finite(grads, params)

    def _fused_update(self, params, opt_state, grad_parts, scale, globals_):
        return self.optimizer.update(self.summed(grad_parts, scale), opt_state, params, globals_)

    def total(self, grad_parts):
        """The pipelines' gradients of the summed loss (each with its layers in consecutive pieces), joined and
        summed in pipeline order."""
        stacked = self.model.stacked
        trees = [_joined(part, stacked) for part in grad_parts]
        total = trees[0]
        for t in trees[1:]:
            total = jax.tree_util.tree_map(jnp.add, total, t)
        return total

    def summed(self, grad_parts, scale):
        """The step's gradient: `total` scaled by ``scale`` (1 / the step's total weight)."""
        return _scaled(self.total(grad_parts), scale)

    # ------------------------------------------------------------------ placement, compiling
    def place_params(self, params: Any) -> Any:
        # from a host copy: the update donates the stage's buffers, which must never be the caller's
        # arrays (device_put onto a replicated sharding reuses the source buffer for its own device's shard)
        return jax.device_put(jax.tree_util.tree_map(lambda a: np.array(a, copy=True), params), self.shardings)

    def place_opt_state(self, opt_state: Any) -> Any:
        return jax.device_put(jax.tree_util.tree_map(lambda a: np.array(a, copy=True), opt_state),
                              self.opt_shardings)

    def abstract_args(self, x_like: Any, batch_like: Any, y_like: Any) -> tuple:
        """``(params, x, batch, g_y)`` as ShapeDtypeStructs on their shardings (None where the stage has none)."""
        params = _with_sharding(self.params_like, self.shardings)
        x = None if x_like is None else _with_sharding(x_like, self.act_in_shardings(x_like))
        b = None if batch_like is None else _with_sharding(batch_like, self.batch_shardings(batch_like))
        g_y = None if y_like is None else [jax.ShapeDtypeStruct(l.shape, l.dtype, sharding=s) for l, s in zip(
            activations.gradient_like(y_like), self.act_out_shardings(y_like))]
        return params, x, b, g_y

    def kept_like(self, x_like: Any, batch_like: Any, y_like: Any) -> tuple:
        """``(what a micro-batch keeps from F to its backward, what it keeps from B to W)`` as ShapeDtypeStructs
        on the shardings the compiled F and B give them."""
        params, x, b, g_y = self.abstract_args(x_like, batch_like, y_like)
        key = signature(x_like, batch_like)
        if key not in self._kept_like:
            kept = self.kept_programs.kept(x, _placed(self.fwd, (params, x, b))[1])
            w_kept = (self.kept_programs.for_weight(kept, g_y), _placed(self._bwd_input, (params, kept, b, g_y))[1])
            self._kept_like[key] = (kept, w_kept)
        return self._kept_like[key]

    def compile_jobs(self, x_like: Any, batch_like: Any, y_like: Any, pieces: list, split: bool = False) -> list:
        """``(jitted program, abstract arguments)`` of each program, to compile ahead of time (``split``: B and W
        too, after the others). ``x_like`` / ``batch_like`` / ``y_like``: the stage's input activation /
        micro-batch / output (None where the stage has none); ``pieces``: per pipeline, the layer-slice lengths its
        gradient arrives in. What the backward programs take of F and B comes from compiling F (and B)."""
        params, x, b, g_y = self.abstract_args(x_like, batch_like, y_like)
        grads = _with_sharding(self.params_like, self.grad_shardings)
        opt = _with_sharding(self.optimizer.like, self.opt_shardings)
        scalar = jax.ShapeDtypeStruct((), jnp.float32)
        parts = [self.grad_parts_like(p) for p in pieces]
        kept, w_kept = self.kept_like(x_like, batch_like, y_like)
        jobs = [(self.fwd, (params, x, b)), (self.bwd, (params, kept, b, g_y, grads)), (self.zeros, ()),
                (self.fused_update, (params, opt, parts, scalar, self.optimizer.globals_like))]
        if split:
            jobs += [(self._bwd_input, (params, kept, b, g_y)), (self._bwd_weight, (params, w_kept[0], b, w_kept[1],
                                                                                   grads))]
        return jobs

    def grad_parts_zeros(self, lengths: list[int]) -> Any:
        """Zeros shaped like `grad_parts_like` (warming the update up)."""
        return jax.tree_util.tree_map(lambda l: jax.device_put(jnp.zeros(l.shape, l.dtype), l.sharding),
                                      self.grad_parts_like(lengths))

    def layers_like(self, start: int, stop: int) -> Any:
        """ShapeDtypeStructs of the stage's local layers ``start .. stop-1`` (a gradient piece sent to others)."""
        return stage_params(self.params_like, start, stop, False, False, self.model.stacked)["layers"]

    def layer_shardings(self, start: int, stop: int, params: bool = False) -> Any:
        """Gradient (``params``: parameter) shardings of the stage's local layers ``start .. stop-1`` (a stacked
        leaf's sharding holds for any number of layers)."""
        layers = (self.shardings if params else self.grad_shardings)["layers"]
        return layers if self.model.stacked else list(layers[start:stop])

    def join_layers(self, pieces: list) -> Any:
        """Consecutive layer pieces as the stage's own layers (a jitted concatenation of stacked pieces, on its
        devices, onto its parameter shardings)."""
        if not self.model.stacked:
            return [layer for piece in pieces for layer in piece]
        if len(pieces) == 1:
            return pieces[0]
        if not hasattr(self, "_join"):
            self._join = jax.jit(lambda ps: concat_layers(ps, True), out_shardings=self.shardings["layers"])
        return self._join(pieces)

    def grad_parts_like(self, lengths: list[int]) -> Any:
        """One pipeline's gradient for this stage, its layers in pieces of ``lengths`` layers."""
        grads = _with_sharding(self.params_like, self.grad_shardings)
        out = {k: v for k, v in grads.items() if k != "layers"}
        bounds = np.cumsum([0] + list(lengths))
        return dict(out, layers=[stage_params(grads, a, b, False, False, self.model.stacked)["layers"]
                                 for a, b in zip(bounds[:-1], bounds[1:])])


# ---------------------------------------------------------------------- helpers
def _stage_names(model: LayeredModel, st: PlacedStage) -> Any:
    """The stage's slice of the model's logical dim names (a stacked leaf's names hold for every slice)."""
    names = model.logical_names
    if names is None:
        return None
    layers = names["layers"] if model.stacked else list(names["layers"][st.layer_start:st.layer_end])
    out = {"layers": layers} if st.layer_end > st.layer_start else {}
    if st.is_first:
        out["first"] = names["first"]
    if st.is_last:
        out["last"] = names["last"]
    return out


def _joined(part: dict, stacked: bool) -> dict:
    """One pipeline's gradient of a stage, its layer pieces joined (no ``layers`` for a stage holding none)."""
    rest = {k: v for k, v in part.items() if k != "layers"}
    return dict(rest, layers=concat_layers(part["layers"], stacked)) if part["layers"] else rest


def _finite_flags(grads, params):
    # a virtual stage holding no parameters (no layers, neither end) has nothing that can be non-finite
    finite = lambda t: jnp.stack([jnp.all(jnp.isfinite(l)) for l in jax.tree_util.tree_leaves(t)]
                                 or [jnp.array(True)])
    return jnp.stack([finite(grads), finite(params)])


def _cp_spec(leaf) -> P:
    """Under context parallelism: arrays of rank >= 2 ([rows, seq, ...]) sharded over ``cp`` on the sequence
    dim, the rest (scalars such as the MoE aux loss) replicated."""
    return P(None, CP_AXIS) if len(leaf.shape) >= 2 else P()


def _indexed(spec) -> bool:
    return isinstance(spec, (list, tuple))


def _per_leaf(spec, leaves: list) -> list:
    """Specs for ``leaves``: a per-leaf function, or a list of specs (a searched plan's)."""
    if _indexed(spec):
        if len(spec) != len(leaves):
            raise ConfigError(f"a stage plan gives {len(spec)} activation layouts for {len(leaves)} leaves")
        return list(spec)
    return [spec(l) for l in leaves]


def _constrain(tree: Any, mesh, spec) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    specs = _per_leaf(spec, leaves)
    return jax.tree_util.tree_unflatten(treedef, [
        jax.lax.with_sharding_constraint(l, NamedSharding(mesh, s)) for l, s in zip(leaves, specs)])


def _constrain_list(leaves: list, mesh, spec) -> list:
    return [jax.lax.with_sharding_constraint(l, NamedSharding(mesh, s))
            for l, s in zip(leaves, _per_leaf(spec, leaves))]


def _context_parallel(mesh, stage: PlacedStage, model: LayeredModel) -> ContextParallel:
    """Ring attention over the stage's ``cp`` axis; heads stay sharded over ``tp`` when ``tp`` divides both the
    query and the key/value heads (else attention gathers them)."""
    if model.heads is None:
        raise ConfigError(f"stage {stage.key} has cp={stage.cp} but model {model.name!r} has no context-parallel "
                          "attention (only the zoo's attention honours cfp's context-parallel scope)")
    q, kv = model.heads
    heads_ok = stage.tp > 1 and q % stage.tp == 0 and kv % stage.tp == 0
    return ContextParallel(mesh, CP_AXIS, CpMethod.RING, TP_AXIS if heads_ok else None)


def _scaled(tree: Any, scale) -> Any:
    return jax.tree_util.tree_map(lambda g: g * scale.astype(g.dtype), tree)


def _with_sharding(like: Any, shardings: Any) -> Any:
    return jax.tree_util.tree_map(lambda l, s: jax.ShapeDtypeStruct(l.shape, l.dtype, sharding=s), like, shardings)


def _placed(jitted, args) -> Any:
    """The outputs of ``jitted`` on ``args`` as ShapeDtypeStructs on the shardings its compiled program gives them."""
    shapes = jax.eval_shape(jitted, *args)
    shardings = jitted.lower(*args).compile().output_shardings
    return jax.tree_util.tree_map(lambda l, s: jax.ShapeDtypeStruct(l.shape, l.dtype, sharding=s), shapes, shardings)


def _replayed(fwd: Callable, bwd: Callable, params_like: Any, is_last: bool) -> Callable:
    """A searched plan's forward and backward as one ``combined(params, x, batch, ct)`` (its last stage's cotangent
    is built into the analysed step: ``ct`` is not read there)."""
    def combined(params, x, batch, ct):
        zeros = jax.tree_util.tree_map(lambda l: jnp.zeros(l.shape, l.dtype), params_like)
        acc, g_x, _ = bwd(params, x, batch, None if is_last else list(ct), zeros)
        return fwd(params, x, batch), acc, list(g_x)
    return combined
