"""Derive a `LayeredModel`'s cost facts (`cfp.layered.facts.CostFacts`) from its own traced and compiled parts,
not from formulas per model name.

For `first`, one layer of each kind (each distinct layer function) and `last`, on the example micro-batch:

* traced (`cfp.ir.capture`, nothing runs): every dot_general as a GEMM (batch, m, n, k loops, FLOPs), which of
  its loops carries the batch rows (so it scales to any micro-batch), the memory-bound operations' bytes and
  the softmax exponentials (`exp`), the parameters by dtype;
* compiled for the default device (abstract arguments, nothing runs): XLA's cost analysis of the forward
  (FLOPs, bytes accessed: less the dots' operands and results, the memory-bound bytes) and of the runtime's
  backward (the forward recomputed, then the gradients: its FLOPs less the forward's are the gradients');
  XLA's memory analysis of that backward over one and two layers (the growth per layer is what a layer keeps
  for the backward, the rest the backward's transients); `first`'s backward at the micro-batch and twice it
  (its figures that do not grow with the rows: e.g. a dense embedding-table gradient); `last`'s backward
  (logits, their softmax and gradient);
* the optimizer's state (`jax.eval_shape(optimizer.init, params)`), each leaf with the parameter it mirrors.

Per tensor-parallel degree: parameters split by the one rules table (`cfp.sharding.rules`) on their logical
names (`LayeredModel.logical_names`), their splits walked through the traced part (`cfp.layered.marks`: a dot
that contracts a split dim is all-reduced); a model without names gets Megatron's splits guessed from shapes
(`cfp.layered.marks`, an approximation). The dots' GEMMs and the parameters and optimizer state follow the
splits exactly; the compiled figures (XLA's, at TP 1) are scaled by the share of the traced bytes on split
tensors (memory-bound bytes and FLOPs: of the memory-bound operations; kept activations and transients: of all
intermediate tensors) -- an approximation, as XLA at TP 1 is not XLA at TP 2.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from cfp.errors import CfpError, ConfigError
from cfp.ir.capture import capture
from cfp.ir.graph import SCAN_PORTS, OpGraph
from cfp.layered.facts import CostFacts, GemmFact, PartFacts, PartTable
from cfp.layered.marks import Walked, dot_loops, walk
from cfp.layered.model import LayeredModel
from cfp.sharding.rules import names_tensor_dim
from cfp.xla.compiled import compiled_cost, device_kind

DEFAULT_TP_DEGREES = tuple(range(1, 17))     # the planner may cut a machine into groups of any size


@dataclasses.dataclass(frozen=True)
class FactsOptions:
    """`tokens_per_row`: tokens of one row of a batch (a sequence's length; 1: report rows); `tp_degrees`: the
    tensor-parallel degrees to derive figures for (1 among them)."""
    tokens_per_row: int = 1
    tp_degrees: tuple[int, ...] = DEFAULT_TP_DEGREES

    def __post_init__(self):
        for name, v in (("tokens_per_row", self.tokens_per_row),
                        *(("tp_degrees", t) for t in self.tp_degrees)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ConfigError(f"FactsOptions.{name}={v!r} must be a positive integer")
        if 1 not in self.tp_degrees:
            raise ConfigError(f"FactsOptions.tp_degrees={self.tp_degrees!r} must include 1")
        object.__setattr__(self, "tp_degrees", tuple(sorted({int(t) for t in self.tp_degrees})))


# ----------------------------------------------------------------------------- the activation's float leaves
def _is_float(a: Any) -> bool:
    return jnp.issubdtype(a.dtype, jnp.floating)


def _floats(tree: Any) -> list:
    return [a for a in jax.tree_util.tree_leaves(tree) if _is_float(a)]


def _with_floats(tree: Any, floats: Sequence) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    it = iter(floats)
    return jax.tree_util.tree_unflatten(treedef, [next(it) if _is_float(a) else a for a in leaves])


def _abstract(tree: Any, rows: Optional[int] = None) -> Any:
    """ShapeDtypeStructs of `tree`, the leading (rows) dim set to `rows` where given."""
    def one(a):
        shape = tuple(np.shape(a))
        if rows is not None and shape:
            shape = (rows,) + shape[1:]
        return jax.ShapeDtypeStruct(shape, jnp.result_type(a))
    return jax.tree_util.tree_map(one, tree)


# ----------------------------------------------------------------------------- programs
# The runtime's backward programs: the forward recomputed, then the gradients, the parameters' added to their
# accumulator (donated, so XLA may add in place: a dense gradient it cannot fuse into the sum is a transient).
def _accumulate(acc: Any, grads: Any) -> Any:
    return jax.tree_util.tree_map(jnp.add, acc, grads)


def _layers_backward(fn: Callable) -> Callable:
    """Consecutive layers' backward: (their parameters, accumulators, input, output gradient) -> (the
    accumulators plus the parameters' gradients, the gradient of the input's float leaves)."""
    def backward(ps, accs, x, g):
        def run(ps, xf):
            y = _with_floats(x, xf)
            for p in ps:
                y = fn(p, y)
            return _floats(y)
        _, vjp = jax.vjp(run, ps, _floats(x))
        dp, dx = vjp(g)
        return _accumulate(accs, dp), dx
    return backward


def _first_backward(first: Callable) -> Callable:
    def backward(p, acc, batch, g):
        _, vjp = jax.vjp(lambda p: _floats(first(p, batch)), p)
        return _accumulate(acc, vjp(g)[0])
    return backward


def _last_backward(last: Callable) -> Callable:
    def backward(p, acc, x, batch):
        loss = lambda p, xf: last(p, _with_floats(x, xf), batch)[0]
        dp, dx = jax.grad(loss, argnums=(0, 1))(p, _floats(x))
        return _accumulate(acc, dp), dx
    return backward


@dataclasses.dataclass(frozen=True)
class _Xla:
    flops: float
    bytes: float
    temp: float


def _compile(what: str, fn: Callable, *args, donate: tuple[int, ...] = ()) -> _Xla:
    try:
        c = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
    except CfpError:
        raise
    except Exception as e:  # the user's code: say which part, in one line
        first = (str(e).strip().splitlines() or [""])[0]
        raise ConfigError(f"compiling {what} for its cost facts failed: {type(e).__name__}: {first[:300]}") from e
    cost = compiled_cost(c)
    figures = (float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0)),
               float(c.memory_analysis().temp_size_in_bytes))
    if not all(math.isfinite(v) and v >= 0 for v in figures):
        raise ConfigError(f"XLA's cost or memory analysis of {what} is {figures}; the facts need finite figures")
    return _Xla(*figures)


# ----------------------------------------------------------------------------- traced parts
@dataclasses.dataclass(frozen=True)
class _Traced:
    what: str
    graph: OpGraph
    params: tuple[int, ...]                   # graph input tensors of the parameters, in leaf order
    names: tuple[Optional[tuple], ...]        # their logical names (None: none)
    rows: Walked                              # the rows' marks

    def splits(self, tp: int, named: bool) -> Walked:
        if tp == 1:
            return walk(self.graph, {})
        seeds = {}
        if named:
            for t, names in zip(self.params, self.names):
                if names is not None:
                    d = names_tensor_dim(names, self.graph.tensor(t).shape, tp)
                    if d is not None:
                        seeds[t] = {d}
        return walk(self.graph, seeds, tp, self.rows.marks, guess=not named)

    def split_params(self, w: Walked) -> set[int]:
        """Leaf positions of the parameters split in walk `w`."""
        return {i for i, t in enumerate(self.params) if w.marks.get(t) or t in w.guessed}


def _trace(what: str, fn: Callable, args: tuple, n_params: int, names: Sequence, rows: int) -> _Traced:
    try:
        program = capture(fn, *args)
    except CfpError as e:
        raise ConfigError(f"tracing {what} for its cost facts failed: {e}") from None
    g = program.graph
    seeds = {t: {0} for t in g.inputs[n_params:] if g.tensor(t).shape[:1] == (rows,)}
    return _Traced(what, g, tuple(g.inputs[:n_params]), tuple(names), walk(g, seeds))


def _leaf_names(names: Any, params: Any, strip_first: bool = False) -> list:
    """Per leaf of `params` its logical names from the tree `names` (None where it has none)."""
    n = len(jax.tree_util.tree_leaves(params))
    if names is None:
        return [None] * n
    is_names = lambda t: t is None or (isinstance(t, tuple) and all(x is None or isinstance(x, str) for x in t))
    table = {jax.tree_util.keystr(p): t for p, t in
             jax.tree_util.tree_flatten_with_path(names, is_leaf=is_names)[0]}
    out = []
    for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]:
        t = table.get(jax.tree_util.keystr(path))
        out.append(None if t is None or not any(t) else (tuple(t[1:]) if strip_first else tuple(t)))
    return out


# ----------------------------------------------------------------------------- figures of a traced part
@dataclasses.dataclass(frozen=True)
class _Jaxpr:
    """A traced part's figures at one TP degree, per device, for the example micro-batch (all its rows)."""
    gemms: tuple[GemmFact, ...]       # per row (see `GemmFact`)
    dot_flops: float
    dot_bytes: float                  # the dots' operands and results
    elementwise: float                # memory-bound operations' operands and results
    exp: float                        # results of `exp`
    intermediates: float              # every operation's results
    all_reduce: float                 # results of dots that contract a split dim
    split: frozenset[int]             # parameter leaves split


