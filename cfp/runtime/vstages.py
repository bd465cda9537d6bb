"""The execution layout of a schedule with virtual stages (interleaved 1F1B, ZB-V).

A pipeline of ``p`` stages run with ``v`` virtual stages per stage runs as ``v * p`` *expanded* stages: expanded
stage ``c`` is virtual stage ``c`` of the schedule, holding the layers `vstage_layers` cuts for it, on the devices
(and <CP,TP> grid) of stage ``placement[c]``. The engine builds one stage program per expanded stage, so the
dispatcher, gradient sync by layer pieces, optimizer and loss work per expanded stage key unchanged; what shares a
stage's devices (its clock, its kept activations) is grouped back by `VirtualStages.stage_of`. A virtual stage may
hold no layers (a middle one passes its input on; a last one is the head and loss only). With ``v = 1`` the
execution layout is the layout itself.
"""
from __future__ import annotations

from dataclasses import dataclass

from cfp.errors import ConfigError
from cfp.layout import Layout, Pipeline, Stage
from cfp.schedules.actions import vstage_layers
from cfp.schedules.registry import ScheduleSpec


@dataclass(frozen=True)
class VirtualStages:
    """``layout`` (the user's, in stages) run with pipeline q under ``specs[q]``: ``run`` its execution layout,
    ``placements[q][c]`` the stage of pipeline q's expanded stage c."""
    layout: Layout
    specs: tuple[ScheduleSpec, ...]
    run: Layout
    placements: tuple[tuple[int, ...], ...]

    def stage_of(self, key: tuple[int, int]) -> tuple[int, int]:
        """The (pipeline, stage) of the layout whose devices run expanded stage ``key``."""
        return (key[0], self.placements[key[0]][key[1]])


def expand(layout: Layout, specs: "ScheduleSpec | tuple[ScheduleSpec, ...]") -> VirtualStages:
    """The execution layout of ``layout`` with pipeline q under ``specs[q]`` (one spec: every pipeline's; the layout
    itself when no pipeline has virtual stages)."""
    specs = per_pipeline(specs, len(layout.pipelines))
    placements = tuple(spec.entry.placement.stages(p.num_stages, spec.v) for p, spec in zip(layout.pipelines, specs))
    if all(spec.v == 1 for spec in specs):
        return VirtualStages(layout, specs, layout, placements)
    pipes = []
    for pipe, placement in zip(layout.pipelines, placements):
        if len(placement) == pipe.num_stages:
            pipes.append(pipe)
            continue
        layers = vstage_layers([s.layers for s in pipe.stages], placement)
        stages = tuple(Stage(pipe.stages[d].devices, n, pipe.stages[d].machine, pipe.stages[d].cp)
                       for d, n in zip(placement, layers))
        pipes.append(Pipeline(stages, pipe.batch, pipe.chunks))
    # unchecked: expanded stages share their stage's devices and may hold no layers, which a user's layout may not
    return VirtualStages(layout, specs, Layout.unchecked(tuple(pipes)), placements)


def per_pipeline(specs: "ScheduleSpec | tuple[ScheduleSpec, ...]", n: int) -> tuple[ScheduleSpec, ...]:
    """One schedule per pipeline: ``specs`` itself (one per pipeline), or one spec for every pipeline."""
    if isinstance(specs, (list, tuple)):
        if len(specs) != n:
            raise ConfigError(f"{len(specs)} schedules ({', '.join(map(str, specs))}) for {n} pipelines: give one "
                              "per pipeline, or one for all")
        return tuple(ScheduleSpec.parse(s) for s in specs)
    return (ScheduleSpec.parse(specs),) * n
