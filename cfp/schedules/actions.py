"""A pipeline schedule made concrete: per stage, the ordered actions it runs, over virtual stages placed on stages.

A pipeline of ``p`` stages (device groups of the layout) runs its layers as ``S = v * p`` *virtual stages*, each a
run of consecutive layers; virtual stage ``c`` runs on stage ``placement[c]`` (`Placement`: one per stage, looped
as interleaved 1F1B does, or V-shaped as ZB-V does). An action is one program on one micro-batch: its forward
(F), its whole backward, or the backward split into its input gradient (B, on the critical path) and its weight
gradient (W, deferrable). A `ScheduleTable` holds the placement and every stage's action order; `check_table`
validates one (every action once, on the stage its virtual stage is placed on, W after its B, no deadlock, the
memory each stage keeps within a limit) and `global_order` merges pipelines' tables into the one order the
executor dispatches.

Dependencies: F(c, j) after F(c-1, j); B(c, j) (or the whole backward) after F(c, j) and after B(c+1, j), the
gradient of its output; W(c, j) after B(c, j).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Iterator, NamedTuple, Optional, Sequence, Union

from cfp.errors import ConfigError


class Phase(str, enum.Enum):
    FWD = "fwd"
    BWD = "bwd"                   # the whole backward: input and weight gradient in one program
    BWD_INPUT = "bwd_input"       # B: the gradient of the stage's input only
    BWD_WEIGHT = "bwd_weight"     # W: the gradient of the stage's parameters, from what B kept

    @property
    def letter(self) -> str:
        return {"fwd": "F", "bwd": "BW", "bwd_input": "B", "bwd_weight": "W"}[self.value]

    @property
    def sends_gradient(self) -> bool:
        """Whether the action produces the gradient of its virtual stage's input (the previous one waits on it)."""
        return self in (Phase.BWD, Phase.BWD_INPUT)


class Action(NamedTuple):
    phase: Phase
    microbatch: int
    vstage: int


StageActions = list[list[Action]]  # [stage] -> ordered actions


class Placement(str, enum.Enum):
    LINEAR = "linear"     # v = 1: virtual stage c on stage c
    LOOP = "loop"         # interleaved: virtual stage c on stage c mod p
    V = "v"               # v = 2: down the stages and back up (c on c for c < p, else on 2p - 1 - c)

    def stages(self, num_stages: int, v: int) -> tuple[int, ...]:
        """The stage of every virtual stage."""
        p = num_stages
        if p < 1 or v < 1:
            raise ConfigError(f"num_stages={p}, v={v}: both must be >= 1")
        if self is Placement.LINEAR:
            if v != 1:
                raise ConfigError(f"a linear placement has one virtual stage per stage, not v={v}")
            return tuple(range(p))
        if self is Placement.LOOP:
            return tuple(c % p for c in range(v * p))
        if v != 2:
            raise ConfigError(f"a V placement has two virtual stages per stage, not v={v}")
        return tuple(range(p)) + tuple(reversed(range(p)))


def vstage_layers(stage_layers: Sequence[int], placement: Sequence[int]) -> tuple[int, ...]:
    """Layers of each virtual stage: every stage's layers cut into its virtual stages as evenly as possible, the
    earlier virtual stages (in pipeline order) taking the extra ones."""
    counts = {}
    for d in placement:
        counts[d] = counts.get(d, 0) + 1
    if sorted(counts) != list(range(len(stage_layers))):
        raise ConfigError(f"placement {tuple(placement)} does not place virtual stages on each of the "
                          f"{len(stage_layers)} stages")
    seen = dict.fromkeys(counts, 0)
    out = []
    for d in placement:
        q, r = divmod(stage_layers[d], counts[d])
        out.append(q + (1 if seen[d] < r else 0))
        seen[d] += 1
    return tuple(out)


