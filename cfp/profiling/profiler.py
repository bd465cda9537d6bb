"""The profiling pass: every unique segment kind, its (pruned) strategy combinations compiled and timed.

Per combination the segment's sub-program (`subprogram.SegmentProgram`) is compiled; the `measure` profiler runs
it (warm-up, then the median of `iters` runs), the `estimate` profiler applies the GPU cost model to the compiled
per-device FLOPs, bytes and parsed collectives. Compiling the next combination overlaps the current one's
warm-up runs and HLO parsing; the timed runs wait for that compile to finish, so they run without contention.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import math
import time
from typing import Callable, Sequence

import jax
import numpy as np

from cfp.analysis.analysis import Analysis
from cfp.analysis.block_sharding import shards
from cfp.analysis.blocks import data_parallel_choice
from cfp.analysis.segments import Segment
from cfp.hardware.gpus import get_gpu
from cfp.ir.capture import Program
from cfp.profiling import gpu_estimate
from cfp.profiling.cachekey import segment_cache_key
from cfp.profiling.options import ProfileOptions, ProfilerKind, ProfilerSpec
from cfp.profiling.subprogram import SegmentProgram
from cfp.profiling.table import ProfileEntry, ProfileTable, SegmentProfile, cache_load, cache_store
from cfp.xla.compiled import compiled_figures, device_kind, time_compiled


def _count(n: int) -> str:
    return str(n) if n < 10 ** 15 else f"{n:.2e}"   # a 100-block segment has ~3^100


# A beam holds width x blocks picks: past this many cells (8 bytes each) the width shrinks, down to
# _MIN_BEAM, so a segment of any length ranks within a few hundred MB.
_BEAM_CELLS = 1 << 23
_MIN_BEAM = 16


def beam_width(limit: int, blocks: int) -> int:
    """The beam width `ranked_combinations` uses for `blocks` lists under `limit` (`ProfileOptions.pool_limit`)."""
    return min(limit, max(_MIN_BEAM, _BEAM_CELLS // max(1, blocks)))


def ranked_combinations(short: Sequence[Sequence[int]], unary: Callable[[int, int], tuple],
                        pairwise: dict[tuple[int, int], Callable[[int, int], tuple]],
                        width: int) -> list[tuple[int, ...]]:
    """The best combinations (one entry of each list of `short`) under an additive score: `unary(k, s)` for
    choosing `s` at block k, plus `pairwise[(i, k)](si, sk)` for each listed pair i < k; scores are tuples of
    floats, compared lexicographically. A beam keeps the `width` best prefixes at each block, so memory and
    time stay linear in the number of blocks (a remat model's unpaired dots once made a 104-block segment
    whose full product, ~3^104, exhausted memory). Exact -- every combination, in score order, ties in
    enumeration order -- while the product has at most `beam_width(width, len(short))` members; beyond, an
    approximation that returns that many combinations."""
    if not short:
        return [()]
    width = beam_width(width, len(short))
    m = len(unary(0, short[0][0]))
    earlier: dict[int, list] = {}
    for (i, k), fn in pairwise.items():
        earlier.setdefault(k, []).append((i, fn))
    picks = np.zeros((1, 0), dtype=np.int64)      # per prefix, the position picked in each short list
    scores = np.zeros((1, m))
    for k, cands in enumerate(short):
        grown_picks, grown_scores = [], []
        for j, s in enumerate(cands):
            add = np.tile(np.asarray(unary(k, s), dtype=float), (len(picks), 1))
            for i, fn in earlier.get(k, ()):
                table = np.array([fn(si, s) for si in short[i]], dtype=float).reshape(len(short[i]), m)
                add += table[picks[:, i]]
            grown_picks.append(np.hstack([picks, np.full((len(picks), 1), j)]))
            grown_scores.append(scores + add)
        # enumeration order (prefix-major) for ties, as itertools.product would list them
        picks = np.stack(grown_picks, axis=1).reshape(-1, k + 1)
        scores = np.stack(grown_scores, axis=1).reshape(-1, m)
        keep = np.lexsort(scores.T[::-1])[:width]
        picks, scores = picks[keep], scores[keep]
    return [tuple(short[k][int(j)] for k, j in enumerate(row)) for row in picks]


def _short_lists(segment: Segment, space, own: dict, foot: dict, per_block: int) -> list[list[int]]:
    """Per block, its `per_block` best strategies by analytic cost plus its leanest in memory."""
    short = []
    for b, n in zip(segment.blocks, space):
        keep = sorted(range(n), key=lambda s, b=b: (own[(b, s)], s))[:per_block]
        lean = min(range(n), key=lambda s, b=b: (foot[(b, s)], own[(b, s)], s))
        short.append(keep + [lean] if lean not in keep else keep)
    return short


def candidate_choices(analysis: Analysis, segment: Segment, options: ProfileOptions) -> tuple[list[tuple[int, ...]], str]:
    """The combinations to profile and the rule that chose them (see `ProfileOptions`)."""
    space = [len(analysis.blocks[b].strategies) for b in segment.blocks]
    total = 1
    for n in space:
        total *= n
    if total <= options.max_combinations:
        return list(itertools.product(*[range(n) for n in space])), f"exhaustive: all {total} combinations"
    gpu = get_gpu(options.gpu or gpu_estimate.DEFAULT_RANKING_GPU)
    g, shape = analysis.graph, analysis.mesh.shape
    layouts = {(b, s): analysis.layout(b, s)
               for b in segment.blocks for s in range(len(analysis.blocks[b].strategies))}
    own = {k: gpu_estimate.block_cost(analysis, lay, gpu) for k, lay in layouts.items()}
    # memory proxy: per-device bytes of every tensor the block's layout places (weights, optimizer state and
    # activations alike); each block also keeps its leanest strategy so memory-bound budgets have candidates
    foot = {k: sum(g.tensor(t).nbytes // shards(spec, shape) for t, spec in lay.specs)
            for k, lay in layouts.items()}
    short = _short_lists(segment, space, own, foot, options.per_block)
    specs = {k: lay.spec_of for k, lay in layouts.items()}
    blocks = list(segment.blocks)
    shared = [(i, j) for i in range(len(blocks)) for j in range(i + 1, len(blocks))
              if specs[(blocks[i], 0)].keys() & specs[(blocks[j], 0)].keys()]
    link = gpu.link_gbps * 1e9
    pair_cost: dict = {}

    def pair(i, ci, j, cj):
        key = (i, ci, j, cj)
        if key not in pair_cost:
            pair_cost[key] = gpu_estimate.reshard_cost(analysis, specs[(blocks[i], ci)], specs[(blocks[j], cj)], link)
        return pair_cost[key]

    def cost(choice):
        return sum(own[(b, s)] for b, s in zip(blocks, choice)) + sum(
            pair(i, choice[i], j, choice[j]) for i, j in shared)
    pairs = {(i, j): (lambda si, sj, i=i, j=j: (pair(i, si, j, sj),)) for i, j in shared}
    lean_pairs = {k: (lambda si, sj, fn=fn: (0.0,) + fn(si, sj)) for k, fn in pairs.items()}
    by_cost = sorted(ranked_combinations(short, lambda k, s: (own[(blocks[k], s)],), pairs, options.pool_limit),
                     key=lambda c: (cost(c), c))
    n_lean = max(1, options.max_combinations // 4)
    by_memory = sorted(ranked_combinations(short, lambda k, s: (foot[(blocks[k], s)], own[(blocks[k], s)]),
                                           lean_pairs, options.pool_limit),
                       key=lambda c: (sum(foot[(b, s)] for b, s in zip(blocks, c)), cost(c), c))
    pool_size, width = math.prod(len(keep) for keep in short), beam_width(options.pool_limit, len(short))
    # the data-parallel combination is always profiled: the search calibrates its memory sums on it
    uniform = data_parallel_choice(g, analysis.blocks)
    dp_choice = tuple(uniform[b] for b in segment.blocks)
    choices = list(dict.fromkeys([dp_choice] + by_memory[:n_lean] + by_cost))[:options.max_combinations]
    rule = (f"pruned: {_count(total)} combinations > max {options.max_combinations}; kept the {options.per_block} best "
            f"strategies per block by analytic cost plus its leanest in memory, then data parallel, the {n_lean} leanest and "
            f"the best by analytic cost incl. resharding of their {_count(pool_size)} combinations"
            + (f" (ranked by a beam of width {width})" if pool_size > width else "")
            + f" ({len(choices)} profiled)")
    return choices, rule


class Profiler:
    """Profiles the unique segments of one captured program; `compiles` counts the compilations it made."""

    def __init__(self, program: Program, analysis: Analysis, options: ProfileOptions,
                 log: Callable[[str], None] = print):
        self.program, self.analysis, self.options, self.log = program, analysis, options, log
        self.compiles = 0
        self.reused: list[int] = []     # segment kinds read from the cache
        self.mesh = analysis.mesh.make()
        self.gpu = get_gpu(options.gpu) if options.gpu else None

    @property
    def spec(self) -> ProfilerSpec:
        return ProfilerSpec(self.options.kind, None if self.options.kind is ProfilerKind.MEASURE else self.gpu.name)

    def run(self) -> ProfileTable:
        t0 = time.perf_counter()
        firsts: dict[int, Segment] = {}
        for s in self.analysis.segments:
            firsts.setdefault(s.kind, s)
        dk, jv = device_kind(), jax.__version__
        out: dict[int, SegmentProfile] = {}
        todo = []
        for kind, seg in firsts.items():
            key = (segment_cache_key(self.program, self.analysis, seg, self.options, dk)
                   if self.options.cache_dir else None)
            hit = cache_load(self.options.cache_dir, key)
            if hit is not None and hit.space == self._space(seg):
                out[kind] = hit
                self.reused.append(kind)
            else:
                todo.append((kind, seg, key))
        with self._progress() as progress:
            for kind, seg, key in todo:
                choices, rule = candidate_choices(self.analysis, seg, self.options)
                self.log(f"segment kind {kind} (blocks {seg.start}..{seg.stop - 1}): {rule}")
                task = progress.add_task(f"segment kind {kind}", total=len(choices)) if progress else None
                entries = self.profile_segment(seg, choices,
                                               (lambda: progress.advance(task)) if progress else None)
                prof = SegmentProfile(kind, seg.fingerprint, self._space(seg), rule, tuple(entries))
                cache_store(self.options.cache_dir, key, prof)
                out[kind] = prof
        return ProfileTable(self.analysis.mesh.shape, dk, jv, self.spec, dict(sorted(out.items())),
                            self.compiles, time.perf_counter() - t0, tuple(sorted(self.reused)))

    def _space(self, seg: Segment) -> tuple[int, ...]:
        return tuple(len(self.analysis.blocks[b].strategies) for b in seg.blocks)

    @contextlib.contextmanager
    def _progress(self):
        if not self.options.progress:
            yield None
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), transient=False) as p:
            yield p

    def _compile(self, seg: Segment, choice) -> tuple[SegmentProgram, object]:
        sp = SegmentProgram(self.program, self.analysis, seg, choice, self.mesh)
        compiled = sp.compile()
        self.compiles += 1
        return sp, compiled

    def profile_segment(self, seg: Segment, choices: Sequence[tuple[int, ...]],
                        advance: Callable[[], None] | None = None) -> list[ProfileEntry]:
        entries = []
        overlap = self.options.overlap_compile and len(choices) > 1
        pool = concurrent.futures.ThreadPoolExecutor(1) if overlap else None
        try:
            nxt = pool.submit(self._compile, seg, choices[0]) if pool else None
            for i, choice in enumerate(choices):
                sp, compiled = nxt.result() if pool else self._compile(seg, choice)
                quiet = None
                if pool and i + 1 < len(choices):
                    nxt = pool.submit(self._compile, seg, choices[i + 1])
                    quiet = nxt.exception   # blocks until the background compile is done (errors surface later)
                entries.append(self._entry(seg, choice, sp, compiled, quiet))
                if advance:
                    advance()
        finally:
            if pool:
                pool.shutdown(wait=True)
        return entries

    def _entry(self, seg: Segment, choice, sp: SegmentProgram, compiled, quiet=None) -> ProfileEntry:
        shape = self.analysis.mesh.shape
        fig = compiled_figures(compiled, shape)
        colls = gpu_estimate.collective_groups(fig, shape)
        measured = None
        if self.options.kind is ProfilerKind.MEASURE:
            measured = time_compiled(compiled, sp.example_inputs(), self.options.iters, self.options.warmup, quiet)
            t = measured
        else:
            dtype = gpu_estimate.dominant_dtype(self.analysis, seg.blocks)
            rate = gpu_estimate.dots_rate(self.analysis, zip(seg.blocks, choice), self.gpu)
            t = gpu_estimate.estimated_time(fig, shape, self.gpu, dtype, rate)
        return ProfileEntry(tuple(choice), t, fig.memory - sp.borrowed_bytes, sum(c[1] for c in colls), fig.flops,
                            fig.bytes_accessed, colls, measured)


def profile(program: Program, analysis: Analysis, options: ProfileOptions | None = None,
            log: Callable[[str], None] = print) -> ProfileTable:
    """Profile every unique segment kind of `analysis` (see `ProfileOptions` for the reduction rule)."""
    return Profiler(program, analysis, options or ProfileOptions(), log).run()
