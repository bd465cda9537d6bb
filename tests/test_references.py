"""Checks against references written here, independent of the code they check: the search's plan against a
brute force over the profiled candidates with the resharding between segments, resharding prices against the
collectives XLA compiles, strategy enumeration against divisibility, the `--verify` reference's AdamW against
its formula, and `cfp data train`'s draw against its token budget."""
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest


# ----------------------------------------------------------------------------- search: resharding decides
def _chain_loss(p, x, y):
    h = x
    for w in p:
        h = jnp.tanh(h @ w)
    return jnp.mean((h - y) ** 2)


def _chain_step(p, x, y):
    return jax.value_and_grad(_chain_loss)(p, x, y)


@pytest.fixture(scope="module")
def chain():
    """Three 32x32 tanh layers on an 8-device mesh: three segments, three strategies each."""
    from cfp.analysis.analysis import analyze_with_program
    from cfp.profiling.options import ProfileOptions
    from cfp.profiling.profiler import profile
    k = jax.random.split(jax.random.PRNGKey(0), 5)
    args = ([jax.random.normal(k[i], (32, 32)) * 0.1 for i in range(3)],
            jax.random.normal(k[3], (16, 32)), jax.random.normal(k[4], (16, 32)))
    analysis, program = analyze_with_program(_chain_step, "8", *args)
    table = profile(program, analysis, ProfileOptions(kind="estimate", gpu="A100-PCIe-40G", max_combinations=8,
                                                      overlap_compile=False, progress=False), log=lambda *_: None)
    return analysis, program, table, args


def test_search_pays_resharding_between_segments(chain):
    """The search's plan (no whole-step verification: the DP's best) against every combination of the profiled
    candidates, priced here as the sum of segment times plus the resharding between consecutive segments.
    The case is one where the resharding decides: the fastest combination by segment times alone reshards and
    is not the optimum, so a DP that leaves the resharding out picks it and fails."""
    from cfp.hardware.gpus import get_gpu
    from cfp.profiling import gpu_estimate
    from cfp.search.options import SearchOptions
    from cfp.search.search import search
    analysis, program, table, args = chain
    segs = analysis.segments
    assert len(segs) == 3
    link = get_gpu("A100-PCIe-40G").link_gbps * 1e9
    priced = []
    for combo in itertools.product(*(table.segments[s.kind].entries for s in segs)):
        compute = sum(e.time for e in combo)
        specs = [analysis.segment_specs(s, e.choice) for s, e in zip(segs, combo)]
        moves = sum(gpu_estimate.reshard_cost(analysis, a, b, link) for a, b in zip(specs, specs[1:]))
        priced.append((compute + moves, compute, sum((e.choice for e in combo), ())))
    best = min(priced)
    by_compute = min(priced, key=lambda c: c[1])
    assert by_compute[2] != best[2] and by_compute[0] > best[0] * (1 + 1e-6)   # the resharding decides
    got = search(program, analysis, table, args, SearchOptions(verify=0, top_k=3), log=lambda *_: None)
    assert tuple(got.choice) == best[2]
    assert got.best.dp_time == pytest.approx(best[0], rel=1e-9)


