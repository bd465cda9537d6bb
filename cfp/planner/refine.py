"""Local refinement guided by the cost model (variable-neighbourhood descent).

Two kinds of move. *Polishing* moves keep the layout's structure: shift 1, 2, 3, 4, 8, ... layers from
one stage of a pipeline to another, or one micro-batch from one pipeline to another. *Structural* moves
change it: change the micro-batch size; reverse a pipeline or swap two of its machine blocks; split a
stage's TP group in two, merge two neighbouring stages of one machine into one group of twice the
degree, or re-cut a pipeline's stages on one machine into groups of other sizes (TP degrees may differ
inside a machine, as HexiScale allows); move a TP group or a machine block to another pipeline (a
pipeline left empty disappears) or swap two of them, of different machines, between pipelines. When
no single structural move pays, *compound* moves are tried: a device move followed by a TP split or
merge in a pipeline it changed. Polishing also moves a stage boundary shared by several pipelines in
all of them at once (gradient sync couples their layer splits). Moves keep each machine's
stages of a pipeline together, so the refined layout stays inside the exhaustive search's space
(`exhaustive`). A structural move re-splits the layers of the pipelines it changed (`split_layers`) and
the micro-batches over all pipelines (`allocate_chunks`), then is polished before it is judged, so a
move that only pays together with other layer and batch counts is still taken; a changed pipeline of few
machines is also tried with each other machine last (`_head_orders`), since a move that takes away or
adds the machine holding the LM head changes where it is best held.

First improvement in a fixed move order, so the result is deterministic; `budget` bounds the number
of estimates and rebuilds (a count, not a time); a layout or move met again costs nothing (`_Budget`)."""
from __future__ import annotations

import itertools
from typing import Iterator, Optional, Sequence

from cfp.layout import Layout, Pipeline, Stage
from cfp.planner.build import allocate_chunks, best_order, max_chunks, pipeline_terms, split_layers
from cfp.planner.costmodel import CostModel, Estimate
from cfp.planner.metis import size_cuts, size_orders
from cfp.planner.step_features import Among

_SHIFTS = (1, 2, 3, 4, 8, 16, 32, 64)
_EPS = 1e-9
_MISSING = object()


class _Budget:
    """The estimates and rebuilds left, and their memo (`memo`: shared by the descents of one planning
    run). A layout estimated or a move rebuilt before costs nothing again: descents from different
    candidates often meet in one local optimum, and the later ones then go on where the earlier stopped
    instead of spending their budget on the same moves."""

    def __init__(self, cm: CostModel, budget: int, memo: Optional[dict] = None):
        self.cm, self.left = cm, budget
        memo = {} if memo is None else memo
        self._estimates = memo.setdefault("estimates", {})
        self._rebuilds = memo.setdefault("rebuilds", {})
        self._terms = memo.setdefault("terms", {})

    def estimate(self, layout: Layout) -> Estimate:
        est = self._estimates.get(layout)
        if est is None:
            self.left -= 1
            est = self._estimates[layout] = self.cm.estimate(layout)
        return est

    def rebuild(self, pipes: Sequence[Sequence[Stage]], changed: set[int], global_batch: int,
                mb: int) -> Optional[Layout]:
        """`_rebuild`, counted as one estimate unless memoised."""
        key = (tuple(map(tuple, pipes)), frozenset(changed), global_batch, mb)
        lay = self._rebuilds.get(key, _MISSING)     # (a rebuild may be None: no layout)
        if lay is _MISSING:
            self.left -= 1
            lay = self._rebuilds[key] = _rebuild(self, pipes, changed, global_batch, mb)
        return lay

    def terms(self, stages: tuple[Stage, ...], mb: int, k: "int | Among", total: int) -> tuple[tuple, int]:
        """A pipeline's time terms and micro-batch cap (memoised: rebuilds repeat unchanged pipelines)."""
        key = (stages, mb, k, total)
        terms = self._terms.get(key)
        if terms is None:
            terms = self._terms[key] = (pipeline_terms(self.cm, stages, mb), max_chunks(self.cm, stages, mb, k, total))
        return terms


