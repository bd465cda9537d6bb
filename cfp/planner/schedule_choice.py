"""Per pipeline of a planned layout: the schedule the cost model priced it with, why, and that schedule's table
generated from the cost model's action times under the memory the plan leaves each stage for kept activations.

The cost model (`cfp.planner.costmodel`) prices every candidate schedule of a pipeline by its time formula
(`cfp.schedules.formulas`) and its activation memory per stage (`Schedule.counts`: the virtual-stage inputs and
W stashes its pattern keeps at most) and takes the fastest whose stages fit. `schedule_reports` then builds, for
each pipeline, the table the runtime would generate (`Schedule.generated`) from per-virtual-stage F, B and W
seconds estimated by the cost model, under a per-stage limit in bytes -- what the stage's memory holds beyond its
parameters, optimizer state, gradients and the backward's working set -- and replays it in the event simulation:
its makespan and bubble are the figures to set beside the formula's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from cfp.layout import Layout, Pipeline
from cfp.planner.costmodel import CostModel, Estimate
from cfp.planner.step_features import Among
from cfp.schedules.actions import KeptBytes, ScheduleTable, peak_kept, vstage_layers
from cfp.schedules.registry import ScheduleSpec
from cfp.schedules.simulate import ActionCosts, Simulation

# The generator is pure Python: a table of 500 actions took about 1 s of CPU (its policies' tables and the hill
# climb's up to 100k simulated actions), 17k-action ones 7 s each, so planning 1024 GPUs spent 37 s of its 42 s
# in the report (measured). A layout's tables share one budget of actions; pipelines of the same figures are
# simulated once; beyond the budget a pipeline is chosen by the formula (as the cost model chose it).
MAX_SIMULATED_ACTIONS = 2000     # actions of the simulated tables of one layout, all together
SIMULATED_WITHIN = 1.15          # candidates slower than this times the fastest fitting one by formula: not simulated


@dataclass(frozen=True)
class Candidate:
    """One schedule for a pipeline: its ``formula`` seconds (the cost model's), whether its stages ``fit`` in
    memory, and -- where it fits and is simulated -- its generated ``table``, the table's ``simulation`` with the
    cost model's action times and per stage what the table keeps at most (``peak``) of what it may (``limit``)."""
    spec: ScheduleSpec
    formula: float
    fits: bool
    table: Optional[ScheduleTable] = None
    simulation: Optional[Simulation] = None
    limit: tuple[float, ...] = ()
    peak: tuple[float, ...] = ()

    @property
    def seconds(self) -> float:
        """The simulated makespan where simulated, else the formula's."""
        return self.simulation.makespan if self.simulation is not None else self.formula

    def figures(self) -> str:
        if not self.fits:
            return f"{self.spec} {self.formula:.4f} s (does not fit in memory)"
        if self.simulation is None:
            return f"{self.spec} {self.formula:.4f} s (formula; not simulated)"
        return f"{self.spec} {self.simulation.makespan:.4f} s (formula {self.formula:.4f} s)"


@dataclass(frozen=True)
class ScheduleReport:
    """One pipeline's candidates and the one chosen: of those whose stages fit, the shortest simulated (the
    formula's pick where they were not all simulated; the base schedule where none fits)."""
    pipeline: int
    candidates: tuple[Candidate, ...]
    chosen: Candidate
    by_simulation: bool

    def line(self) -> str:
        """One line: the choice, its figures, the others and why."""
        c = self.chosen
        head = f"pipeline {self.pipeline}: {c.spec} -- "
        if c.simulation is not None:
            head += (f"simulated {c.simulation.makespan:.4f} s from estimated action times (formula "
                     f"{c.formula:.4f} s; bubble {c.simulation.bubble:.1%}, imbalance {c.simulation.imbalance:.1%})")
        else:
            head += f"est. {c.formula:.4f} s (formula)"
        others = [x.figures() for x in self.candidates if x is not c]
        why = ("the shortest simulated of those whose stages fit in memory" if self.by_simulation
               else "the fastest by formula of those whose stages fit in memory" if c.fits
               else "no candidate fits: the base schedule")
        return head + (f"; {', '.join(others)}" if others else "") + f"; chosen: {why}"


def kept_bytes(cm: CostModel, pipe: Pipeline, spec: ScheduleSpec, n_pipes: "int | Among" = 1) -> KeptBytes:
    """Per virtual stage, the bytes one micro-batch keeps: its input (token ids for the first) and its layers'
    residuals under its stage's recompute policy (`CostModel.stage_policy`, `residual_bytes`) from F to B, and
    what its W needs (its layers' parameter dots' inputs and output gradients) from B to W."""
    m, mb = cm.model, pipe.micro_batch
    placement = spec.entry.placement.stages(pipe.num_stages, spec.v)
    layers = vstage_layers([s.layers for s in pipe.stages], placement)
    tp = [pipe.stages[d].tp for d in placement]
    policy = [cm.stage_policy(st, i, pipe, n_pipes, spec) for i, st in enumerate(pipe.stages)]
    inputs = tuple(mb * ((m.token_bytes() if c == 0 else m.boundary_bytes())
                         + n * cm.residual_bytes(t, policy[d])) for c, (n, t, d) in enumerate(zip(layers, tp, placement)))
    weight = tuple(mb * n * m.layer_weight_stash_bytes(t) if spec.entry.split else 0.0 for n, t in zip(layers, tp))
    return KeptBytes(inputs, weight)


def memory_limit(cm: CostModel, pipe: Pipeline, n_pipes: "int | Among", spec: ScheduleSpec) -> tuple[float, ...]:
    """Per stage, the bytes left for kept inputs and W stashes: its device memory less everything else the cost
    model counts at its peak (parameters, optimizer state, gradients, the backward's working set, the head's
    logits); what the schedule's pattern keeps (`Schedule.counts`) fits in it whenever the stage fits."""
    out = []
    m, mb = cm.model, pipe.micro_batch
    _, counts = cm.placed(pipe.num_stages, pipe.chunks, spec)
    for i, st in enumerate(pipe.stages):
        policy = cm.stage_policy(st, i, pipe, n_pipes, spec)
        t = cm.memory_terms(st, i, pipe, n_pipes, spec, policy)
        n_in, n_stash = counts[i]
        # the kept part of the cost model's peak, as `CostModel._memory_terms` counts it: inputs, their residuals
        # (the running backward's whole activations stay in the rest) and W stashes
        kept = (n_in * mb * (m.token_bytes() if i == 0 and spec.v == 1 else m.boundary_bytes())
                + n_in / spec.v * st.layers * mb * cm.residual_bytes(st.tp, policy)
                + n_stash / spec.v * st.layers * mb * m.layer_weight_stash_bytes(st.tp))
        others = t.state(st.layers) + t.a0 + st.layers * t.a1 - kept
        out.append(cm.cluster.machines[st.machine].memory - others)
    return tuple(out)


def action_costs(cm: CostModel, pipe: Pipeline, n_pipes: "int | Among", spec: ScheduleSpec) -> ActionCosts:
    """Per virtual stage, F, B and W seconds: its stage's (`CostModel.action_seconds`, sends included) shared
    among the stage's virtual stages by their layers (the embedding and the head counted as one layer each)."""
    ests = cm.stage_estimates(pipe, n_pipes, spec)
    f, b, w = cm.action_seconds(ests, spec)
    placement = spec.entry.placement.stages(pipe.num_stages, spec.v)
    layers = vstage_layers([s.layers for s in pipe.stages], placement)
    weight = [n + (c == 0) + (c == len(placement) - 1) for c, n in enumerate(layers)]
    total = [0.0] * pipe.num_stages
    for c, d in enumerate(placement):
        total[d] += weight[c]
    share = [weight[c] / total[d] if total[d] else 1.0 / placement.count(d) for c, d in enumerate(placement)]
    pick = lambda xs: tuple(xs[d] * share[c] for c, d in enumerate(placement))
    return ActionCosts(pick(f), pick(b), pick(w))


def schedule_reports(cm: CostModel, layout: Layout, est: Estimate) -> list[ScheduleReport]:
    """`ScheduleReport` of every pipeline of an estimated layout: each candidate that fits and is within
    `SIMULATED_WITHIN` of the fastest by formula simulated (its table generated under `memory_limit`), pipeline by
    pipeline while the layout's tables stay within `MAX_SIMULATED_ACTIONS` actions (a pipeline whose stage figures
    and micro-batches equal an earlier one's reuses its candidates, at no cost)."""
    out, seen, spent = [], {}, 0
    n = len(layout.pipelines)
    for p, (pipe, options) in enumerate(zip(layout.pipelines, est.schedule_options)):
        key = (tuple((cm.kind[s.machine], s.tp, s.layers) for s in pipe.stages), pipe.micro_batch, pipe.chunks,
               est.stages[p], options, p == 0)
        if key not in seen:
            best = min([t for _, t, ok in options if ok], default=0.0)
            near = [spec for spec, t, ok in options if ok and t <= SIMULATED_WITHIN * best]
            size = sum(pipe.num_stages * s.v * pipe.chunks * (3 if s.entry.split else 2) for s in near)
            simulate_all = spent + size <= MAX_SIMULATED_ACTIONS
            spent += size if simulate_all else 0
            seen[key] = [_candidate(cm, pipe, Among(n, p == 0), spec, t, ok, simulate_it=simulate_all and spec in near)
                         for spec, t, ok in options]
        cands = seen[key]
        sims = [c for c in cands if c.simulation is not None]
        if sims:
            chosen = min(sims, key=lambda c: c.simulation.makespan)
        else:
            chosen = next(c for c in cands if c.spec == est.schedules[p])
        out.append(ScheduleReport(p, tuple(cands), chosen, bool(sims)))
    return out


def _candidate(cm: CostModel, pipe: Pipeline, n_pipes: "int | Among", spec: ScheduleSpec, formula: float, fits: bool,
               simulate_it: bool) -> Candidate:
    if not simulate_it:
        return Candidate(spec, formula, fits)
    limit = memory_limit(cm, pipe, n_pipes, spec)
    kept = kept_bytes(cm, pipe, spec, n_pipes)
    table, sim = spec.entry.generated(pipe.num_stages, pipe.chunks, action_costs(cm, pipe, n_pipes, spec), spec.v,
                                      limit, kept)
    return Candidate(spec, formula, fits, table, sim, limit, tuple(peak_kept(table, kept)))