@dataclass(frozen=True)
class ScheduleTable:
    """Per stage its ordered actions, over ``len(placement)`` virtual stages (``placement[c]``: the stage of virtual
    stage c) and ``microbatches`` micro-batches. Indexing and iterating give the stages' action lists."""
    name: str
    placement: tuple[int, ...]
    microbatches: int
    actions: tuple[tuple[Action, ...], ...]

    def __post_init__(self):
        object.__setattr__(self, "placement", tuple(int(d) for d in self.placement))
        object.__setattr__(self, "actions", tuple(tuple(Action(Phase(a[0]), int(a[1]), int(a[2])) for a in acts)
                                                  for acts in self.actions))

    def __getitem__(self, stage: int) -> tuple[Action, ...]:
        return self.actions[stage]

    def __len__(self) -> int:
        return len(self.actions)

    def __iter__(self) -> Iterator[tuple[Action, ...]]:
        return iter(self.actions)

    @property
    def num_stages(self) -> int:
        return len(self.actions)

    @property
    def num_vstages(self) -> int:
        return len(self.placement)

    @property
    def v(self) -> int:
        return self.num_vstages // max(self.num_stages, 1)

    @property
    def split(self) -> bool:
        """Whether the backward runs as B and W."""
        return any(a.phase is Phase.BWD_INPUT for acts in self.actions for a in acts)

    def vstages_of(self, stage: int) -> tuple[int, ...]:
        return tuple(c for c, d in enumerate(self.placement) if d == stage)

    def to_dict(self) -> dict:
        return {"name": self.name, "placement": list(self.placement), "microbatches": self.microbatches,
                "actions": [[[a.phase.value, a.microbatch, a.vstage] for a in acts] for acts in self.actions]}

    @classmethod
    def from_dict(cls, data: dict) -> "ScheduleTable":
        try:
            return cls(data["name"], tuple(data["placement"]), int(data["microbatches"]),
                       tuple(tuple(tuple(a) for a in acts) for acts in data["actions"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"not a schedule table ({type(e).__name__}: {e})") from None


def linear_table(name: str, actions: Sequence[Sequence[Action]], microbatches: int) -> ScheduleTable:
    """A table of one virtual stage per stage."""
    return ScheduleTable(name, tuple(range(len(actions))), microbatches, tuple(tuple(a) for a in actions))


def dependencies(a: Action, num_vstages: int) -> list[tuple[Phase, int, int]]:
    """(phase, vstage, microbatch) of the actions ``a`` waits for; a backward waits for the next virtual stage's
    input gradient, whichever form (whole or B) that one runs as (``_key`` gives both one key)."""
    c, j = a.vstage, a.microbatch
    if a.phase is Phase.FWD:
        return [(Phase.FWD, c - 1, j)] if c > 0 else []
    if a.phase is Phase.BWD_WEIGHT:
        return [(Phase.BWD_INPUT, c, j)]
    deps = [(Phase.FWD, c, j)]
    if c < num_vstages - 1:
        deps.append((Phase.BWD_INPUT, c + 1, j))      # the gradient of c's output
    return deps


def _key(phase: Phase, vstage: int, microbatch: int) -> tuple:
    # a whole backward and a B both produce the input gradient: one key for "the input gradient of (c, j)"
    return ("grad" if phase.sends_gradient else phase.value, vstage, microbatch)


def check_table(table: ScheduleTable, memory_limit: Optional[Sequence[float]] = None,
                kept: Optional["KeptBytes"] = None) -> None:
    """ConfigError unless every virtual stage runs each micro-batch's forward once and its backward once (whole, or
    as B then W on the same stage), on the stage it is placed on; the stages' orders do not deadlock; and, with
    ``memory_limit`` (per stage, in the units of ``kept``; default one unit per live micro-batch of a whole stage),
    no stage keeps more than its limit."""
    p, S, m = table.num_stages, table.num_vstages, table.microbatches
    if m < 1 or p < 1:
        raise ConfigError(f"schedule {table.name}: {p} stages and {m} micro-batches (both must be >= 1)")
    counts = [table.placement.count(d) for d in range(p)]
    if any(d < 0 or d >= p for d in table.placement) or len(set(counts)) != 1 or counts[0] < 1:
        raise ConfigError(f"schedule {table.name}: placement {table.placement} does not hold the same number of "
                          f"virtual stages on each of its {p} stages")
    split = table.split
    back = (Phase.BWD_INPUT, Phase.BWD_WEIGHT) if split else (Phase.BWD,)
    want = sorted((ph.value, c, j) for c in range(S) for ph in (Phase.FWD,) + back for j in range(m))
    got = sorted((a.phase.value, a.vstage, a.microbatch) for acts in table for a in acts)
    if got != want:
        missing, extra = _diff(want, got)
        raise ConfigError(f"schedule {table.name} does not run every action once ({'B and W' if split else 'whole '
                          'backward'}): missing {missing[:3]}, extra or repeated {extra[:3]}")
    for d, acts in enumerate(table):
        seen_b = set()
        for a in acts:
            if table.placement[a.vstage] != d:
                raise ConfigError(f"schedule {table.name}: stage {d} runs {a.phase.letter}{a.microbatch} of virtual "
                                  f"stage {a.vstage}, which is placed on stage {table.placement[a.vstage]}")
            if a.phase is Phase.BWD_INPUT:
                seen_b.add((a.vstage, a.microbatch))
            elif a.phase is Phase.BWD_WEIGHT and (a.vstage, a.microbatch) not in seen_b:
                raise ConfigError(f"schedule {table.name}: stage {d} runs W{a.microbatch} of virtual stage "
                                  f"{a.vstage} before its B")
    global_order([table])      # raises when the orders deadlock
    if memory_limit is not None:
        peaks = peak_kept(table, kept or KeptBytes.units(table))
        for d, (peak, limit) in enumerate(zip(peaks, memory_limit)):
            if peak > limit * (1 + 1e-9):
                raise ConfigError(f"schedule {table.name}: stage {d} keeps {peak:.4g} at its peak, over its "
                                  f"memory limit {limit:.4g}")


def _diff(want: list, got: list) -> tuple[list, list]:
    from collections import Counter
    w, g = Counter(want), Counter(got)
    return sorted((w - g).elements()), sorted((g - w).elements())


@dataclass(frozen=True)
class KeptBytes:
    """Per virtual stage, what one micro-batch keeps on its stage: ``inputs`` from its F to its backward (B, or
    the whole backward), ``weight`` from its B to its W (what W needs)."""
    inputs: tuple[float, ...]
    weight: tuple[float, ...]

    @classmethod
    def units(cls, table: ScheduleTable) -> "KeptBytes":
        """One unit per live micro-batch of a whole stage: 1/v per virtual stage, kept until its W (or backward)."""
        u = (1.0 / table.v,) * table.num_vstages
        return cls(u, u)


def kept_change(a: Action, kept: KeptBytes) -> float:
    """What a stage keeps more (or less) after action ``a``: F keeps its input, B trades it for W's stash, W and a
    whole backward free what they used."""
    c = a.vstage
    if a.phase is Phase.FWD:
        return kept.inputs[c]
    if a.phase is Phase.BWD:
        return -kept.inputs[c]
    if a.phase is Phase.BWD_INPUT:
        return kept.weight[c] - kept.inputs[c]
    return -kept.weight[c]


def kept_profile(table: ScheduleTable, kept: KeptBytes) -> list[list[float]]:
    """Per stage, what it keeps after each of its actions (a stage's actions run one at a time in its order, so
    its memory depends on the order only)."""
    out = []
    for acts in table:
        cur, row = 0.0, []
        for a in acts:
            cur += kept_change(a, kept)
            row.append(cur)
        out.append(row)
    return out


def peak_kept(table: ScheduleTable, kept: KeptBytes) -> list[float]:
    """Per stage, the most it keeps at once."""
    return [max([0.0] + row) for row in kept_profile(table, kept)]


def live_microbatches(table: ScheduleTable) -> list[int]:
    """Per stage, the most micro-batches live on it at once: forwarded on one of its virtual stages and not yet
    through all of their backward there."""
    out = []
    for d, acts in enumerate(table):
        n_v = len(table.vstages_of(d))
        left: dict[int, int] = {}
        peak = 0
        for a in acts:
            if a.phase is Phase.FWD and a.microbatch not in left:
                left[a.microbatch] = n_v
            elif a.phase in (Phase.BWD, Phase.BWD_WEIGHT):
                left[a.microbatch] -= 1
                if not left[a.microbatch]:
                    del left[a.microbatch]
            peak = max(peak, len(left))
        out.append(peak)
    return out


class GlobalAction(NamedTuple):
    pipeline: int
    stage: int
    phase: Phase
    microbatch: int
    tick: int
    vstage: int


def _as_table(t: Union[ScheduleTable, Sequence[Sequence[Action]]]) -> ScheduleTable:
    if isinstance(t, ScheduleTable):
        return t
    m = 1 + max((a.microbatch for acts in t for a in acts), default=0)
    return linear_table("custom", t, m)


def global_order(per_pipeline: Sequence[Union[ScheduleTable, Sequence[Sequence[Action]]]]) -> list[GlobalAction]:
    """Merge the pipelines' tables into one order by a unit-time tick simulation.

    At each tick every stage runs its next action if all its dependencies finished in an earlier tick; actions
    within a tick are ordered by (pipeline, stage). Raises ConfigError if a schedule deadlocks."""
    tables = [_as_table(t) for t in per_pipeline]
    pos = [[0] * t.num_stages for t in tables]
    done: dict[tuple, int] = {}
    order: list[GlobalAction] = []
    total = sum(len(a) for t in tables for a in t)
    tick = 0
    while len(order) < total:
        issued = []
        for p, t in enumerate(tables):
            for s, acts in enumerate(t):
                if pos[p][s] >= len(acts):
                    continue
                a = acts[pos[p][s]]
                if all(done.get((p,) + _key(*d), tick) < tick for d in dependencies(a, t.num_vstages)):
                    issued.append(GlobalAction(p, s, a.phase, a.microbatch, tick, a.vstage))
        if not issued:
            stuck = [(p, s, tables[p][s][pos[p][s]]) for p in range(len(tables)) for s in range(tables[p].num_stages)
                     if pos[p][s] < len(tables[p][s])]
            p, s, a = stuck[0]
            raise ConfigError(f"pipeline schedule {tables[p].name} deadlocks: no stage can make progress (pipeline "
                              f"{p} stage {s} waits to run {a.phase.letter}{a.microbatch} of virtual stage "
                              f"{a.vstage})")
        for g in issued:
            pos[g.pipeline][g.stage] += 1
            done[(g.pipeline,) + _key(g.phase, g.vstage, g.microbatch)] = tick
        order += issued
        tick += 1
    return order