def _rows_loop(op, graph: OpGraph, marks) -> Optional[str]:
    """Which loop of a dot carries the batch rows ("b", "m", "n", "k"), None if none does."""
    b, lf, rf, k = dot_loops(op, graph)
    lm, rm = marks.get(op.inputs[0], frozenset()), marks.get(op.inputs[1], frozenset())
    if any(x in lm for x in b) or any(y in rm for y in op.dot.rhs_batch):
        return "b"
    for loop, dims, m in (("m", lf, lm), ("n", rf, rm), ("k", k, lm)):
        if any(x in m for x in dims):
            return loop
    return None


def _gemm(op, graph: OpGraph, sizes, split: Optional[str], tp: int, rows: int, loop: Optional[str],
          repeat: int) -> GemmFact:
    b, m, n, k = (float(x) / (tp if split == name else 1) for x, name in zip(sizes, "bmnk"))
    flops = 2.0 * b * m * n * k * repeat
    if loop is None:
        return GemmFact(flops, (m, n, k), None)
    shape = tuple(d / rows if name == loop else d for d, name in zip((m, n, k), "mnk"))
    return GemmFact(flops / rows, shape, loop)


def _jaxpr_figures(tr: _Traced, tp: int, named: bool, rows: int) -> _Jaxpr:
    g, w = tr.graph, tr.splits(tp, named)
    nbytes = lambda t: g.tensor(t).nbytes / (tp if w.split(t) else 1)
    gemms, dot_flops, dot_bytes, ar = [], 0.0, 0.0, 0.0
    for ds in w.dots:
        op, rep = g.operators[ds.op], g.repeat(ds.op)
        gm = _gemm(op, g, ds.sizes, ds.split, tp, rows, _rows_loop(op, g, tr.rows.marks), rep)
        gemms.append(gm)
        dot_flops += gm.flops * (rows if gm.scale is not None else 1)
        dot_bytes += rep * sum(nbytes(t) for t in (*op.inputs[:2], op.outputs[0]) if t is not None)
        if ds.split == "k":
            ar += rep * ds.out_bytes
    elementwise = exp = inter = 0.0
    for op in g.operators:
        if op.primitive in SCAN_PORTS:
            continue
        rep = g.repeat(op.index)
        outs = sum(nbytes(t) for t in op.outputs if t is not None)
        inter += rep * outs
        if op.is_dot:
            continue
        elementwise += rep * (outs + sum(nbytes(t) for t in op.inputs if t is not None))
        if op.primitive == "exp":
            exp += rep * outs
    return _Jaxpr(tuple(gemms), dot_flops, dot_bytes, elementwise, exp, inter, ar,
                  frozenset(tr.split_params(w)))


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else 1.0