# ----------------------------------------------------------------------------- resharding prices vs XLA
@pytest.mark.parametrize("src, dst", [
    (((0, 1), ()), ((0,), ())),      # gather axis 1 (4 devices) of a dim sharded over both axes
    (((0,), (1,)), ((0,), ())),      # gather axis 1 of the second dim
    (((1,), ()), ((), ())),          # gather a 4-way dim whole
])
def test_reshard_all_gather_price_matches_compiled(src, dst):
    """`reshard_steps` prices a gather by the per-device bytes of its gathered output and its group size; XLA's
    compiled program for the same move on a 2x4 mesh has exactly that all-gather."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    from cfp.sharding.reshard import reshard_steps
    from cfp.xla.hlo import parse_collectives
    mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    names = mesh.axis_names
    spec = lambda s: P(*[tuple(names[a] for a in axes) or None for axes in s])
    x = jax.ShapeDtypeStruct((16, 16), jnp.float32, sharding=NamedSharding(mesh, spec(src)))
    f = jax.jit(lambda v: v, out_shardings=NamedSharding(mesh, spec(dst)))
    compiled = [(c.kind, c.bytes) for c in parse_collectives(f.lower(x).compile().as_text(), (2, 4))]
    steps = reshard_steps(src, dst, (16, 16), (2, 4), 16 * 16 * 4)
    assert [(k, int(b)) for k, b, _ in steps] == compiled, (steps, compiled)
    gathered = [n for k, _, n in steps if k == "all-gather"]
    assert gathered and all(n == math.prod((2, 4)[a] for a in set(sum(src, ())) - set(sum(dst, ())))
                            for n in gathered)


# ----------------------------------------------------------------------------- analysis: strategies divide
@pytest.mark.parametrize("mesh", [(2, 4), (4, 2), (2, 2), (8,)])
@pytest.mark.parametrize("lhs, rhs", [((6, 8), (8, 12)), ((4, 6), (6, 10)), ((16, 8), (8, 24))])
def test_every_offered_strategy_divides_its_loops(mesh, lhs, rhs):
    """Each mesh axis a strategy assigns to a loop splits it; the axes on one loop must divide its size."""
    from cfp.analysis.strategies import dot_loops, enumerate_strategies
    from cfp.ir.graph import DotDims
    loops = dot_loops(lhs, rhs, DotDims((1,), (0,), (), ()))
    strategies = enumerate_strategies(loops, mesh)
    assert strategies
    for s in strategies:
        per_loop: dict[int, int] = {}
        for axis, li in enumerate(s.loop_of_axis):
            if li is not None:
                per_loop[li] = per_loop.get(li, 1) * mesh[axis]
        assert all(loops[li].size % n == 0 for li, n in per_loop.items()), (s, loops)


# ----------------------------------------------------------------------------- the --verify reference's AdamW
def test_verify_reference_optimizer_is_adamw_by_its_formula():
    """One step of the reference optimizer against AdamW written out (bias-corrected first step:
    m_hat = g, v_hat = g^2): p1 = p0 - lr * (g / (|g| + eps) + wd * p0)."""
    from cfp.runtime.verify import reference_optimizer
    lr, wd, eps = 1e-2, 0.3, 1e-8
    rng = np.random.default_rng(0)
    p0 = {"w": rng.normal(size=(4, 3)).astype(np.float32), "b": rng.normal(size=3).astype(np.float32)}
    g = {"w": rng.normal(size=(4, 3)).astype(np.float32), "b": rng.normal(size=3).astype(np.float32)}
    tx = reference_optimizer(lr, wd)
    updates, _ = tx.update(g, tx.init(p0), p0)
    for k in p0:
        want = -lr * (g[k] / (np.abs(g[k]) + eps) + wd * p0[k])
        np.testing.assert_allclose(np.asarray(updates[k]), want, rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------- cfp data train: the draw
def test_step_sequences_are_the_shortest_prefix_reaching_the_budget():
    """A step's sequences are a seeded shuffle cut at the first sequence whose tokens reach the budget: the
    drawn ones reach it and the same draw without its last sequence does not (all of them if the budget is
    above the total)."""
    from cfp.data.sources import Sequences
    from cfp.data.train import step_sequences
    rng = np.random.default_rng(1)
    lens = rng.integers(5, 60, size=40)
    data = Sequences(tuple(rng.integers(0, 256, n + 1).astype(np.uint8) for n in lens), "test")
    for step, budget in itertools.product(range(3), (1, 50, 333, int(lens.sum()), int(lens.sum()) + 10)):
        ids = step_sequences(data, step, 0, budget)
        assert len(set(ids.tolist())) == len(ids)
        got = int(data.lengths[ids].sum())
        if budget > lens.sum():
            assert len(ids) == len(lens)
        else:
            assert got >= budget > got - int(data.lengths[ids[-1]])
