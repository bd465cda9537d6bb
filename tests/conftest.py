"""Every test runs on 8 simulated CPU devices; the flag must be set before JAX is imported."""
import os

# Backend optimisation level 0 halves XLA:CPU compile time, which dominates this suite on 2 cores;
# tests compare numbers, never speed.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