# ----------------------------------------------------------------------------- parameters and optimizer state
@dataclasses.dataclass(frozen=True)
class _Leaf:
    key: str          # its path in the model's parameters (keystr)
    size: float       # elements of one layer's share
    itemsize: int
    opt: tuple[tuple[float, bool], ...]   # the optimizer state's leaves mirroring it: (bytes, same shape)


def _optimizer_index(optimizer: Any, params: Any) -> tuple[dict[str, list], float]:
    """Per parameter path, the optimizer state leaves whose path ends with it (`optax` states mirror the
    parameters: moments, factored second moments), as (bytes, same shape as the parameter); and the bytes of
    the state that mirrors none (step counts)."""
    try:
        state = jax.eval_shape(optimizer.init, params)
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0]
        raise ConfigError(f"optimizer.init(params) failed: {type(e).__name__}: {first[:300]}") from e
    shapes = {jax.tree_util.keystr(p): tuple(a.shape) for p, a in jax.tree_util.tree_flatten_with_path(params)[0]}
    index: dict[str, list] = {k: [] for k in shapes}
    other = 0.0
    for path, a in jax.tree_util.tree_flatten_with_path(state)[0]:
        nbytes = float(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize)
        q = jax.tree_util.keystr(path)
        match = max((k for k in shapes if q.endswith(k)), key=len, default=None)
        if match is None:
            other += nbytes
        else:
            index[match].append((nbytes, tuple(a.shape) == shapes[match]))
    return index, other


