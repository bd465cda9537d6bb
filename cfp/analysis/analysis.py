"""The analysis pass: capture a step, build ParallelBlocks and segments, return a frozen `Analysis`."""
from __future__ import annotations

import dataclasses
import json
import time
from typing import Any, Callable, Sequence

from cfp.analysis.blocks import BlockDot, DotRole, ParallelBlock, build_blocks, loops_of
from cfp.analysis.block_sharding import BlockLayout, block_layout
from cfp.analysis.segments import Segment, find_segments
from cfp.analysis.strategies import DotStrategy
from cfp.errors import ConfigError
from cfp.ir.capture import Program, capture
from cfp.ir.graph import OpGraph
from cfp.mesh import MeshSpec

ANALYSIS_VERSION = 2     # 2 renamed BlockDot.plan to loop_map


@dataclasses.dataclass(frozen=True)
class AnalysisOptions:
    """Options of the analysis pass."""

    mesh: MeshSpec

    def __post_init__(self):
        if not isinstance(self.mesh, MeshSpec):
            raise ConfigError(f"mesh must be a MeshSpec, got {self.mesh!r}")


@dataclasses.dataclass(frozen=True)
class Analysis:
    """Result of the analysis pass: the operator graph, its ParallelBlocks, the remainder and the segments."""

    mesh: MeshSpec
    graph: OpGraph
    blocks: tuple[ParallelBlock, ...]
    remainder: tuple[int, ...]
    segments: tuple[Segment, ...]
    analysis_time: float
    version: int = ANALYSIS_VERSION

    @property
    def num_unique_segments(self) -> int:
        return len({s.kind for s in self.segments})

    @property
    def search_space(self) -> tuple[int, ...]:
        return tuple(len(b.strategies) for b in self.blocks)

    def layout(self, block: int, strategy: int) -> BlockLayout:
        """Block `block`'s tensor layouts under its strategy `strategy`; computed once per Analysis (a pure
        function of the frozen graph, block and mesh), then reused by every pass."""
        store = self.__dict__.setdefault("_layouts", {})     # not a field: not serialised, not compared
        key = (block, strategy)
        if key not in store:
            store[key] = block_layout(self.graph, self.blocks[block], strategy, self.mesh.shape)
        return store[key]

    def segment_specs(self, segment: Segment, choice: Sequence[int]) -> dict:
        """Tensor id -> dim axes of every tensor the segment's blocks lay out under `choice` (one strategy
        index per block of the segment; the first block to lay a tensor out wins)."""
        specs: dict = {}
        for b, c in zip(segment.blocks, choice):
            for t, s in self.layout(b, c).spec_of.items():
                specs.setdefault(t, s)
        return specs

    def notation(self, block: int, strategy: int, dot: int | None = None) -> str:
        """Alpa/CFP notation of `strategy` of `block`, for its forward dot or the given member dot."""
        b = self.blocks[block]
        bd = b.forward if dot is None else next(d for d in b.dots if d.op == dot)
        op = self.graph.operators[bd.op]
        s = bd.strategy(b.strategies[strategy])
        g = self.graph
        return s.notation(loops_of(op, g), len(g.tensor(op.inputs[0]).shape),
                          len(g.tensor(op.inputs[1]).shape), len(g.tensor(op.outputs[0]).shape))

    def to_dict(self) -> dict[str, Any]:
        def enc(o):
            if isinstance(o, DotRole):
                return o.value
            raise TypeError(type(o))
        return json.loads(json.dumps(dataclasses.asdict(self), default=enc))

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Analysis":
        if d.get("version") != ANALYSIS_VERSION:
            raise ConfigError(f"analysis version {d.get('version')!r} is not the supported {ANALYSIS_VERSION}")
        blocks = tuple(ParallelBlock(
            b["index"],
            tuple(BlockDot(x["op"], DotRole(x["role"]), tuple(x["loop_map"])) for x in b["dots"]),
            tuple(b["operators"]),
            tuple(DotStrategy(tuple(s["loop_of_axis"])) for s in b["strategies"]),
            b["fingerprint"], tuple(b["scope"])) for b in d["blocks"])
        segs = tuple(Segment(s["index"], s["start"], s["stop"], s["kind"], tuple(s["mapped_to"]),
                             s["fingerprint"], s.get("loop"), s.get("repeat", 1)) for s in d["segments"])
        mesh = MeshSpec(tuple(d["mesh"]["shape"]), tuple(d["mesh"]["axis_names"]))
        return cls(mesh, OpGraph.from_dict(d["graph"]), blocks, tuple(d["remainder"]), segs,
                   d["analysis_time"], d["version"])

    @classmethod
    def from_json(cls, text: str) -> "Analysis":
        return cls.from_dict(json.loads(text))


def analyze_program(program: Program, options: AnalysisOptions, started: float | None = None) -> Analysis:
    """Blocks and segments of a captured program; `analysis_time` counts from `started` (default: now)."""
    t0 = time.perf_counter() if started is None else started
    graph = program.graph
    blocks, remainder = build_blocks(graph, options.mesh.shape)
    segments = find_segments(graph, blocks)
    return Analysis(options.mesh, graph, blocks, remainder, segments, time.perf_counter() - t0)


def analyze(step_fn: Callable, mesh: MeshSpec | str | Any, *example_args) -> Analysis:
    """Trace `step_fn(*example_args)` and group its operators into ParallelBlocks and segments.

    `mesh` is a `MeshSpec`, a string such as "2x4", or a `jax.sharding.Mesh`.
    """
    return analyze_with_program(step_fn, mesh, *example_args)[0]


def analyze_with_program(step_fn: Callable, mesh, *example_args) -> tuple[Analysis, Program]:
    """Like `analyze`, also returning the captured `Program` (needed to apply a plan)."""
    t0 = time.perf_counter()
    spec = MeshSpec.of(mesh)
    program = capture(step_fn, *example_args)
    return analyze_program(program, AnalysisOptions(spec), started=t0), program
