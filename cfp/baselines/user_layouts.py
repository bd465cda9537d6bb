"""The layouts users write, for any analysed step: the plain candidates the search's whole-step verification
holds its plan to.

A user layout is only the step's input and output shardings (`jax.jit(step, in_shardings=..., out_shardings=...)`),
with nothing constrained inside the step: XLA propagates the rest. For every flat input the step returns updated
(its state: parameters and optimizer state, `cfp.ir.state`) and every other input (the batch):

* data parallel: state replicated; the batch split on its leading dim over every mesh axis;
* FSDP: as data parallel, plus every state leaf sharded over every mesh axis on its largest dim that the device
  count divides (the layout `cfp.baselines.handwritten`'s `fsdp` writes for zoo steps, found here from the
  program whatever the order of arguments);
* DP x TP (2-D meshes): the batch over axis 0, state by the Megatron rule table (`cfp.sharding.rules`) over
  axis 1, replicated where no rule names its dims or the axis does not divide.

State outputs leave with their input's sharding (the step chains in a loop); other outputs (a loss) replicated
unless cfp's data-parallel layout shards them. The Alpa-style ILP's plan (`ilp_shardings`) is a fourth candidate:
its blocks constrained by its choice, its inputs and outputs in the ILP's own layouts.
"""
from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any, Sequence

import jax
from jax.sharding import PartitionSpec

from cfp.analysis.analysis import Analysis
from cfp.analysis.blocks import data_parallel_choice
from cfp.errors import ConfigError
from cfp.ir.state import state_inputs, state_pairs
from cfp.sharding.rules import dim_spec, path_keys, tensor_spec
from cfp.sharding.specs import StepShardings, partition_spec, resolve


class Layout(str, enum.Enum):
    """A whole-step layout other than a searched choice: what a saved `Plan`'s `layout` names."""

    DATA_PARALLEL = "data-parallel"
    FSDP = "fsdp"
    DP_TP = "dp-tp"
    ALPA_ILP = "alpa-ilp"

    @property
    def label(self) -> str:
        return {"data-parallel": "plain data parallel", "fsdp": "plain FSDP", "dp-tp": "DP x TP (Megatron)",
                "alpa-ilp": "Alpa-style ILP"}[self.value]

    @property
    def constrained(self) -> bool:
        """Whether the step's blocks are constrained to the plan's choice (only the ILP's plan), or XLA is left
        to propagate the input and output shardings (the layouts users write)."""
        return self is Layout.ALPA_ILP


USER_LAYOUTS = (Layout.DATA_PARALLEL, Layout.FSDP, Layout.DP_TP)


def _axes(names: Sequence[str]):
    return names[0] if len(names) == 1 else tuple(names)


def _largest_dim(shape: tuple[int, ...], n: int) -> int | None:
    dims = sorted((d for d in range(len(shape)) if shape[d] % n == 0), key=lambda d: (-shape[d], d))
    return dims[0] if dims else None


def _param_keys(keys: tuple[str, ...]) -> tuple[str, ...]:
    """The keys under `params` where there are (an optimizer-state leaf mirrors its parameter), else all."""
    return keys[keys.index("params") + 1:] if "params" in keys else keys


def user_layout_shardings(layout: Layout | str, analysis: Analysis, example_args: Sequence[Any]) -> StepShardings:
    """The step's input and output specs under user layout `layout` (unconstrained inside); ConfigError where it
    does not apply (DP x TP on a mesh that is not 2-D)."""
    layout = Layout(layout)
    if layout not in USER_LAYOUTS:
        raise ConfigError(f"{layout.value} is not a user layout; valid: {', '.join(l.value for l in USER_LAYOUTS)}")
    g, mesh = analysis.graph, analysis.mesh
    names, sizes = tuple(mesh.axis_names), tuple(mesh.shape)
    if layout is Layout.DP_TP and len(names) != 2:
        raise ConfigError(f"dp-tp needs a 2-D mesh (DP over axis 0, TP over axis 1), got mesh shape {sizes}")
    leaves = jax.tree_util.tree_flatten_with_path(tuple(example_args))[0]
    if len(leaves) != len(g.inputs):
        raise ConfigError(f"the step has {len(g.inputs)} flat inputs, the example arguments {len(leaves)}")
    uniform = data_parallel_choice(g, analysis.blocks)
    dp = resolve(analysis, uniform)
    batch_axes, batch_n = ((names[0], sizes[0]) if layout is Layout.DP_TP else (_axes(names), math.prod(sizes)))
    state = set(state_inputs(g))
    specs = []
    for i, (path, _) in enumerate(leaves):
        shape = tuple(g.tensor(g.inputs[i]).shape)
        if i in state and shape:
            specs.append(_state_spec(layout, _param_keys(path_keys(path)[1:]), shape, names, sizes))
        elif shape and any(e is not None for e in dp.input_specs[i]) and shape[0] % batch_n == 0:
            specs.append(dim_spec(0, batch_axes))     # the batch, split on its leading dim
        else:
            specs.append(PartitionSpec())
    same = {o: specs[i] for i, o in state_pairs(g)}
    outputs = tuple(same.get(o, dp.output_specs[o]) for o in range(len(g.outputs)))
    return StepShardings(uniform, (), tuple(specs), outputs, (), constrained=False)


def _state_spec(layout: Layout, keys, shape, names, sizes) -> PartitionSpec:
    if layout is Layout.DATA_PARALLEL:
        return PartitionSpec()
    if layout is Layout.FSDP:
        return dim_spec(_largest_dim(shape, math.prod(sizes)), _axes(names))
    return tensor_spec(keys, shape, names[1], sizes[1], strict=False)


def ilp_shardings(analysis: Analysis, budget: int | None, cost=None, time_limit: float = 30.0) -> StepShardings:
    """The Alpa-style ILP's plan (`cfp.baselines.ilp`) as step shardings: blocks constrained by its choice,
    inputs and outputs in the ILP's own layouts (its memory decisions hold). Raises the ILP's errors."""
    from cfp.baselines.ilp import ilp_choice
    res = ilp_choice(analysis, memory_budget=budget, cost=cost, time_limit=time_limit)
    names = analysis.mesh.axis_names
    return dataclasses.replace(resolve(analysis, res.choice),
                               input_specs=tuple(partition_spec(s, names) for s in res.input_specs),
                               output_specs=tuple(partition_spec(s, names) for s in res.output_specs))