def _leaves(params: Any, prefix: tuple, index: dict, per: int = 1) -> list[_Leaf]:
    """The leaves of the parameter subtree at `prefix` (keys into the model's parameters), each counted as
    1/`per` of itself (a stacked tree: one layer's share)."""
    sub = params
    for k in prefix:
        sub = sub[k]
    base = "".join(f"[{k!r}]" for k in prefix)
    out = []
    for path, a in jax.tree_util.tree_flatten_with_path(sub)[0]:
        key = base + jax.tree_util.keystr(path)
        opt = tuple((b / per, same) for b, same in index.get(key, ()))
        out.append(_Leaf(key, math.prod(a.shape) / per, jnp.dtype(a.dtype).itemsize, opt))
    return out


def _state(leaves: list[_Leaf], split: frozenset, tp: int) -> tuple[float, float, float]:
    """(elements, bytes, optimizer bytes) per device of `leaves` with the leaves at positions `split` split."""
    n = b = o = 0.0
    for i, leaf in enumerate(leaves):
        f = tp if i in split else 1
        n += leaf.size / f
        b += leaf.size * leaf.itemsize / f
        o += sum(nb / (f if same else 1) for nb, same in leaf.opt)
    return n, b, o


# ----------------------------------------------------------------------------- one part's table
@dataclasses.dataclass(frozen=True)
class _Compiled:
    """A part's XLA figures at TP 1 for the example micro-batch: the forward; the backward's FLOPs (recompute
    included); what it keeps per row-scaled micro-batch (`act`) and its transients (`temp`); for `first`, its
    backward's memory-bound bytes that do not grow with the rows and those that do (per row)."""
    fwd: _Xla
    bwd_flops: float
    act: float
    temp: float
    bwd_const: float = 0.0
    bwd_row: float = 0.0
    temp_fixed: bool = False      # `temp` does not grow with the rows (`first`'s parameter gradients)


def _table(figs: dict[int, _Jaxpr], xla: _Compiled, leaves: list[_Leaf], rows: int, boundary: float,
           share: float = 1.0) -> PartTable:
    one = figs[1]
    elem1 = max(xla.fwd.bytes - one.dot_bytes, 0.0)
    eflops1 = max(xla.fwd.flops - one.dot_flops, 0.0)
    grads1 = max(xla.bwd_flops - xla.fwd.flops, 0.0)
    out = []
    for tp, j in sorted(figs.items()):
        re, ra = _ratio(j.elementwise, one.elementwise), _ratio(j.intermediates, one.intermediates)
        elem = elem1 * re / rows
        n, b, o = _state(leaves, j.split, tp)
        out.append((tp, PartFacts(
            gemms=j.gemms, flops=(j.dot_flops + eflops1 * re) / rows,
            backward_flops=grads1 * _ratio(j.dot_flops, one.dot_flops) / rows,
            elementwise_bytes=elem, score_bytes=min(4 * j.exp / rows, elem),
            backward_bytes=xla.bwd_const * re, backward_row_bytes=xla.bwd_row * re / rows,
            activation_bytes=xla.act * ra / rows, temp_bytes=xla.temp * ra / (1 if xla.temp_fixed else rows),
            params=n, param_bytes=b, optimizer_bytes=o,
            all_reduces=j.all_reduce / rows / boundary if boundary > 0 else 0.0)))
    return PartTable(tuple(out), share)


