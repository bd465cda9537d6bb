"""Predicted against compiled communication: the collectives XLA inserted inside each block."""
from __future__ import annotations

from typing import Sequence

from cfp.analysis.analysis import Analysis
from cfp.sharding.specs import StepShardings
from cfp.xla.hlo import Collective


def check_collectives(analysis: Analysis, shardings: StepShardings, found: Sequence[Collective]) -> list[str]:
    """Differences between predicted and compiled in-block collectives (empty when they agree).

    Inside a block, all-reduces must be on predicted all-reduce axes and any other collective on predicted
    resharding axes; a block whose layout predicts no communication must compile without any collective.
    Resharding at block entries (`cfp_reshard<N>` scopes) is the search's business and not checked here.
    """
    problems = []
    for lay in shardings.layouts:
        reduce_axes = {a for c in lay.collectives if c.kind == "all-reduce" for a in c.axes}
        reshard_axes = {a for c in lay.collectives if c.kind == "reshard" for a in c.axes}
        for c in (c for c in found if c.block == lay.block and not c.reshard):
            # XLA may split an all-reduce into reduce-scatter + all-gather around elementwise work
            decomposable = c.kind in ("all-reduce", "reduce-scatter", "all-gather")
            allowed = (reduce_axes | reshard_axes) if decomposable else reshard_axes
            if not c.axes or not set(c.axes) <= allowed:
                problems.append(
                    f"block {lay.block} strategy {lay.strategy}: unexpected {c.kind} on axes {c.axes} "
                    f"({c.bytes} B, {c.op_name}); predicted all-reduce axes {sorted(reduce_axes)}, "
                    f"reshard axes {sorted(reshard_axes)}")
    return problems
