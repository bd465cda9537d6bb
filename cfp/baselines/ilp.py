"""Alpa-style ILP over the captured program: one sharding decision per operator, solved with HiGHS.

Formulation (Zheng et al., Alpa, OSDI'22, §4.2), on cfp's `OpGraph`:

* *Nodes* (decision variables). Every dot_general has the strategies of `enumerate_strategies` (each uses
  every mesh axis). Every flat input (parameter, optimizer state, batch) chooses a layout among
  `candidate_specs`. Every other operator *follows* its largest operand (Alpa's follow rule): it joins the
  node that produces that operand and shares its variable, its output layout being the operand's mapped
  through `dimflow.links`. Operators without dim links (gather, iota, control flow, ...) run replicated.
* *Node cost* per strategy: all-reduces of sharded contracting dims and of reductions over sharded dims,
  all-gathers of sharded dims an operator drops, resharding inside a node, and dot compute time.
  Collectives are alpha-beta: a per-call latency alpha plus cfp's one collective time model
  (`cfp.hardware.collectives.collective_time`, ring: all-reduce 2(n-1)/n * B / bw, all-gather and
  all-to-all (n-1)/n * B / bw, B the per-device buffer); slicing a replicated tensor is free.
* *Edge cost*: resharding a tensor from its producer's layout to the layout its consumer needs, one matrix
  per pair of nodes; the products x_u,i * x_v,j are linearised with continuous e_ij >= 0,
  sum_j e_ij = x_u,i, sum_i e_ij = x_v,j (as in Alpa).
* *Memory*: sum of the per-device bytes of every flat input, every step output and every dot output (the
  large activations) under the chosen layouts <= budget (a linear constraint; the smallest feasible budget
  is the sum of per-node minima). Other temporaries are not modelled, so compiled memory is higher.

Mapping to CFP's per-block `choice` (`ilp_step` applies it with the ILP's own input/output layouts): each ParallelBlock's strategy index is the ILP's choice for the block's
forward dot (its candidate list is the same `enumerate_strategies` list). Alpa decides backward dots on their
own; `apply_choice` instead derives them from the forward dot through the block's loop map, so where the
ILP's backward choice differs it is overridden by the forward one. Those overrides are counted in
`IlpResult.disagreements` and `IlpResult.cost_of_choice` re-prices the choice as applied.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import time
from typing import Sequence

import numpy as np

from cfp.analysis.analysis import Analysis
from cfp.analysis import dimflow
from cfp.analysis.blocks import loops_of
from cfp.analysis.block_sharding import DimAxes, shards
from cfp.analysis.strategies import DotStrategy, enumerate_strategies
from cfp.errors import ConfigError, InfeasibleError
from cfp.hardware import rates
from cfp.hardware.collectives import collective_time
from cfp.hardware.gpus import GpuSpec
from cfp.ir.graph import OpGraph
from cfp.sharding.specs import partition_spec, resolve
from cfp.sharding.step import ShardedStep


@dataclasses.dataclass(frozen=True)
class AlphaBeta:
    """Alpha-beta network and compute rates (defaults: a generic NVLink-class GPU)."""

    bandwidth: float | tuple[float, ...] = 100e9   # bytes/s, per mesh axis when a tuple
    # alpha, seconds per collective. Small on purpose, as in Alpa (mesh_alpha ~ the cost of one byte): XLA's
    # all-reduce combiner merges the many per-parameter gradient all-reduces, so NCCL's ~10 us per call
    # would make every per-parameter collective look far costlier than it is.
    latency: float = 1e-7
    flops: float = 100e12                           # dense FLOP/s per device

    @classmethod
    def for_gpu(cls, gpu: GpuSpec, dtype: str = "float32") -> "AlphaBeta":
        """`gpu`'s figures from the cost floor the planner and the estimate profiler read: its link bandwidth
        (`cfp.hardware.gpus`) and the achievable FLOP/s of a large GEMM in the arithmetic JAX runs `dtype`'s
        dots in (`cfp.hardware.rates`: float32 as TF32 where the device has it), not the datasheet peak."""
        return cls(bandwidth=gpu.link_gbps * 1e9,
                   flops=rates.achievable_flops(gpu, rates.dot_precision(dtype, None, gpu)))

    def bw(self, axis: int) -> float:
        return self.bandwidth[axis] if isinstance(self.bandwidth, tuple) else self.bandwidth

    def all_reduce(self, nbytes: float, axes: Sequence[int], shape: Sequence[int]) -> float:
        n = math.prod(shape[a] for a in axes)
        if n <= 1 or nbytes <= 0:
            return 0.0
        return self.latency + collective_time("all-reduce", nbytes, n, min(self.bw(a) for a in axes))

    def reshard(self, src: DimAxes, dst: DimAxes, nbytes: float, shape: Sequence[int]) -> float:
        """Move a tensor of `nbytes` (whole) from layout `src` to `dst`, one mesh axis at a time."""
        if src == dst:
            return 0.0
        dim_s, dim_d = _dim_of_axis(src), _dim_of_axis(dst)
        total = 0.0
        for a, n in enumerate(shape):
            ds, dd = dim_s.get(a), dim_d.get(a)
            if n <= 1 or ds == dd or ds is None:
                continue                     # unchanged, or replicated -> sharded (a local slice)
            # bytes each device holds along this axis: the tensor divided by the axes both layouts keep
            kept = math.prod(shape[b] for b in dim_s if b != a and dim_s[b] == dim_d.get(b))
            local = nbytes / kept
            if dd is None:      # sharded -> replicated: all-gather of the whole local part
                total += self.latency + collective_time("all-gather", local, n, self.bw(a))
            else:               # another dim: all-to-all of the device's shard
                total += self.latency + collective_time("all-to-all", local / n, n, self.bw(a))
        return total


def _dim_of_axis(spec: DimAxes) -> dict[int, int]:
    return {a: d for d, axes in enumerate(spec) for a in axes}


def candidate_specs(tshape: Sequence[int], mesh_shape: Sequence[int]) -> tuple[DimAxes, ...]:
    """Replicated first, then every assignment of each mesh axis (size > 1) to one dim that divides."""
    active = [a for a, n in enumerate(mesh_shape) if n > 1]
    out = []
    for dims in itertools.product([None, *range(len(tshape))], repeat=len(active)):
        spec = [[] for _ in tshape]
        for a, d in zip(active, dims):
            if d is not None:
                spec[d].append(a)
        if all(tshape[d] % math.prod(mesh_shape[a] for a in axes) == 0 for d, axes in enumerate(spec)):
            out.append(tuple(tuple(x) for x in spec))
    return tuple(out)


@dataclasses.dataclass
class Node:
    """One decision variable: a dot, a flat input, or a fixed (replicated) group; followers share it."""

    kind: str                                  # "dot" | "input"
    label: str
    specs: list[dict[int, DimAxes]]            # per strategy: layout of every tensor the node produces
    cost: np.ndarray                           # per strategy, seconds
    memory: np.ndarray                         # per strategy, bytes per device
    strategies: tuple[DotStrategy, ...] = ()   # dot nodes
    op: int | None = None                      # the dot's operator index

    @property
    def k(self) -> int:
        return len(self.specs)


@dataclasses.dataclass
class Problem:
    """The ILP's data: nodes, pairwise edge cost matrices (u < v) and the mesh it was built for."""

    nodes: list[Node]
    edges: dict[tuple[int, int], np.ndarray]
    mesh_shape: tuple[int, ...]
    node_of_dot: dict[int, int]

    def cost(self, node_choice: Sequence[int]) -> float:
        c = sum(n.cost[k] for n, k in zip(self.nodes, node_choice))
        return float(c + sum(m[node_choice[u], node_choice[v]] for (u, v), m in self.edges.items()))

    def memory(self, node_choice: Sequence[int]) -> float:
        return float(sum(n.memory[k] for n, k in zip(self.nodes, node_choice)))

    def min_memory(self) -> float:
        return float(sum(n.memory.min() for n in self.nodes))


