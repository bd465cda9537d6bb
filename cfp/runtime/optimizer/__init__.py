"""Any optax transformation run stage by stage, computing what it computes on one device.

A layered model's parameters are ``{"first": tree, "layers": L, "last": tree}``, where ``layers`` is a list of
L per-layer trees (the **list form**) or one tree whose every leaf has a leading layer dim of size L (the
**stacked form**: ``nn.scan``, ``nnx.vmap``, ``eqx.filter_vmap``). A stage holds (`StageHolding`) "first" or
not, layers ``[start, stop)`` and "last" or not. ``OptimizerPartition.of(tx, params_like)`` traces
``tx.update`` followed by ``optax.apply_updates`` once on the whole abstract tree (nothing is allocated), in the
user's own structure, and proves that each stage can compute its own part of exactly that:

* every parameter leaf has a **unit**, the place that holds it: "first", "last", list layer i, or the stacked
  layers (a stage holds rows ``[start, stop)`` of every stacked leaf). An optimizer-state leaf takes the unit
  of the value that replaces it (a fixpoint over the update); one that depends on no parameter (``count``, a
  schedule's step, a PRNG key) is **replicated**: every stage keeps its own copy, and the copies stay equal;
* an operation on one unit's values (and replicated ones) runs on that unit's stage. On stacked values it must
  keep the layers apart (elementwise ops, reductions over other dims, dims moved around the layer dim,
  dot_general batched over it, reshapes that keep each layer's elements whole rows, ...: the rules are
  `cfp.ir._jax_internals.layer_rule`); it then runs on the stage's rows with its shape params rewritten, and
  replicated operands of layer size are sliced to those rows. ``lax.cond`` is seen through (both branches,
  then a select), so ``optax.apply_if_finite`` and ``optax.MultiSteps`` split too;
* a **global** value depends on several units: a scalar that one unit's stage computes and **exports** (a
  leaf's squared norm), or a reduction over the layers of a stacked leaf, computed per stage on its rows and
  **combined** (sum, max, min, product, and, or) in stage order, at most `GLOBAL_LIMIT` values. What is then
  computed from global values only (the global norm and clip factor, adafactor's RMS of a stacked leaf) is
  evaluated once by `OptimizerPartition.combine`.

Refused before any training, with a one-line `ConfigError` naming the leaves and the primitive: an operation
combining the whole (non-scalar) values of two units (``optax.flatten``'s concatenation, a transform adding
one leaf's gradient to another's), an operation on a stacked leaf that mixes its layers other than by a
reduction (``x[::-1]``, a reshape cutting through a layer, opaque control flow), a reduction over the layers
yielding more than `GLOBAL_LIMIT` values, and a new parameter value depending on another unit. Not supported:
``tx.update`` needing extra arguments (``value=`` of polyak_sgd, lbfgs' line search).

**Per step** (inputs per stage: its gradients -- summed over every pipeline -- and parameters as
``st.cut_params`` cuts them from whole trees: the keys "first", "layers", "last" it holds, stacked leaves as
rows ``[start, stop)``; its optimizer state as ``st.cut_state`` cuts it: ``{keystr(path): leaf}``)::

    p = OptimizerPartition.of(tx, params_like)
    stages = [p.stage(h) for h in holdings]              # per pipeline, in stage order
    glob = {}
    for r in range(p.rounds):                            # 0 when nothing crosses stages (adam, lion, sgd...)
        parts = [st.partials(r, g, s, w, glob) for st, g, s, w in pipeline_0]   # in stage order
        glob = p.combine(r, parts, glob)                 # small: scalars and layer reductions
    for every stage of every pipeline: w, s = st.update(g, s, w, glob)

``partials`` and ``combine`` are pure and jit-able. ``rounds`` is 1 for a global norm over any number of
units; a global value needing another one first takes a round more (adafactor's parameter scale on a stacked
leaf, a second global norm after a clip). ``update`` runs each unit's part as its own compiled program
(cached per unit shape; list layers of equal shapes share one), so call it outside ``jax.jit``.

**Bit-identity across pipelines.** The global values come from pipeline 0's partials only, and every stage of
every pipeline gets the same ones. Everything else a stage computes is one unit's values, and a unit's update
is the same compiled program in every pipeline holding it: XLA compiles an expression according to the program
around it (it contracts ``a*b+c`` into an FMA and turns ``x/y`` into ``x*(1/y)`` by context: two stages with
other boundaries, compiled as one program each, differed in the last bit), so one program per unit keeps the
bits equal. The stacked layers' program differs by its row count only. Stage programs compiled for other
shardings (another TP degree) may still differ where a unit's update reduces over a sharded dim. NaN and Inf
propagate as on one device (nothing is masked). `OptimizerPartition.merge` rebuilds the user's whole
``(params, opt_state)`` (host numpy) from one pipeline's stages, for checkpoints and verification.
"""
from cfp.runtime.optimizer.flow import GLOBAL_LIMIT
from cfp.runtime.optimizer.param_tree import Part, StageHolding, Unit
from cfp.runtime.optimizer.partition import OptimizerPartition
from cfp.runtime.optimizer.stage import StageOptimizer

__all__ = ["GLOBAL_LIMIT", "OptimizerPartition", "Part", "StageHolding", "StageOptimizer", "Unit"]
