"""One pipeline stage's jitted programs on its own TP sub-mesh.

A stage holds ``{"params": {name: subtree}}`` for its submodules (``embed`` in the first stage,
``layers_i`` for its layers, ``head`` in the last) and runs:

* ``fwd``  -- first/middle stages: ``x -> (y, aux)``; the last stage: ``x -> (ce_part, aux)`` where
  ``ce_part = sum(ce * w) / total_weight`` uses the weight of the *whole global batch*, so summing the
  parts over micro-batches and pipelines gives exactly the single-device loss (token weighting).
* ``bwd``  -- recomputes the stage forward and applies ``jax.vjp`` (stage-level rematerialisation:
  only each micro-batch's stage input is kept between fwd and bwd), adds the parameter gradient into
  the accumulator (donated) and returns the input gradient for the previous stage.
* ``update`` -- AdamW (optax) on this stage's parameters; it also returns, per parameter, whether
  its summed gradient and its new value are finite, so NaN/Inf is caught in the step it appears.

Packed variable-length micro-batches pass ``packed=(segment_ids, positions)`` (int32 [R,S]) to every
program: attention stays inside each segment and positions restart per sequence.  A stage with ``cp`` > 1
runs on a ("cp", "tp") mesh: tokens, activations, labels and ``packed`` are sharded over ``cp`` on the
sequence dim and attention is context-parallel (ring) inside the programs.

Under the Megatron rules activations and their gradients enter and leave replicated over the stage's
``tp`` axis. Under a searched stage plan the three programs are cut from the analysed stage step
(``cfp.runtime.stage.replay.StageReplay``) with every block tensor constrained to its searched layout, and
parameters, optimizer state, gradients and activations take the plan's layouts. Either way moving
activations to another stage (``comm.move``) needs no resharding logic of its own.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from cfp.errors import ConfigError
from cfp.models.attention import ContextParallel, CpMethod, context_parallel
from cfp.layout import PlacedStage
from cfp.runtime.sharding import CP_AXIS, TP_AXIS, param_shardings, stage_mesh

if TYPE_CHECKING:
    from cfp.runtime.stage.replay import StageReplay


class StageProgram:
    """Jitted fwd / bwd / zeros / update of one stage: with Megatron shardings, or cut from a searched
    stage plan's analysed step (``replay``) with its layouts."""

    def __init__(self, stage: PlacedStage, modules: tuple, devices: list, params_like: Any,
                 tx: optax.GradientTransformation, replay: Optional["StageReplay"] = None):
        self.stage = stage
        self.embed, self.layer_mods, self.head = modules
        self.devices = tuple(devices)
        self.mesh = stage_mesh(devices, stage.cp)
        self.repl = NamedSharding(self.mesh, P())
        # tokens, labels, segment ids and positions: sharded on the sequence dim under CP
        self.rows = NamedSharding(self.mesh, P(None, CP_AXIS)) if stage.cp > 1 else self.repl
        self._cp = _context_parallel(self.mesh, stage, modules) if stage.cp > 1 else None
        self.params_like = params_like  # {"params": {name: ShapeDtypeStruct tree}}
        self.tx = tx
        self.replay = replay
        self.is_local = all(d.process_index == jax.process_index() for d in devices)
        fwd, bwd, self._apply_update = (self._apply_rules() if replay is None
                                        else self._apply_searched_plan(replay))
        self._jit(fwd, bwd)

    def _apply_rules(self) -> tuple:
        """The Megatron rules table (`cfp.runtime.sharding`): activations replicated over ``tp``."""
        stage = self.stage
        self.shardings = param_shardings(self.params_like, self.mesh)
        self.grad_shardings = self.shardings
        self.opt_shardings = self._opt_shardings()
        self.act_in = self.act_out = self.g_x_sharding = self.rows
        self.out_sharding = self.repl if stage.is_last else self.rows
        fwd = self.last_forward if stage.is_last else self.forward
        bwd = self._last_backward if stage.is_last else self._backward
        return fwd, bwd, self._adamw

    def _apply_searched_plan(self, replay: "StageReplay") -> tuple:
        """A searched stage plan: every layout from the plan, the programs cut from its analysed step."""
        stage = self.stage
        if stage.cp > 1:
            raise ConfigError(f"stage {stage.key}: a searched stage plan runs without context "
                              f"parallelism (cp={stage.cp})")
        self.shardings = self._named(replay.param_specs())
        self.grad_shardings = self._named(replay.grad_specs())
        self.opt_shardings = self._named(replay.opt_specs())
        self.act_in = NamedSharding(self.mesh, replay.act_in())
        self.act_out = NamedSharding(self.mesh, replay.act_out())
        self.out_sharding = NamedSharding(self.mesh, replay.out_spec())
        self.g_x_sharding = self.repl if stage.is_first else NamedSharding(self.mesh, replay.g_x_spec())
        return replay.functions(self.mesh)

    def _jit(self, fwd, bwd) -> None:
        stage, tx = self.stage, self.tx
        # The first stage's input is integer tokens: it returns no input gradient.
        out_acc = ((self.grad_shardings, self.repl) if stage.is_first
                   else (self.grad_shardings, self.g_x_sharding, self.repl))
        self.fwd = jax.jit(fwd, out_shardings=(self.out_sharding, self.repl))
        self.bwd = jax.jit(lambda *a, **kw: self._bwd_out(*bwd(*a, **kw)), out_shardings=out_acc,
                           donate_argnums=(6 if stage.is_last else 4,))
        self.zeros = jax.jit(lambda: jax.tree_util.tree_map(
            lambda s: jnp.zeros(s.shape, s.dtype), self.params_like), out_shardings=self.grad_shardings)
        self.opt_init = jax.jit(tx.init, out_shardings=self.opt_shardings)
        self.update = jax.jit(self._update, donate_argnums=(0, 1),
                              out_shardings=(self.shardings, self.opt_shardings, self.repl))

    def _named(self, specs: Any) -> Any:
        return jax.tree_util.tree_map(lambda s: NamedSharding(self.mesh, s), specs,
                                      is_leaf=lambda x: isinstance(x, P))

    # ------------------------------------------------------------------ pure stage functions
    def _body(self, params, x, packed=None):
        p = params["params"]
        aux = jnp.zeros((), jnp.float32)
        kw = {} if packed is None else {"segment_ids": packed[0], "positions": packed[1]}
        scope = context_parallel(self._cp) if self._cp is not None else contextlib.nullcontext()
        with scope:
            # module-named scopes, as inside the full model: the CFP analysis cuts segments at them
            if self.stage.is_first:
                with jax.named_scope("embed"):
                    x = self.embed.apply({"params": p["embed"]}, x,
                                         **({"positions": packed[1]} if kw else {}))
            for i in self.stage.layer_range:
                with jax.named_scope(f"layers_{i}"):
                    x, a = self.layer_mods[i].apply({"params": p[f"layers_{i}"]}, x, **kw)
                aux = aux + a
        return x, aux

    def forward(self, params, x, packed=None):
        """The un-jitted stage function of a first/middle stage: ``x -> (y, aux)``."""
        return self._body(params, x, packed)

    def last_forward(self, params, x, targets, weights, total_weight, packed=None):
        h, aux = self._body(params, x, packed)
        with jax.named_scope("head"):
            logits = self.head.apply({"params": params["params"]["head"]}, h)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
        # Same guard as cfp.models.loss_fn, applied to the whole global batch's weight.
        return jnp.sum(ce * weights.astype(jnp.float32)) / jnp.maximum(total_weight, 1e-9), aux

    def vjp(self, fn, params, x):
        """vjp w.r.t. params (and x unless x is the first stage's integer tokens)."""
        if self.stage.is_first:
            out, pull = jax.vjp(lambda p: fn(p, x), params)
            return out, lambda ct: (pull(ct)[0], None)
        return jax.vjp(fn, params, x)

    def _backward(self, params, x, g_y, aux_ct, acc, packed=None):
        _, pull = self.vjp(lambda p, x_: self._body(p, x_, packed), params, x)
        g_p, g_x = pull((g_y, aux_ct.astype(jnp.float32)))
        return _add(acc, g_p), g_x

    def _last_backward(self, params, x, targets, weights, total_weight, aux_ct, acc, packed=None):
        fn = lambda p, x_: self.last_forward(p, x_, targets, weights, total_weight, packed)
        _, pull = self.vjp(fn, params, x)
        g_p, g_x = pull((jnp.ones((), jnp.float32), aux_ct.astype(jnp.float32)))
        return _add(acc, g_p), g_x

    def _bwd_out(self, acc, g_x):
        # A scalar "done" output: all outputs of one execution become ready together, and unlike
        # the accumulator it is never donated, so the timing watcher can wait on it safely.
        done = jnp.zeros((), jnp.float32)
        return (acc, done) if self.stage.is_first else (acc, g_x, done)

    def _adamw(self, params, opt_state, grads):
        updates, opt_state = self.tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def _update(self, params, opt_state, grad_parts):
        # The pipelines' gradients are summed here, in list order, fused with AdamW (one program).
        grads = sum_trees(list(grad_parts))
        params, opt_state = self._apply_update(params, opt_state, grads)
        finite = lambda t: jnp.stack([jnp.all(jnp.isfinite(l)) for l in jax.tree_util.tree_leaves(t)])
        # [2, leaves]: gradient / new parameter finite, in tree_leaves order of the stage's params
        return params, opt_state, jnp.stack([finite(grads), finite(params)])

    def _opt_shardings(self) -> Any:
        """Optimizer-state leaves mirroring a parameter (Adam's mu/nu) share its sharding; the rest
        (step counts) are replicated on the stage mesh."""
        by_path = {jax.tree_util.keystr(p): s for p, s in
                   jax.tree_util.tree_flatten_with_path(self.shardings)[0]}
        like = jax.eval_shape(self.tx.init, self.params_like)

        def pick(path, _):
            text = jax.tree_util.keystr(path)
            for suffix, sh in by_path.items():
                if text.endswith(suffix):
                    return sh
            return self.repl
        return jax.tree_util.tree_map_with_path(pick, like)

    # ------------------------------------------------------------------ placement, compiling
    def place_params(self, params: Any) -> Any:
        # from a host copy: the update donates the stage's buffers, which must never be the caller's
        # arrays (device_put onto a replicated sharding reuses the source buffer for its own device's shard)
        return jax.device_put(jax.tree_util.tree_map(lambda a: np.array(a, copy=True), params),
                              self.shardings)

    def compile_jobs(self, micro_batch_size: int, seq_len: int, x_like: Any, y_like: Any,
                     num_pipelines: int) -> list:
        """``(jitted program, abstract arguments)`` of each program, to compile ahead of time.

        ``x_like`` / ``y_like``: the stage's input / output activation (None for the first stage's
        tokens / the last stage's loss)."""
        scalar = jax.ShapeDtypeStruct((), jnp.float32)
        params = _with_sharding(self.params_like, self.shardings)
        grads = _with_sharding(self.params_like, self.grad_shardings)
        opt = _with_sharding(jax.eval_shape(self.tx.init, self.params_like), self.opt_shardings)
        tok = jax.ShapeDtypeStruct((micro_batch_size, seq_len), jnp.int32, sharding=self.rows)
        x = tok.update(sharding=self.act_in) if self.stage.is_first else _with_sharding(x_like, self.act_in)
        if self.stage.is_last:
            w = jax.ShapeDtypeStruct(tok.shape, jnp.float32, sharding=self.rows)
            jobs = [(self.fwd, (params, x, tok, w, scalar)),
                    (self.bwd, (params, x, tok, w, scalar, scalar, grads))]
        else:
            y = _with_sharding(y_like, self.act_out)
            jobs = [(self.fwd, (params, x)), (self.bwd, (params, x, y, scalar, grads))]
        return jobs + [(self.zeros, ()), (self.update, (params, opt, [grads] * num_pipelines))]


def _context_parallel(mesh, stage: PlacedStage, modules: tuple) -> ContextParallel:
    """Ring attention over the stage's ``cp`` axis; heads stay sharded over ``tp`` when ``tp`` divides
    both the query and the key/value heads (else attention gathers them)."""
    cfg = modules[0].config
    kv = getattr(cfg, "num_kv_heads", cfg.num_heads)
    heads_ok = stage.tp > 1 and cfg.num_heads % stage.tp == 0 and kv % stage.tp == 0
    return ContextParallel(mesh, CP_AXIS, CpMethod.RING, TP_AXIS if heads_ok else None)


def _with_sharding(like: Any, shardings: Any) -> Any:
    return jax.tree_util.tree_map(lambda l, s: jax.ShapeDtypeStruct(l.shape, l.dtype, sharding=s),
                                  like, shardings)


def _add(a, b):
    return jax.tree_util.tree_map(jnp.add, a, b)


def sum_trees(trees: list) -> Any:
    """Elementwise sum in list order (the order is fixed so every pipeline gets the same bits)."""
    out = trees[0]
    for t in trees[1:]:
        out = _add(out, t)
    return out

