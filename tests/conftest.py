"""Every test runs on 8 simulated CPU devices; the flag must be set before JAX is imported."""
import os

# Backend optimisation level 0 halves XLA:CPU compile time, which dominates this suite on 2 cores;
# tests compare numbers, never speed. Users run XLA's default level: tests/test_default_opt_level.py reruns a
# representative set of the numeric equivalence tests in a subprocess with CFP_TEST_XLA_DEFAULT_OPT=1, which
# leaves the level at XLA's default (the flag is read once, when JAX starts).
DEFAULT_OPT_ENV = "CFP_TEST_XLA_DEFAULT_OPT"
O0_FLAG = "--xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    + ("" if os.environ.get(DEFAULT_OPT_ENV) == "1" else " " + O0_FLAG)
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# a fresh profile cache per test process (pytest workers included): no test reads another run's entries
import tempfile  # noqa: E402
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="cfp-test-cache-")
# plans price the cpu devices by the catalog's entry (measuring the host, `cfp.hardware.host_entry`, takes ~40 s
# and at level 0 would measure other programs); tests/test_host_entry.py turns it on with its own cache dir
os.environ.setdefault("CFP_CALIBRATE", "0")


# ---- shared problems of the API/plan/search tests (tiny, so every test using them stays within seconds) ----
import pytest  # noqa: E402


def _mlp_loss(p, x, y):
    import jax.numpy as jnp
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] - y) ** 2)


def mlp_grad_step(p, x, y):
    """(loss, grads) of a 2-layer MLP: the smallest step with several ParallelBlocks."""
    import jax
    return jax.value_and_grad(_mlp_loss)(p, x, y)


@pytest.fixture(scope="session")
def mlp_problem():
    """(step_fn, example_args) of `mlp_grad_step`: params {w1 [32,64], b1 [64], w2 [64,32]}, x and y [16,32]."""
    import jax
    import jax.numpy as jnp
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    p = {"w1": jax.random.normal(k[0], (32, 64)) * 0.1, "b1": jnp.zeros((64,)),
         "w2": jax.random.normal(k[1], (64, 32)) * 0.1}
    return mlp_grad_step, (p, jax.random.normal(k[2], (16, 32)), jax.random.normal(k[3], (16, 32)))


@pytest.fixture(scope="session")
def gpt_train_problem():
    """A 1-layer tiny GPT's optax AdamW train step: (train_step bundle, params, opt_state, batch of 8)."""
    import jax
    from cfp.models import get_config, train_step
    ts = train_step("gpt", get_config("gpt", "tiny", num_layers=1))
    params, opt = jax.jit(ts.init)(jax.random.PRNGKey(0))
    return ts, params, opt, ts.make_batch(8, jax.random.PRNGKey(1))


def assert_same_tree(got, want):
    """Tree structures first: a leaf-by-leaf `zip` would silently stop at the shorter tree."""
    import jax
    gs, ws = jax.tree_util.tree_structure(got), jax.tree_util.tree_structure(want)
    assert gs == ws, f"tree structures differ: {gs} vs {ws}"


def assert_adam_step_matches(params0, got, want, lr: float = 1e-3):
    """One optax AdamW step `(new_params, opt_state, loss)` against the single-device `want`, like with like.

    Gradients before the optimizer: Adam's first moment after one step is (1 - b1) * grad, compared with a
    tolerance relative to each leaf's scale. Parameter updates: Adam's first update is about -lr * sign(grad),
    so where a gradient is within float32 noise (measured here as the largest first-moment difference between
    the two runs) the sign may flip and the updates may differ by up to 2 lr; everywhere else (required to be
    most elements, so the check is never vacuous) they must agree to 1% of lr. A skipped update fails.
    """
    import jax
    import numpy as np
    assert_same_tree(got, want)
    np.testing.assert_allclose(float(got[2]), float(want[2]), rtol=1e-5)
    leaves = jax.tree_util.tree_leaves
    # one scale for the whole gradient: a leaf whose gradient is mathematically zero (an attention key bias)
    # holds only float noise, and its own maximum says nothing about the precision to expect
    scale = max(float(np.abs(np.asarray(m)).max()) for m in leaves(want[1][0].mu))
    decisive = total = 0
    for p0, new, ref, m, m_ref in zip(leaves(params0), leaves(got[0]), leaves(want[0]),
                                      leaves(got[1][0].mu), leaves(want[1][0].mu)):
        p0, new, ref, m, m_ref = (np.asarray(x, np.float64) for x in (p0, new, ref, m, m_ref))
        np.testing.assert_allclose(m, m_ref, rtol=1e-3, atol=1e-5 * scale)
        noise = float(np.abs(m - m_ref).max())
        sure = np.abs(m_ref) > 10 * noise + 1e-6 * scale
        diff = np.abs((new - p0) - (ref - p0))
        eps32 = np.finfo(np.float32).eps
        assert (diff[sure] <= 1e-2 * lr + 4 * eps32 * np.abs(p0[sure])).all(), \
            f"update differs by {diff[sure].max():.3g} where the gradient is well above noise {noise:.3g}"
        assert (diff <= 2.02 * lr + 4 * eps32 * np.abs(p0)).all(), f"update differs by {diff.max():.3g} > 2 lr"
        decisive, total = decisive + int(sure.sum()), total + sure.size
    assert decisive >= 0.5 * total, f"only {decisive} of {total} gradients are above float noise: check is vacuous"
