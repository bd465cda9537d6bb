"""Alpa-style ILP: optimum equals brute force on small programs; memory budgets; mapping to a block choice."""
import jax
import jax.numpy as jnp
import pytest

from cfp.analysis.analysis import analyze_with_program
from cfp.sharding.step import apply_choice
from cfp.errors import InfeasibleError
from cfp.baselines.ilp import AlphaBeta, build_problem, candidate_specs, ilp_choice, solve
from references import ilp_brute_force


def _mlp_step(p, x, y):
    def loss(p):
        h = jax.nn.relu(x @ p["w1"])
        return jnp.mean((h @ p["w2"] - y) ** 2)
    g = jax.grad(loss)(p)
    return jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, p, g)


def _mlp3_step(p, x):
    def loss(p):
        h = jnp.tanh(x @ p["w1"])
        h = jnp.tanh(h @ p["w2"])
        return jnp.sum(h @ p["w3"])
    return jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, p, jax.grad(loss)(p))


def _mlp_args():
    return {"w1": jnp.ones((8, 16)), "w2": jnp.ones((16, 4))}, jnp.ones((8, 8)), jnp.ones((8, 4))


def test_candidate_specs():
    specs = candidate_specs((8, 6), (4,))
    assert specs[0] == ((), ()) and ((0,), ()) in specs and ((), (0,)) not in specs   # 6 % 4 != 0
    assert ((0, 1), ()) in candidate_specs((8, 6), (2, 4))


@pytest.mark.parametrize("mesh", ["2", "4"])
def test_ilp_equals_brute_force_mlp(mesh):
    a, _ = analyze_with_program(_mlp_step, mesh, *_mlp_args())
    problem = build_problem(a.graph, a.mesh.shape)
    node_choice, cost, optimal, _ = solve(problem)
    best, best_cost = ilp_brute_force(problem)
    assert optimal
    assert cost == pytest.approx(best_cost, rel=1e-9, abs=1e-15)


def test_ilp_equals_brute_force_slow_network_and_memory_budget():
    p = {"w1": jnp.ones((8, 8)), "w2": jnp.ones((8, 8)), "w3": jnp.ones((8, 4))}
    a, _ = analyze_with_program(_mlp3_step, "2", p, jnp.ones((4, 8)))
    # a slow network so the communication terms dominate and differ between plans
    problem = build_problem(a.graph, a.mesh.shape, AlphaBeta(bandwidth=1e6, latency=1e-6))
    assert 1e3 < __import__("math").prod(n.k for n in problem.nodes) < 5e6
    _, cost, _, _ = solve(problem)
    assert cost == pytest.approx(ilp_brute_force(problem)[1], rel=1e-9)
    budget = (problem.min_memory() + problem.memory([0] * len(problem.nodes))) / 2
    node_choice, cost_b, _, _ = solve(problem, memory_budget=budget)
    assert problem.memory(node_choice) <= budget
    assert cost_b == pytest.approx(ilp_brute_force(problem, memory_budget=budget)[1], rel=1e-9)


def test_infeasible_budget_names_smallest():
    a, _ = analyze_with_program(_mlp_step, "4", *_mlp_args())
    problem = build_problem(a.graph, a.mesh.shape)
    with pytest.raises(InfeasibleError, match="smallest budget"):
        ilp_choice(a, memory_budget=problem.min_memory() - 1)
    # exactly the smallest budget is feasible
    assert ilp_choice(a, memory_budget=problem.min_memory()).memory <= problem.min_memory()


def test_ilp_choice_applies_and_matches_unsharded():
    args = _mlp_args()
    a, program = analyze_with_program(_mlp_step, "4", *args)
    res = ilp_choice(a)
    assert len(res.choice) == len(a.blocks) and res.optimal
    assert res.cost_of_choice >= res.cost - 1e-15
    out = apply_choice(program, a, res.choice)(*args)
    ref = _mlp_step(*args)
    for k in ref:
        assert jnp.allclose(out[k], ref[k], atol=1e-5)


def test_ilp_step_keeps_ilp_input_layouts():
    from cfp.baselines.ilp import ilp_step
    args = _mlp_args()
    a, program = analyze_with_program(_mlp_step, "4", *args)
    res = ilp_choice(a)
    step = ilp_step(program, a, res)
    assert len(res.input_specs) == len(a.graph.inputs)
    out = step(*args)
    ref = _mlp_step(*args)
    for k in ref:
        assert jnp.allclose(out[k], ref[k], atol=1e-5)


def test_cost_model_for_a_gpu_reads_the_cost_floor():
    """A catalog GPU's ILP rates are the planner's: its link bandwidth and the achievable large-GEMM rate of
    the arithmetic its dots run in (TF32 for float32 on an H100, bf16 tensor cores for bfloat16), below the
    datasheet peak."""
    from cfp.hardware.gpus import Precision, get_gpu
    from cfp.planner.costmodel import achievable_flops, precision_of
    gpu = get_gpu("H100-SXM")
    for dtype, precision in (("float32", Precision.TF32), ("bfloat16", Precision.BF16)):
        cm = AlphaBeta.for_gpu(gpu, dtype)
        assert precision_of(dtype, gpu) == precision
        assert cm.flops == achievable_flops(gpu, precision) < gpu.peak(precision)
        assert cm.bw(0) == gpu.link_gbps * 1e9
    assert AlphaBeta.for_gpu(gpu, "bfloat16").flops > AlphaBeta.for_gpu(gpu, "float32").flops
