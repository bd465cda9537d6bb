"""A stage's programs under a recompute policy: F keeps what its backward needs, B and W split the backward
without recomputing it (`cfp.ir.backward_split` cuts them from the stage's traced forward and VJP).

Per micro-batch the dispatcher holds, from F to the backward, a `Kept` (the residuals: the stage input's leaves
the backward reads and the forward values F returned), and from B to W a `Kept` of what W reads (the residuals
and output gradients W needs, and B's handoff). Both are pytrees whose static part names the micro-batch's shapes,
so each shape gets its own cut and its own compiled programs.

Program signatures (``batch`` None on middle stages, ``g_y`` None on the last):

* ``forward(params, x, batch) -> (out, produced)``: ``produced`` the residuals F computed (not the input's own);
* ``backward(params, kept, batch, g_y, acc) -> (acc + parameter gradient, input gradient, done)``;
* ``backward_input(params, kept, batch, g_y) -> (input gradient, handoff, done)``;
* ``backward_weight(params, w_kept, batch, handoff, acc) -> (acc + parameter gradient, done)``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from cfp.ir import _jax_internals as jxi
from cfp.ir.backward_split import Groups, StageSplit, evaluate, split_stage
from cfp.recompute import Recompute
from cfp.runtime.stage import activations

Sig = tuple


def signature(x: Any, batch: Any) -> Sig:
    """The shapes a micro-batch's cut depends on (its input activation's and micro-batch's)."""
    leaf = lambda a: (tuple(a.shape), str(a.dtype))
    return (jax.tree_util.tree_structure(x), tuple(map(leaf, jax.tree_util.tree_leaves(x))),
            jax.tree_util.tree_structure(batch), tuple(map(leaf, jax.tree_util.tree_leaves(batch))))


@jax.tree_util.register_pytree_node_class
class Kept:
    """Values a micro-batch keeps between two of its actions, with the signature of its cut (static)."""

    def __init__(self, sig: Sig, values: tuple):
        self.sig, self.values = sig, tuple(values)

    def tree_flatten(self):
        return self.values, self.sig

    @classmethod
    def tree_unflatten(cls, sig, values):
        return cls(sig, tuple(values))


@dataclasses.dataclass(frozen=True)
class Cut:
    """One micro-batch shape's cut, with the trees and shapes its programs' values take; ``made``: F's residuals
    that are not the stage input's own (`StageSplit.residuals` order)."""
    split: StageSplit
    out_tree: Any
    params_tree: Any
    out_likes: tuple
    params_likes: tuple
    floats: tuple            # the input activation's differentiable leaves (the input gradient's shapes)
    from_x: tuple            # residual ids that are the stage input's own leaves
    made: tuple


def _cut(split: StageSplit, out_like: Any, params_like: Any, floats: list) -> Cut:
    x_ids = set(split.groups.inputs(split.prog)["x"])
    leaves = lambda t: tuple(jax.ShapeDtypeStruct(l.shape, l.dtype) for l in jax.tree_util.tree_leaves(t))
    return Cut(split=split, out_tree=jax.tree_util.tree_structure(out_like),
               params_tree=jax.tree_util.tree_structure(params_like), out_likes=leaves(out_like),
               params_likes=leaves(params_like), floats=tuple(floats),
               from_x=tuple(i for i in split.residuals if i in x_ids),
               made=tuple(i for i in split.residuals if i not in x_ids))