def _replace(layout: Layout, p: int, pipe: Pipeline) -> Layout:
    pipes = list(layout.pipelines)
    pipes[p] = pipe
    return Layout.unchecked(tuple(pipes))


# ----------------------------------------------------------------------------- polishing
def _layer_shifts(layout: Layout, est: Estimate, pipes: Sequence[int]) -> Iterator[Layout]:
    """d layers from stage `src` to stage `dst` of a pipeline: slowest pipeline first, then from its
    slower stages to its faster ones, small d first (the likeliest improvements come first, which is
    what keeps first-improvement search cheap on pipelines of many stages)."""
    for p in sorted(pipes, key=lambda p: (-est.pipeline_time[p], p)):
        pipe = layout.pipelines[p]
        slot = [e.fwd + e.bwd + e.send for e in est.stages[p]]
        by_time = sorted(range(len(slot)), key=lambda i: (-slot[i], i))
        for src in by_time:
            for dst in by_time[::-1]:
                for d in _SHIFTS:
                    if dst == src or pipe.stages[src].layers <= d:
                        continue
                    st = list(pipe.stages)
                    a, b = st[src], st[dst]
                    st[src] = Stage(a.devices, a.layers - d, a.machine)
                    st[dst] = Stage(b.devices, b.layers + d, b.machine)
                    yield _replace(layout, p, Pipeline(tuple(st), pipe.batch, pipe.chunks))


def _boundaries(pipe: Pipeline) -> dict[int, int]:
    """Layer index at which each stage but the last ends -> that stage's index."""
    out, layer = {}, 0
    for i, st in enumerate(pipe.stages[:-1]):
        layer += st.layers
        out[layer] = i
    return out


def _aligned_shifts(layout: Layout) -> Iterator[Layout]:
    """A stage boundary at the same layer moved by d layers in every pipeline that has it (at least
    two). Gradient sync runs per stage over the pipelines' layers at their narrowest TP degree, so a
    boundary moved in one pipeline alone can cost more sync than it saves where moving it in all pays."""
    ends = [_boundaries(p) for p in layout.pipelines]
    shared = sorted({b for e in ends for b in e if sum(b in f for f in ends) >= 2})
    for b in shared:
        for d in _SHIFTS:
            for sign in (-1, 1):
                pipes, moved = list(layout.pipelines), 0
                for p, pipe in enumerate(layout.pipelines):
                    i = ends[p].get(b)
                    if i is None:
                        continue
                    st = list(pipe.stages)
                    a, c = st[i], st[i + 1]
                    if (a.layers if sign < 0 else c.layers) <= d:
                        continue
                    st[i] = Stage(a.devices, a.layers + sign * d, a.machine)
                    st[i + 1] = Stage(c.devices, c.layers - sign * d, c.machine)
                    pipes[p], moved = Pipeline(tuple(st), pipe.batch, pipe.chunks), moved + 1
                if moved >= 2:
                    yield Layout.unchecked(tuple(pipes))


def _batch_moves(layout: Layout, est: Estimate) -> Iterator[Layout]:
    """One micro-batch from a pipeline to another (slowest source first)."""
    k = len(layout.pipelines)
    for src in sorted(range(k), key=lambda p: (-est.pipeline_time[p], p)):
        a = layout.pipelines[src]
        if a.chunks <= 1:
            continue
        mb = a.micro_batch
        for dst in range(k):
            b = layout.pipelines[dst]
            if dst == src or b.micro_batch != mb:
                continue
            out = _replace(layout, src, Pipeline(a.stages, a.batch - mb, a.chunks - 1))
            yield _replace(out, dst, Pipeline(b.stages, b.batch + mb, b.chunks + 1))