# ----------------------------------------------------------------------------- compiling the parts
def _two_point(at_r: float, at_2r: float, rows: int) -> tuple[float, float]:
    """(part that does not grow with the rows, per row) of a figure measured at `rows` and 2 `rows` rows."""
    per_row = max(at_2r - at_r, 0.0) / rows
    return max(at_r - per_row * rows, 0.0), per_row


def _compile_first(model: LayeredModel, p: Any, batch: Any, x: Any, rows: int, dot_bytes: float) -> _Compiled:
    fwd = _compile("first(params['first'], batch)", model.first, p, batch)
    back = _first_backward(model.first)
    at = {}
    for r in (rows, 2 * rows):
        b, xr = _abstract(batch, r), _abstract(x, r)
        at[r] = _compile("first's backward", back, p, p, b, _floats(xr), donate=(1,))
    # the backward's dots: the recomputed forward's and the weight gradients', as many bytes each
    bytes_const, bytes_row = _two_point(at[rows].bytes - 2 * dot_bytes, at[2 * rows].bytes - 4 * dot_bytes, rows)
    temp_const, temp_row = _two_point(at[rows].temp, at[2 * rows].temp, rows)
    fwd_row = max(fwd.bytes - dot_bytes, 0.0) / rows
    return _Compiled(fwd, at[rows].flops, temp_row * rows, temp_const, bytes_const,
                     max(bytes_row - fwd_row, 0.0) * rows, temp_fixed=True)


def _compile_layer(i: int, fn: Callable, p: Any, x: Any) -> _Compiled:
    fwd = _compile(f"layer {i}", fn, p, x)
    back = _layers_backward(fn)
    one = _compile(f"layer {i}'s backward", back, [p], [p], x, _floats(x), donate=(1,))
    two = _compile(f"layers {i}, {i}'s backward", back, [p, p], [p, p], x, _floats(x), donate=(1,))
    act = max(two.temp - one.temp, 0.0)
    return _Compiled(fwd, one.flops, act, max(one.temp - act, 0.0))


def _compile_last(model: LayeredModel, p: Any, x: Any, batch: Any) -> _Compiled:
    fwd = _compile("last(params['last'], x, batch)", model.last, p, x, batch)
    back = _compile("last's backward", _last_backward(model.last), p, p, x, batch, donate=(1,))
    return _Compiled(fwd, back.flops, back.temp, 0.0)


# ----------------------------------------------------------------------------- the model
def _power_of_two(n: int) -> int:
    """The largest power of two up to `n`: the planner's TP degrees are powers of two dividing `tp_divisor`."""
    return 1 << (int(n).bit_length() - 1)


def _rows(batch: Any) -> int:
    return int(np.shape(jax.tree_util.tree_leaves(batch)[0])[0])


def _layer_params(model: LayeredModel, params: Any, i: int) -> Any:
    """Layer `i`'s abstract parameters (a stacked tree: without the layer dim)."""
    if model.stacked:
        return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), params["layers"])
    return params["layers"][i]


def _kinds(model: LayeredModel) -> list[tuple[int, list[int]]]:
    """(first layer, all layers) of each distinct layer function, in order."""
    seen: dict[int, tuple[int, list[int]]] = {}
    for i in range(model.num_layers):
        seen.setdefault(id(model.layer_fn(i)), (i, []))[1].append(i)
    return list(seen.values())


def _layer_names(model: LayeredModel, i: int) -> Any:
    """Layer `i`'s logical names tree (a stacked model's: with the layer dim first), None without names."""
    names = (model.logical_names or {}).get("layers")
    if names is None or model.stacked:
        return names
    return names[i]


def _dot_dtype(traced: Sequence[_Traced]) -> str:
    """The operand dtype of the most dot FLOPs among the layers."""
    flops: dict[str, float] = {}
    for tr in traced:
        for op in tr.graph.dots:
            b, m, n, k = (math.prod(x) for x in _loop_sizes(op, tr.graph))
            dt = tr.graph.tensor(op.inputs[0]).dtype
            flops[dt] = flops.get(dt, 0.0) + b * m * n * k
    return max(flops, key=flops.get) if flops else "float32"