# ---- end of the API/plan/search block ----


# ---- optional per-test CPU-time log (CFP_TEST_CPU_LOG=FILE): where the suite's time goes, read on a loaded host
# too, since CPU seconds (this process and its finished children) do not grow with other processes' load
CPU_LOG_ENV = "CFP_TEST_CPU_LOG"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = os.environ.get(CPU_LOG_ENV)
    if not path:
        yield
        return
    import resource
    import time

    def cpu():
        own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

    c0, w0 = cpu(), time.perf_counter()
    yield
    with open(path, "a") as f:
        f.write(f"{cpu() - c0:.2f}\t{time.perf_counter() - w0:.2f}\t{item.nodeid}\n")


# ---- property tests (hypothesis): deterministic and bounded, so CI runs the same examples every time ----
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile("cfp", derandomize=True, database=None, max_examples=60, deadline=None,
                          print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("cfp")


# ---- the slow tier: `make test` leaves these out, `make test-slow` (run by `bash .ci/run` after it) runs them.
# Each took 20+ s of CPU (CFP_TEST_CPU_LOG on the suite), and what it checks has a cheaper check in `make test`
# (the runtime against one device on one layout, the examples' factories, the data path's packed rows); the
# mutation check (benchmarks/mutants.py) runs the tests it names in either tier. Ids: file::test, optionally [param].
SLOW = (
    "test_user_programs.py::test_explicit_and_auto_meshes_give_the_same_plan",
    "test_user_programs.py::test_example_trains_like_the_unsharded_step_and_chains",
    "test_data_train.py::",
    "test_default_opt_level.py::",
    "test_own_model_examples.py::",
    "test_runtime.py::test_matches_single_device_gpipe_and_1f1b[2-1-1+4]",
    "test_runtime.py::test_matches_single_device_gpipe_and_1f1b[4+2+1+1]",
    "test_runtime.py::test_resume_reproduces_losses_also_on_another_layout",
    "test_runtime.py::test_gradient_is_token_weighted",
    "test_autoshard.py::test_budget_below_data_parallel_shards_state",
    "test_stage_plans.py::test_stage_plans_give_the_single_device_gradient",
    "test_stage_plans.py::test_search_then_training_builds_each_stage_program_once",
    "test_stage_plans.py::test_search_times_megatron_side_by_side",
    "test_cost_facts.py::test_same_definition_figures_agree_with_model_cost",
    "test_data_switch.py::test_heterogeneous_mix_step_equals_sequence_reference",
    "test_profiling.py::test_cache_never_mixes_models",
    "test_user_pipelines.py::test_stop_and_resume_onto_another_layout",
    "test_train_cli.py::test_keep_checkpoints_prunes_through_training_and_resume_continues",
    "test_remat.py::test_search_on_a_remat_model_trains_like_the_unsharded_step",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        nodeid = item.nodeid.split("/")[-1]
        if any(nodeid == s or (nodeid.startswith(s) and (s.endswith("::") or nodeid[len(s)] == "["))
               for s in SLOW):
            item.add_marker(pytest.mark.slow)