def _polish(bud: _Budget, layout: Layout, est: Estimate, pipes: Sequence[int]
            ) -> tuple[Layout, Estimate]:
    """Hill-climb with layer shifts in `pipes`, micro-batch moves and aligned layer shifts (in every
    pipeline) until none improves."""
    improved = True
    while improved and bud.left > 0:
        improved = False
        # lazily: first improvement stops after a few candidates of the many these moves generate
        for cand in itertools.chain(_layer_shifts(layout, est, pipes), _batch_moves(layout, est),
                                    _aligned_shifts(layout)):
            e = bud.estimate(cand)
            if e.objective < est.objective * (1 - _EPS):
                layout, est, improved = cand, e, True
                break
            if bud.left <= 0:
                break
    return layout, est


# ----------------------------------------------------------------------------- structural moves
def _head_orders(stages: Sequence[Stage], max_blocks: int = 4) -> list[list[Stage]]:
    """The pipeline's order, then (with at most `max_blocks` machines) each other machine block moved to
    the end: which machine holds the LM head changes when a move takes the last block away or adds one."""
    blocks = _blocks(stages)
    out = [list(stages)]
    if len(blocks) <= max_blocks:
        out += [[s for b in blocks[:i] + blocks[i + 1:] for s in b] + blocks[i] for i in range(len(blocks) - 1)]
    return out