def build_problem(graph: OpGraph, mesh_shape: Sequence[int], cost: AlphaBeta | None = None) -> Problem:
    """Nodes, follow groups and edge matrices of `graph` on a mesh of `mesh_shape` (see module doc)."""
    pb = _ProblemBuilder(graph, tuple(mesh_shape), cost or AlphaBeta())
    pb.add_inputs()
    for op in graph.operators:
        if op.is_dot:
            pb.add_dot(op)
        else:
            pb.add_follower(op)
    pb.count_outputs()
    return Problem(pb.nodes, pb.edges(), pb.shape, pb.node_of_dot)


class _ProblemBuilder:
    """The phases of `build_problem`: input nodes, dot nodes, followers joining their largest operand's node,
    step outputs' memory, then the edge matrices of every layout a consumer needs from another node."""

    def __init__(self, graph: OpGraph, shape: tuple[int, ...], cm: AlphaBeta):
        self.graph, self.shape, self.cm = graph, shape, cm
        self.nodes: list[Node] = []
        self.owner: dict[int, int] = {}          # tensor id -> node producing it (absent: fixed, replicated)
        self.node_of_dot: dict[int, int] = {}
        self.needs: dict[tuple[int, int], set] = {}   # (tensor, consumer node) -> per-strategy requirements

    def need(self, t: int | None, g: int, per_k: Sequence[DimAxes]) -> None:
        if t is not None:
            self.needs.setdefault((t, g), set()).add(tuple(per_k))

    def add_inputs(self) -> None:
        graph, shape = self.graph, self.shape
        for pos, t in enumerate(graph.inputs):
            ts = graph.tensor(t)
            specs = candidate_specs(ts.shape, shape)
            label = graph.input_paths[pos] if pos < len(graph.input_paths) else f"input{pos}"
            self.nodes.append(Node("input", label, [{t: s} for s in specs], np.zeros(len(specs)),
                                   np.array([ts.nbytes / shards(s, shape) for s in specs], float)))
            self.owner[t] = len(self.nodes) - 1

    def add_dot(self, op) -> None:
        graph, shape, cm = self.graph, self.shape, self.cm
        loops = loops_of(op, graph)
        strats = enumerate_strategies(loops, shape)
        out = op.outputs[0]
        ranks = [len(graph.tensor(t).shape) for t in (op.inputs[0], op.inputs[1], out)]
        flops = 2 * math.prod(l.size for l in loops)
        specs, costs, mem = [], [], []
        for s in strats:
            o = s.dim_axes(loops, "out", ranks[2])
            obytes = graph.tensor(out).nbytes / shards(o, shape)
            used = math.prod(shape[a] for a, l in enumerate(s.loop_of_axis) if l is not None)
            costs.append(cm.all_reduce(obytes, s.allreduce_axes(loops), shape) + flops / used / cm.flops)
            specs.append({out: o})
            mem.append(obytes)
        self.nodes.append(Node("dot", f"{op.index} {op.primitive}", specs, np.array(costs), np.array(mem),
                               strats, op.index))
        g = self.node_of_dot[op.index] = self.owner[out] = len(self.nodes) - 1
        for pos, side in ((0, "lhs"), (1, "rhs")):
            self.need(op.inputs[pos], g, [s.dim_axes(loops, side, ranks[pos]) for s in strats])

    def add_follower(self, op) -> None:
        """A non-dot joins the node of its largest linked operand (Alpa's follow rule), or runs replicated."""
        graph = self.graph
        lk = dimflow.links(op, graph)
        outs = [t for t in op.outputs if t is not None]
        linked_ins = {a for (a, _, b, _) in lk if b in outs}
        prim = max(linked_ins, key=lambda t: (graph.tensor(t).nbytes, -op.inputs.index(t)), default=None)
        g = self.owner.get(prim) if prim is not None else None
        if g is None:
            # no dim links, or it only reads constants: runs replicated, needs replicated operands
            for t in op.inputs:
                if t is not None and t in self.owner:
                    self.need(t, -1, [tuple(() for _ in graph.tensor(t).shape)])
            return
        req: dict[int, list[DimAxes]] = {t: [] for t in op.inputs if t is not None and t != prim}
        red = dimflow.reduced_dims(op, graph)
        for k in range(self.nodes[g].k):
            self._follow(lk, red, outs, prim, self.nodes[g], k, req)
        for t, per_k in req.items():
            self.need(t, g, per_k)
        for t in outs:
            self.owner[t] = g

    def _follow(self, lk, red, outs, prim: int, node: Node, k: int, req: dict) -> None:
        """Strategy `k` of `node` carried through a follower (dim links `lk`, reduced dims `red`): its output layouts, the all-reduce of
        reduced sharded dims, the gathering of sharded dims it drops, and the layouts its other operands need."""
        graph, shape, cm = self.graph, self.shape, self.cm
        src = node.specs[k][prim]
        out_specs = {}
        carried = set()
        for out in outs:       # a split has several outputs, each carrying the uncut dims
            o: list[tuple[int, ...]] = [() for _ in graph.tensor(out).shape]
            for (a, da, b, db) in lk:
                if a == prim and b == out and src[da] and not o[db]:
                    if not set(src[da]) & {x for d in o for x in d}:
                        o[db] = src[da]
                        carried.add(da)
            out_specs[out] = tuple(o)
        reduced = set(red[1]) if red else set()
        ar = tuple(sorted(a for d in reduced if d < len(src) for a in src[d]))
        dropped = tuple(tuple(src[d]) if (d not in carried and d not in reduced) else ()
                        for d in range(len(src)))
        obytes = graph.tensor(outs[0]).nbytes / shards(out_specs[outs[0]], shape)
        node.cost[k] += cm.all_reduce(obytes, ar, shape)
        if any(dropped):
            kept = tuple(tuple(x for x in src[d] if x not in dropped[d]) for d in range(len(src)))
            node.cost[k] += cm.reshard(src, kept, graph.tensor(prim).nbytes, shape)
        node.specs[k].update(out_specs)
        o_t = out_specs[outs[0]]
        for t in req:
            r = [()] * len(graph.tensor(t).shape)
            for (a, da, b, db) in lk:
                if a == t and b == outs[0] and o_t[db] and graph.tensor(t).shape[da] == graph.tensor(b).shape[db]:
                    r[da] = o_t[db]
            req[t].append(tuple(r))

    def count_outputs(self) -> None:
        """The step's outputs (new parameters and optimizer state) live beside its inputs: count them too."""
        nodes = self.nodes
        for t in set(self.graph.outputs):
            h = self.owner.get(t) if t is not None else None
            if h is not None:
                nb = self.graph.tensor(t).nbytes
                nodes[h].memory = nodes[h].memory + [nb / shards(nodes[h].specs[k][t], self.shape)
                                                     for k in range(nodes[h].k)]

    def edges(self) -> dict[tuple[int, int], np.ndarray]:
        nodes, cm, shape = self.nodes, self.cm, self.shape
        edges: dict[tuple[int, int], np.ndarray] = {}
        for (t, g), reqs in self.needs.items():
            h = self.owner.get(t)
            if h is None:
                continue                     # a constant: replicated, slicing it is free
            nbytes = self.graph.tensor(t).nbytes
            src = [nodes[h].specs[j][t] for j in range(nodes[h].k)]
            for per_k in reqs:
                if g == -1:                  # a replicated consumer: cost depends on the producer only
                    nodes[h].cost += [cm.reshard(s, per_k[0], nbytes, shape) for s in src]
                elif g == h:
                    nodes[h].cost += [cm.reshard(src[k], per_k[k], nbytes, shape) for k in range(nodes[h].k)]
                else:
                    m = np.array([[cm.reshard(s, r, nbytes, shape) for r in per_k] for s in src])
                    key, m = ((h, g), m) if h < g else ((g, h), m.T)
                    edges[key] = edges.get(key, 0) + m
        return edges


