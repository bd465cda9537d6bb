"""Local refinement guided by the cost model: move a layer between stages, a micro-batch between
pipelines, reverse a pipeline's stage order or move a stage's devices (a TP group) to another pipeline,
while the estimate improves.

First improvement in a fixed move order, so the result is deterministic; `budget` bounds the number
of estimates."""
from __future__ import annotations

from typing import Iterator

from cfp.planner.build import split_layers
from cfp.planner.costmodel import ClusterLayout, CostModel, Estimate, PipelineLayout, StageLayout


def _replace(layout: ClusterLayout, p: int, pipe: PipelineLayout) -> ClusterLayout:
    pipes = list(layout.pipelines)
    pipes[p] = pipe
    return ClusterLayout(tuple(pipes))


def _layer_moves(layout: ClusterLayout, est: Estimate) -> Iterator[ClusterLayout]:
    """One layer from a stage to another in each pipeline (slowest pipeline and stage first)."""
    order = sorted(range(len(layout.pipelines)), key=lambda p: -est.pipeline_time[p])
    for p in order:
        pipe, times = layout.pipelines[p], est.stages[p]
        slowest = max(range(len(pipe.stages)), key=lambda i: (times[i].fwd + times[i].bwd, -i))
        # the stage whose optimizer update takes longest (parameters over memory bandwidth)
        heaviest = max(range(len(pipe.stages)), key=lambda i: (times[i].update, -i))
        # then from every other stage: the estimate's communication and update terms can favour a
        # split that the per-stage compute times do not show
        sources = dict.fromkeys((slowest, heaviest, *range(len(pipe.stages))))
        for src, dst in [(s, d) for s in sources for d in range(len(pipe.stages))]:
            if dst == src or pipe.stages[src].layers <= 1:
                continue
            st = list(pipe.stages)
            a, b = st[src], st[dst]
            st[src] = StageLayout(a.devices, a.machine, a.layers - 1)
            st[dst] = StageLayout(b.devices, b.machine, b.layers + 1)
            yield _replace(layout, p, PipelineLayout(tuple(st), pipe.batch, pipe.chunks))


def _batch_moves(layout: ClusterLayout, est: Estimate) -> Iterator[ClusterLayout]:
    """One micro-batch from the slowest pipeline to each other one."""
    if len(layout.pipelines) < 2:
        return
    src = max(range(len(layout.pipelines)), key=lambda p: (est.pipeline_time[p], -p))
    a = layout.pipelines[src]
    if a.chunks <= 1:
        return
    mb = a.micro_batch
    for dst in range(len(layout.pipelines)):
        b = layout.pipelines[dst]
        if dst == src or b.micro_batch != mb:
            continue
        out = _replace(layout, src, PipelineLayout(a.stages, a.batch - mb, a.chunks - 1))
        yield _replace(out, dst, PipelineLayout(b.stages, b.batch + mb, b.chunks + 1))


def _device_moves(cm: CostModel, layout: ClusterLayout, est: Estimate) -> Iterator[ClusterLayout]:
    """A TP group of the slowest pipeline moves to another pipeline, next to a stage of its machine
    (or at the end); both pipelines' layers are re-split."""
    k = len(layout.pipelines)
    if k < 2:
        return
    src = max(range(k), key=lambda p: (est.pipeline_time[p], -p))
    a = layout.pipelines[src]
    if len(a.stages) < 2:
        return
    for i, st in enumerate(a.stages):
        rest = a.stages[:i] + a.stages[i + 1:]
        new_a = split_layers(cm, rest, a.batch, a.chunks, k)
        if new_a is None:
            continue
        for dst in range(k):
            if dst == src:
                continue
            b = layout.pipelines[dst]
            same = [j for j, s in enumerate(b.stages) if s.machine == st.machine]
            at = same[-1] + 1 if same else len(b.stages)
            new_b = split_layers(cm, b.stages[:at] + (st,) + b.stages[at:], b.batch, b.chunks, k)
            if new_b is None:
                continue
            out = _replace(layout, src, PipelineLayout(new_a, a.batch, a.chunks))
            yield _replace(out, dst, PipelineLayout(new_b, b.batch, b.chunks))


def _reverse_moves(layout: ClusterLayout) -> Iterator[ClusterLayout]:
    """A pipeline's stages in reverse order (the embedding and the head change ends)."""
    for p, pipe in enumerate(layout.pipelines):
        if len(pipe.stages) > 1:
            yield _replace(layout, p, PipelineLayout(pipe.stages[::-1], pipe.batch, pipe.chunks))


def refine(cm: CostModel, layout: ClusterLayout, budget: int = 3000) -> tuple[ClusterLayout, Estimate]:
    """Hill-climb from `layout`; returns the best layout found and its estimate."""
    est = cm.estimate(layout)
    spent = 0
    improved = True
    while improved and spent < budget:
        improved = False
        for moves in (_layer_moves(layout, est), _batch_moves(layout, est), _reverse_moves(layout),
                      _device_moves(cm, layout, est)):
            for cand in moves:
                spent += 1
                e = cm.estimate(cand)
                if e.objective < est.objective * (1 - 1e-9):
                    layout, est, improved = cand, e, True
                    break
                if spent >= budget:
                    break
            if improved or spent >= budget:
                break
    return layout, est
