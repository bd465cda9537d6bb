"""cfp: automatic intra-operator parallelism (CFP) and heterogeneous 3D parallelism for JAX training.

    import cfp
    analysis = cfp.analyze(step_fn, params, opt_state, batch, mesh="2x4")
"""
from cfp.errors import CaptureError, CfpError, ConfigError, InfeasibleError
from cfp.mesh import MeshSpec

__version__ = "0.1.0"


def analyze(step_fn, *example_args, mesh):
    """Analysis pass: trace `step_fn(*example_args)` and return its frozen, JSON-serialisable `Analysis`."""
    from cfp.analysis.analysis import analyze as _analyze
    return _analyze(step_fn, *example_args, mesh=mesh)


def __getattr__(name):
    # autoshard/load_plan run every pass (cfp.api); imported lazily so `import cfp` stays light
    if name in ("autoshard", "load_plan"):
        import importlib
        return getattr(importlib.import_module("cfp.api"), name)
    raise AttributeError(f"module 'cfp' has no attribute {name!r}")


__all__ = ["analyze", "autoshard", "load_plan", "MeshSpec", "CfpError", "ConfigError", "CaptureError",
           "InfeasibleError"]