@dataclasses.dataclass(frozen=True)
class IlpResult:
    """The ILP's solution: a strategy per node, the per-block `choice` for `apply_choice`, and its estimates."""

    node_choice: tuple[int, ...]
    choice: tuple[int, ...]
    cost: float                 # ILP objective (seconds, per-operator decisions)
    cost_of_choice: float       # the same cost model with backward dots following their forward dot
    memory: float               # modelled bytes per device (inputs + outputs + dot outputs)
    disagreements: int          # backward dots whose ILP strategy differs from the block's re-indexed one
    optimal: bool
    solve_time: float
    num_variables: int
    input_specs: tuple[DimAxes, ...] = ()     # the ILP's layout of every flat input of the step
    output_specs: tuple[DimAxes, ...] = ()    # and of every flat output (None outputs: replicated)


def solve(problem: Problem, memory_budget: float | None = None, time_limit: float = 60.0) -> tuple[tuple[int, ...], float, bool, int]:
    """Solve the ILP with HiGHS: (node choice, objective, proven optimal, number of variables)."""
    import highspy

    if memory_budget is not None and problem.min_memory() > memory_budget:
        raise InfeasibleError(f"no layout fits {memory_budget / 2**20:.2f} MiB per device; the smallest budget "
                              f"that fits is {problem.min_memory() / 2**20:.2f} MiB")
    base: list[int] = []
    col = 0
    cost: list[float] = []
    for n in problem.nodes:
        base.append(col)
        cost.extend(n.cost.tolist())
        col += n.k
    nx = col
    rows: list[tuple[list[int], list[float], float, float]] = []
    for i, n in enumerate(problem.nodes):
        rows.append((list(range(base[i], base[i] + n.k)), [1.0] * n.k, 1.0, 1.0))
    for (u, v), m in problem.edges.items():
        ku, kv = m.shape
        if not m.any():
            continue
        e0 = col
        cost.extend(m.reshape(-1).tolist())
        col += ku * kv
        for i in range(ku):   # sum_j e_ij = x_u,i
            rows.append(([e0 + i * kv + j for j in range(kv)] + [base[u] + i], [1.0] * kv + [-1.0], 0.0, 0.0))
        for j in range(kv):   # sum_i e_ij = x_v,j
            rows.append(([e0 + i * kv + j for i in range(ku)] + [base[v] + j], [1.0] * ku + [-1.0], 0.0, 0.0))
    if memory_budget is not None:
        mem = [x for n in problem.nodes for x in n.memory.tolist()]
        rows.append((list(range(nx)), mem, -highspy.kHighsInf, float(memory_budget)))

    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit))
    h.setOptionValue("mip_rel_gap", 0.0)   # exact optimum (the default 1e-4 gap stops early)
    h.setOptionValue("mip_abs_gap", 1e-9)
    h.addVars(col, np.zeros(col), np.ones(col))
    # objective in microseconds: costs in seconds sit below HiGHS's tolerances
    h.changeColsCost(col, np.arange(col, dtype=np.int32), np.array(cost, dtype=float) * 1e6)
    h.changeColsIntegrality(nx, np.arange(nx, dtype=np.int32),
                            np.full(nx, highspy.HighsVarType.kInteger, dtype=np.uint8))
    starts, idx, val, lo, hi = [], [], [], [], []
    for cols, vals, l, u in rows:
        starts.append(len(idx))
        idx.extend(cols)
        val.extend(vals)
        lo.append(l)
        hi.append(u)
    h.addRows(len(rows), np.array(lo), np.array(hi), len(idx), np.array(starts, dtype=np.int32),
              np.array(idx, dtype=np.int32), np.array(val, dtype=float))
    h.run()
    status = h.getModelStatus()
    sol = np.array(h.getSolution().col_value)
    if status == highspy.HighsModelStatus.kInfeasible:
        raise InfeasibleError(f"no layout fits {memory_budget} bytes per device")
    if sol.size < nx:
        raise InfeasibleError(f"HiGHS found no solution within {time_limit} s (status {h.modelStatusToString(status)})")
    node_choice = tuple(int(np.argmax(sol[base[i]:base[i] + n.k])) for i, n in enumerate(problem.nodes))
    return node_choice, problem.cost(node_choice), status == highspy.HighsModelStatus.kOptimal, col



