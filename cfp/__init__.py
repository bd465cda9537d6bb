"""cfp: automatic intra-operator parallelism (CFP) and heterogeneous 3D parallelism for JAX training.

The public API, re-exported here from the passes that own each name (one argument order everywhere:
`(step_fn, mesh, *example_args)`):

    import cfp
    analysis = cfp.analyze(step_fn, "2x4", params, opt_state, batch)
    sharded = cfp.autoshard(step_fn, "2x4", params, opt_state, batch, profiler="estimate", gpu="A100-SXM-80G")
    sharded.plan.save("plan.json")
    again = cfp.apply_plan(step_fn, "2x4", params, opt_state, batch, plan="plan.json")
"""
from cfp.analysis.analysis import Analysis, analyze
from cfp.api import apply_plan, autoshard
from cfp.errors import CaptureError, CfpError, ConfigError, InfeasibleError, PlanError
from cfp.layered.frontends import from_equinox, from_linen, from_nnx
from cfp.layered.model import LayeredModel
from cfp.layout import Layout
from cfp.mesh import MeshSpec
from cfp.planner.cluster import Cluster, parse_cluster
from cfp.planner.model_facts import plan_layout
from cfp.planner.options import PlannerOptions
from cfp.planner.planner import PlannerResult, find_layout
from cfp.profiling.options import ProfileOptions
from cfp.profiling.table import ProfileTable
from cfp.runtime.feed import Share, process_share
from cfp.runtime.training import RunOptions, TrainOptions, TrainResult, run_training, train_pipelines
from cfp.search.options import SearchOptions
from cfp.search.plan import Plan, load_plan
from cfp.search.search import SearchResult
from cfp.sharding.check import check_collectives
from cfp.sharding.specs import StepShardings
from cfp.sharding.step import ShardedStep
from cfp.version import __version__


__all__ = [
    # intra-operator parallelism (CFP): analyse, search, apply, save and reload plans
    "analyze", "autoshard", "apply_plan", "load_plan", "Plan", "MeshSpec", "ShardedStep", "StepShardings",
    "Analysis", "SearchResult", "ProfileTable", "check_collectives", "SearchOptions", "ProfileOptions",
    # heterogeneous clusters: planner and training runtime
    "LayeredModel", "from_linen", "from_nnx", "from_equinox", "train_pipelines", "RunOptions",
    "Cluster", "parse_cluster", "PlannerOptions", "PlannerResult", "find_layout", "plan_layout", "Layout",
    "TrainOptions", "TrainResult", "run_training", "process_share", "Share",
    # errors
    "CfpError", "ConfigError", "PlanError", "CaptureError", "InfeasibleError",
]