def _loop_sizes(op, graph: OpGraph):
    lhs, rhs = (graph.tensor(t) for t in op.inputs[:2])
    b, lf, rf, k = dot_loops(op, graph)
    return ([lhs.shape[i] for i in b], [lhs.shape[i] for i in lf], [rhs.shape[i] for i in rf],
            [lhs.shape[i] for i in k])


def _used_bytes(tr: _Traced, n_before: int, rows: int) -> float:
    """Bytes per row of the graph inputs after the first `n_before` that the part reads."""
    g = tr.graph
    return sum(g.tensor(t).nbytes for t in g.inputs[n_before:] if g.consumers.get(t)) / rows


def derive_facts(model: LayeredModel, example_batch: Any, *, optimizer: Any = None,
                 options: Optional[FactsOptions] = None) -> CostFacts:
    """The cost facts of `model` on micro-batches like `example_batch` (module doc). `optimizer`: the optax
    transformation whose state the stages hold (None: `optax.adamw`, as the zoo's runs)."""
    import optax
    if not isinstance(model, LayeredModel):
        raise ConfigError(f"derive_facts needs a cfp.LayeredModel, got {type(model).__name__}")
    options = options or FactsOptions()
    tx = optax.adamw(1e-3) if optimizer is None else optimizer
    if not isinstance(tx, optax.GradientTransformation):
        raise ConfigError(f"optimizer={tx!r} is not an optax GradientTransformation")
    x = model.check(example_batch)
    rows, params, batch = _rows(example_batch), _abstract(model.params), _abstract(example_batch)
    names, named = model.logical_names or {}, model.logical_names is not None
    index, other = _optimizer_index(tx, params)
    boundary = sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in jax.tree_util.tree_leaves(x)) / rows
    n_first = len(jax.tree_util.tree_leaves(params["first"]))
    first = _trace("first", model.first, (params["first"], batch), n_first,
                   _leaf_names(names.get("first"), params["first"]), rows)
    last = _trace("last", model.last, (params["last"], x, batch), len(jax.tree_util.tree_leaves(params["last"])),
                  _leaf_names(names.get("last"), params["last"]), rows)
    tps = options.tp_degrees
    figs = lambda tr: {tp: _jaxpr_figures(tr, tp, named, rows) for tp in tps}
    f_first, f_last = figs(first), figs(last)
    first_leaves = _leaves(params, ("first",), index)
    if other:       # the state that mirrors no parameter (step counts): held once, with the first part's
        first_leaves.append(_Leaf("", 0.0, 1, ((other, False),)))
    tables, traced = [], []
    for rep, layers in _kinds(model):
        p = _layer_params(model, params, rep)
        lnames = _leaf_names(_layer_names(model, rep), p, strip_first=model.stacked)
        tr = _trace(f"layer {rep}", model.layer_fn(rep), (p, x), len(jax.tree_util.tree_leaves(p)), lnames, rows)
        traced.append(tr)
        leaves = (_leaves(params, ("layers",), index, model.num_layers) if model.stacked
                  else _leaves(params, ("layers", rep), index))
        tables.append(_table(figs(tr), _compile_layer(rep, model.layer_fn(rep), p, x), leaves, rows, boundary,
                             len(layers) / model.num_layers))
    act = max(_floats(x), key=lambda a: math.prod(a.shape), default=None)
    return CostFacts(
        name=model.name, num_layers=model.num_layers, seq_len=options.tokens_per_row, dtype=_dot_dtype(traced),
        tp_divisor=math.gcd(model.heads[0], _power_of_two(max(tps))) if model.heads else _power_of_two(max(tps)),
        act_itemsize=jnp.dtype(act.dtype).itemsize if act is not None else 4, boundary=boundary,
        tokens=_used_bytes(first, n_first, rows),
        first=_table(f_first, _compile_first(model, params["first"], batch, x, rows, f_first[1].dot_bytes),
                     first_leaves, rows, boundary),
        kinds=tuple(tables),
        last=_table(f_last, _compile_last(model, params["last"], x, batch), _leaves(params, ("last",), index),
                    rows, boundary),
        backend=device_kind())