def ilp_choice(analysis: Analysis, memory_budget: float | None = None, cost: AlphaBeta | None = None,
             time_limit: float = 60.0) -> IlpResult:
    """Alpa-style ILP solution of `analysis`'s program, mapped to one strategy per ParallelBlock."""
    t0 = time.perf_counter()
    problem = build_problem(analysis.graph, analysis.mesh.shape, cost)
    node_choice, obj, optimal, nvars = solve(problem, memory_budget, time_limit)
    choice, applied, disagree = [], list(node_choice), 0
    for b in analysis.blocks:
        ni = problem.node_of_dot[b.forward.op]
        node = problem.nodes[ni]
        if tuple(node.strategies) != tuple(b.strategies):
            raise ConfigError(f"block {b.index}: ILP and analysis enumerate different strategies")
        k = node_choice[ni]
        choice.append(k)
        for bd in b.dots[1:]:
            bn = problem.nodes[problem.node_of_dot[bd.op]]
            want = bd.strategy(b.strategies[k])
            j = bn.strategies.index(want) if want in bn.strategies else None
            if j != node_choice[problem.node_of_dot[bd.op]]:
                disagree += 1
            if j is not None:
                applied[problem.node_of_dot[bd.op]] = j
    g = analysis.graph
    owner = {t: i for i, n in enumerate(problem.nodes) for t in n.specs[0]}

    def spec(t):
        if t is None or t not in owner:
            return () if t is None else tuple(() for _ in g.tensor(t).shape)
        return problem.nodes[owner[t]].specs[node_choice[owner[t]]][t]
    return IlpResult(node_choice=node_choice, choice=tuple(choice), cost=obj, cost_of_choice=problem.cost(applied),
                     memory=problem.memory(node_choice), disagreements=disagree, optimal=optimal,
                     solve_time=time.perf_counter() - t0, num_variables=nvars,
                     input_specs=tuple(spec(t) for t in g.inputs), output_specs=tuple(spec(t) for t in g.outputs))


def ilp_step(program, analysis: Analysis, result: IlpResult, mesh=None):
    """The sharded step of an ILP solution: blocks as `apply_choice(result.choice)`, but the step's inputs and
    outputs (parameters, optimizer state, batch) in the ILP's own layouts, so its memory decisions hold;
    XLA reshards them where a block wants another layout (as FSDP gathers a sharded weight)."""
    names = analysis.mesh.axis_names
    shardings = dataclasses.replace(resolve(analysis, result.choice),
                                    input_specs=tuple(partition_spec(s, names) for s in result.input_specs),
                                    output_specs=tuple(partition_spec(s, names) for s in result.output_specs))
    return ShardedStep(program, analysis, shardings, mesh if mesh is not None else analysis.mesh.make())
