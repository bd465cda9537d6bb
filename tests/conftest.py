"""Every test runs on 8 simulated CPU devices; the flag must be set before JAX is imported."""
import os

# Backend optimisation level 0 halves XLA:CPU compile time, which dominates this suite on 2 cores;
# tests compare numbers, never speed.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


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
# ---- end of the API/plan/search block ----