class KeptPrograms:
    """The pure functions of one stage under ``policy`` (see the module doc), from ``combined(params, x, batch,
    ct_leaves) -> (out, g_params, g_x list)`` and the stage's abstract parameters."""

    def __init__(self, combined: Callable, params_like: Any, policy: Recompute, out_like: Callable, is_last: bool):
        self.combined, self.params_like = combined, params_like
        self.policy = Recompute.policy(policy)
        self._out_like, self.is_last = out_like, is_last
        self._cuts: dict[Sig, Cut] = {}

    # ------------------------------------------------------------------ the cut, per micro-batch shape
    def split(self, x_like: Any, batch_like: Any) -> StageSplit:
        return self.cut(x_like, batch_like).split

    def cut(self, x_like: Any, batch_like: Any) -> Cut:
        sig = signature(x_like, batch_like)
        if sig not in self._cuts:
            out = self._out_like(x_like, batch_like)
            ct = self.ct_like(out)
            prog = jxi.trace_whole(self.combined, self.params_like, x_like, batch_like, ct)
            n = lambda t: len(jax.tree_util.tree_leaves(t))
            floats = activations.gradient_like(x_like) if x_like is not None else []
            groups = Groups(n(self.params_like), n(x_like), n(batch_like), len(ct), n(out), n(self.params_like),
                            len(floats))
            self._cuts[sig] = _cut(split_stage(prog, groups, self.policy), out, self.params_like, floats)
        return self._cuts[sig]

    def ct_like(self, out_like: Any) -> list:
        """The cotangent inputs: the output's differentiable leaves' gradients (the last stage: one per output
        scalar, 1 on ``loss_sum`` and 0 on ``weight``)."""
        if self.is_last:
            return [jax.ShapeDtypeStruct(l.shape, l.dtype) for l in jax.tree_util.tree_leaves(out_like)]
        return activations.gradient_like(out_like)

    @staticmethod
    def _last_ct(cut: Cut) -> list:
        return [jnp.ones(o.shape, o.dtype) if k == 0 else jnp.zeros(o.shape, o.dtype)
                for k, o in enumerate(cut.out_likes)]

    @staticmethod
    def _env(split: StageSplit, params, x, batch, ct) -> dict:
        ins = split.groups.inputs(split.prog)
        env = dict(zip(ins["params"], jax.tree_util.tree_leaves(params)))
        env.update(zip(ins["x"], jax.tree_util.tree_leaves(x)))
        env.update(zip(ins["batch"], jax.tree_util.tree_leaves(batch)))
        if ct is not None:
            env.update(zip(ins["ct"], ct))
        return env

    @staticmethod
    def _values(env: dict, atoms, likes) -> list:
        return [env[a[1]] if a[0] == "var" else jnp.full(l.shape, a[1], l.dtype) for a, l in zip(atoms, likes)]

    # ------------------------------------------------------------------ the programs' bodies
    def forward(self, params, x, batch):
        cut = self.cut(_like(x), _like(batch))
        split = cut.split
        env = evaluate(split.prog, split.forward, self._env(split, params, x, batch, None))
        out = jax.tree_util.tree_unflatten(cut.out_tree, self._values(env, split.groups.outputs(split.prog)["out"],
                                                                      cut.out_likes))
        return out, Kept(signature(_like(x), _like(batch)), tuple(env[i] for i in cut.made))

    def kept(self, x: Any, produced: Kept) -> Kept:
        """What the micro-batch keeps for its backward: the stage input's leaves it reads (`Cut.from_x`), then what
        F produced (`Cut.made`)."""
        cut = self._cuts[produced.sig]
        xs = dict(zip(cut.split.groups.inputs(cut.split.prog)["x"], jax.tree_util.tree_leaves(x)))
        return Kept(produced.sig, tuple(xs[i] for i in cut.from_x) + produced.values)

    @staticmethod
    def _residuals(cut: Cut, values: tuple) -> dict:
        """``{residual id: value}`` of a `kept`."""
        return dict(zip(cut.from_x + cut.made, values))

    def _backward_env(self, kept: Kept, params, batch, g_y) -> tuple[Cut, dict]:
        cut = self._cuts[kept.sig]
        ct = self._last_ct(cut) if self.is_last else list(g_y)
        env = self._env(cut.split, params, None, batch, ct)
        env.update(self._residuals(cut, kept.values))
        return cut, env

    def _grads(self, cut: Cut, env: dict, acc):
        g_p = jax.tree_util.tree_unflatten(cut.params_tree, self._values(
            env, cut.split.groups.outputs(cut.split.prog)["g_params"], cut.params_likes))
        return jax.tree_util.tree_map(jnp.add, acc, g_p)

    def _g_x(self, cut: Cut, env: dict) -> list:
        return self._values(env, cut.split.groups.outputs(cut.split.prog)["g_x"], cut.floats)

    def backward(self, params, kept: Kept, batch, g_y, acc):
        cut, env = self._backward_env(kept, params, batch, g_y)
        evaluate(cut.split.prog, cut.split.whole, env)
        return self._grads(cut, env, acc), self._g_x(cut, env), jnp.zeros((), jnp.float32)

    def backward_input(self, params, kept: Kept, batch, g_y):
        cut, env = self._backward_env(kept, params, batch, g_y)
        evaluate(cut.split.prog, cut.split.b, env)
        return (self._g_x(cut, env), Kept(kept.sig, tuple(env[i] for i in cut.split.handoff)),
                jnp.zeros((), jnp.float32))

    def for_weight(self, kept: Kept, g_y) -> Kept:
        """What W reads of the micro-batch's residuals and output gradient (kept from B to W)."""
        cut = self._cuts[kept.sig]
        split, res = cut.split, self._residuals(cut, kept.values)
        ct = dict(zip(split.groups.inputs(split.prog)["ct"], [] if self.is_last else list(g_y)))
        return Kept(kept.sig, tuple(res[i] for i in split.w_residuals)
                    + tuple(ct[i] for i in split.w_ct if i in ct))

    def backward_weight(self, params, w_kept: Kept, batch, handoff: Kept, acc):
        cut = self._cuts[w_kept.sig]
        split = cut.split
        ct = dict(zip(split.groups.inputs(split.prog)["ct"], self._last_ct(cut))) if self.is_last else {}
        env = self._env(split, params, None, batch, None)
        env.update(ct)
        n = len(split.w_residuals)
        env.update(zip(split.w_residuals, w_kept.values[:n]))
        env.update(zip([i for i in split.w_ct if i not in ct], w_kept.values[n:]))
        env.update(zip(split.handoff, handoff.values))
        evaluate(split.prog, split.w, env)
        return self._grads(cut, env, acc), jnp.zeros((), jnp.float32)


def _like(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)