def _rebuild(bud: _Budget, pipes: Sequence[Sequence[Stage]], changed: set[int], global_batch: int,
             mb: int) -> Optional[Layout]:
    """Layers of the `changed` pipelines re-split, on the best of their `_head_orders`, micro-batches (of
    size `mb`) re-allocated over all; None when a pipeline cannot hold the model or the batch."""
    cm, k, total = bud.cm, len(pipes), global_batch // mb
    if global_batch % mb or total < k:
        return None
    guess = max(1, total // k)
    stages = []
    places = [Among(k, p == 0) for p in range(k)]    # pipeline 0 holds the optimizer state (`Among`)
    for p, st in enumerate(pipes):
        if p in changed:
            orders = _head_orders(st)
            st = (split_layers(cm, st, guess * mb, guess, places[p]) if len(orders) == 1
                  else best_order(cm, orders, guess, mb, places[p]))
            if st is None:
                return None
        stages.append(tuple(st))
    terms = [bud.terms(st, mb, at, total) for st, at in zip(stages, places)]
    chunks = allocate_chunks([t[0] for t in terms], [t[1] for t in terms], total)
    if chunks is None:
        return None
    return Layout.unchecked(tuple(Pipeline(st, c * mb, c) for st, c in zip(stages, chunks)))


def _blocks(stages: Sequence[Stage]) -> list[list[Stage]]:
    """A pipeline's stages cut where the machine changes."""
    out: list[list[Stage]] = []
    for s in stages:
        if out and out[-1][-1].machine == s.machine:
            out[-1].append(s)
        else:
            out.append([s])
    return out


def _order_moves(layout: Layout) -> Iterator[tuple[list, set[int]]]:
    """A pipeline with two of its machine blocks swapped, or reversed."""
    for p, pipe in enumerate(layout.pipelines):
        blocks = _blocks(pipe.stages)
        pipes = [list(q.stages) for q in layout.pipelines]
        if len(pipe.stages) > 1:
            yield [*pipes[:p], list(pipe.stages[::-1]), *pipes[p + 1:]], {p}
        for i in range(len(blocks)):
            for j in range(i + 1, len(blocks)):
                b = list(blocks)
                b[i], b[j] = b[j], b[i]
                yield [*pipes[:p], [s for blk in b for s in blk], *pipes[p + 1:]], {p}


def _insert_points(stages: Sequence[Stage], st: Stage) -> list[int]:
    """Where a group may join a pipeline: next to the stages of its machine if there are any (its links
    are fastest there), else at every machine-block boundary."""
    same = [j for j, s in enumerate(stages) if s.machine == st.machine]
    if same:
        return [same[-1] + 1]
    cuts, i = [0], 0
    for blk in _blocks(stages):
        i += len(blk)
        cuts.append(i)
    return cuts


def _units(stages: Sequence[Stage]) -> list[tuple[int, int]]:
    """(start, length) of what a device move carries: every single stage (TP group), then every
    machine block of two or more stages."""
    out = [(i, 1) for i in range(len(stages))]
    start = 0
    for blk in _blocks(stages):
        if len(blk) > 1:
            out.append((start, len(blk)))
        start += len(blk)
    return out


def _device_moves(layout: Layout, est: Estimate) -> Iterator[tuple[list, set[int]]]:
    """A TP group or a machine block from one pipeline to another (slowest source first; a pipeline
    left empty disappears), then two of them, of different machines, swapped between pipelines."""
    k = len(layout.pipelines)
    pipes = [list(q.stages) for q in layout.pipelines]
    order = sorted(range(k), key=lambda p: (-est.pipeline_time[p], p))
    for src in order:
        for i, n in _units(pipes[src]):
            unit, rest = pipes[src][i:i + n], pipes[src][:i] + pipes[src][i + n:]
            for dst in order:
                if dst == src:
                    continue
                for at in _insert_points(pipes[dst], unit[0]):
                    new = list(pipes)
                    new[src], new[dst] = rest, pipes[dst][:at] + unit + pipes[dst][at:]
                    if rest:
                        yield new, {src, dst}
                    else:
                        del new[src]
                        yield new, {dst - (dst > src)}
    for ai, a in enumerate(order):
        for b in order[ai + 1:]:
            for i, n in _units(pipes[a]):
                for j, m in _units(pipes[b]):
                    x, y = pipes[a][i:i + n], pipes[b][j:j + m]
                    if x[0].machine == y[0].machine:
                        continue
                    ra, rb = pipes[a][:i] + pipes[a][i + n:], pipes[b][:j] + pipes[b][j + m:]
                    for at_a in _insert_points(ra, y[0]):
                        for at_b in _insert_points(rb, x[0]):
                            new = list(pipes)
                            new[a], new[b] = ra[:at_a] + y + ra[at_a:], rb[:at_b] + x + rb[at_b:]
                            yield new, {a, b}


def _tp_moves(cm: CostModel, layout: Layout, only: Optional[set[int]] = None
              ) -> Iterator[tuple[list, set[int]]]:
    """A stage's TP group split into two halves, or two neighbouring stages of one machine and degree
    merged into one group of twice the degree (heads divisible); in the pipelines `only` if given."""
    heads = cm.model.tp_divisor
    pipes = [list(q.stages) for q in layout.pipelines]
    for p, stages in enumerate(pipes):
        if only is not None and p not in only:
            continue
        for i, s in enumerate(stages):
            if s.tp > 1:
                h = s.tp // 2
                parts = [Stage(s.devices[:h], 0, s.machine), Stage(s.devices[h:], 0, s.machine)]
                yield [*pipes[:p], stages[:i] + parts + stages[i + 1:], *pipes[p + 1:]], {p}
        for i in range(len(stages) - 1):
            a, b = stages[i], stages[i + 1]
            if a.machine == b.machine and a.tp == b.tp and heads % (2 * a.tp) == 0:
                merged = Stage(tuple(sorted(a.devices + b.devices)), 0, a.machine)
                yield [*pipes[:p], stages[:i] + [merged] + stages[i + 2:], *pipes[p + 1:]], {p}


def _regroup_moves(cm: CostModel, layout: Layout) -> Iterator[tuple[list, set[int]]]:
    """A pipeline's stages on one machine re-cut into TP groups of other sizes (every ordered cut into
    power-of-two groups, nearest stage count first): e.g. a wide group where the LM head sits and narrow
    ones elsewhere, which single splits and merges reach only through a worse layout."""
    heads = cm.model.tp_divisor
    pipes = [list(q.stages) for q in layout.pipelines]
    for p, stages in enumerate(pipes):
        start = 0
        for blk in _blocks(stages):
            devices = sorted(d for s in blk for d in s.devices)
            now = tuple(s.tp for s in blk)
            seqs = [seq for cut in size_cuts(len(devices), heads) for seq in size_orders(cut)
                    if seq != now and len(seq) <= cm.model.num_layers]
            # nearest stage counts first (every ordered cut of an 8-device machine is 56 sequences)
            for seq in sorted(seqs, key=lambda q: (abs(len(q) - len(now)), len(q), tuple(-t for t in q))):
                groups, i = [], 0
                for t in seq:
                    groups.append(Stage(tuple(devices[i:i + t]), 0, blk[0].machine))
                    i += t
                new = stages[:start] + groups + stages[start + len(blk):]
                yield [*pipes[:p], new, *pipes[p + 1:]], {p}
            start += len(blk)


def _structural(bud: _Budget, layout: Layout, est: Estimate, micro_batch_sizes: Sequence[int]
                ) -> Iterator[tuple[Layout, set[int]]]:
    cm = bud.cm
    g, mb = layout.global_batch, layout.pipelines[0].micro_batch
    pipes = [list(q.stages) for q in layout.pipelines]
    for other in micro_batch_sizes:
        if other != mb:
            lay = bud.rebuild(pipes, set(), g, other)
            if lay is not None:
                yield lay, set(range(len(pipes)))
    for gen in (_order_moves(layout), _tp_moves(cm, layout), _regroup_moves(cm, layout),
                _device_moves(layout, est)):
        for new, changed in gen:
            if bud.left <= 0:
                return
            lay = bud.rebuild(new, changed, g, mb)
            if lay is not None:
                yield lay, changed


def _compound(bud: _Budget, layout: Layout, est: Estimate
              ) -> Iterator[tuple[Layout, set[int]]]:
    """A device move (`_device_moves`) followed by a TP split or merge in a pipeline it changed: a group
    joining a pipeline adds a stage there, which often pays only with two of its groups merged (or one
    split where the group left), while each move alone is worse."""
    g, mb = layout.global_batch, layout.pipelines[0].micro_batch
    for new, changed in _device_moves(layout, est):
        if bud.left <= 0:
            return
        moved = bud.rebuild(new, changed, g, mb)
        if moved is None:
            continue
        for second, again in _tp_moves(bud.cm, moved, changed):
            if bud.left <= 0:
                return
            lay = bud.rebuild(second, again, g, mb)
            if lay is not None:
                yield lay, changed


def _first_better(bud: _Budget, layout: Layout, est: Estimate,
                  moves: Iterator[tuple[Layout, set[int]]]) -> Optional[tuple[Layout, Estimate]]:
    """The first of `moves` whose estimate, polished over the pipelines it changed, beats `est`."""
    for cand, changed in moves:
        e = bud.estimate(cand)
        if e.fits:
            cand, e = _polish(bud, cand, e, sorted(changed))
        if e.objective < est.objective * (1 - _EPS):
            return cand, e
        if bud.left <= 0:
            break
    return None


def refine(cm: CostModel, layout: Layout, budget: int = 3000,
           micro_batch_sizes: Sequence[int] = (), memo: Optional[dict] = None
           ) -> tuple[Layout, Estimate, int]:
    """Descend from `layout`: polish, then take the first structural move whose polished estimate is
    better; when none is, the first compound move (`_compound`) that is; until neither is or `budget`
    estimates are spent. Returns the best layout, its estimate and the budget left unspent.
    `micro_batch_sizes`: the other micro-batch sizes a move may switch to; `memo`: shared by the
    descents of one planning run (`_Budget`)."""
    bud = _Budget(cm, budget, memo)
    est = bud.estimate(layout)
    layout, est = _polish(bud, layout, est, range(len(layout.pipelines)))
    while bud.left > 0:
        # compound moves only once single ones are exhausted: they cost a TP move's worth of
        # estimates per device move, and the budget is better spent on single moves while they pay
        found = (_first_better(bud, layout, est, _structural(bud, layout, est, micro_batch_sizes))
                 or _first_better(bud, layout, est, _compound(bud, layout, est)))
        if found is None:
            break
        layout, est = found
    return layout, est, max(0, bud.left)
