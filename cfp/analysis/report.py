"""Human-readable reports of an `Analysis`, in the format of CFP's dumps."""
from __future__ import annotations

from pathlib import Path

from cfp.analysis.analysis import Analysis
from cfp.analysis.block_sharding import DimAxes
from cfp.files import write_text_atomic


def spec_text(spec: DimAxes) -> str:
    """`S0 R S01`-style: per dim R (replicated) or S followed by its mesh axes."""
    return " ".join("S" + "".join(map(str, axes)) if axes else "R" for axes in spec) or "scalar"


def parallel_blocks_text(analysis: Analysis, max_ops_per_block: int | None = 12) -> str:
    g = analysis.graph
    lines = []
    for b in analysis.blocks:
        lines.append(f"Parallel Block {b.index}:  [{'/'.join(b.scope)}]  strategies: {len(b.strategies)}")
        for d in b.dots:
            lines.append(f"    {g.operators[d.op].describe(g)}")
            # "Plan:" is the label of CFP's own ParallelBlock dump, kept so the files compare; it shows the loop map
            lines.append(f"    Plan: {', '.join('-' if p is None else str(p) for p in d.loop_map)},  ({d.role.value})")
        others = [i for i in b.operators if i not in {d.op for d in b.dots}]
        shown = others if max_ops_per_block is None else others[:max_ops_per_block]
        for i in shown:
            lines.append(f"    {g.operators[i].describe(g)}")
        if len(shown) < len(others):
            lines.append(f"    ... {len(others) - len(shown)} more operators")
    if analysis.remainder:
        lines.append(f"Remainder ({len(analysis.remainder)} operators in no block):")
        for i in analysis.remainder:
            op = g.operators[i]
            note = "  <- opaque control flow, not analysed" if op.opaque else ""
            lines.append(f"    {op.describe(g)}{note}")
    return "\n".join(lines)


def segments_text(analysis: Analysis) -> str:
    return "\n".join(f"ParallelBlocks sequence: ({s.start}, {s.stop}) mapped to  {s.mapped_to}"
                     + (f"  (scan body: runs {s.repeat} times per step)" if s.repeat > 1 else "")
                     for s in analysis.segments)


def strategy_map_text(analysis: Analysis) -> str:
    """Every operator with its strategies: dots in Alpa notation, other operators as their output layout."""
    g = analysis.graph
    lines = []
    for b in analysis.blocks:
        layouts = [analysis.layout(b.index, s).spec_of for s in range(len(b.strategies))]
        dots = {d.op for d in b.dots}
        for i in b.operators:
            op = g.operators[i]
            lines.append(f"Instruction {i}: {op.describe(g)}  (ParallelBlock {b.index})")
            for s in range(len(b.strategies)):
                if i in dots:
                    lines.append(f"Strategy {analysis.notation(b.index, s, dot=i)}")
                else:
                    out = op.outputs[0] if op.outputs else None
                    spec = layouts[s].get(out) if out is not None else None
                    lines.append(f"Strategy {s}: {spec_text(spec) if spec is not None else 'unconstrained'}")
    for i in analysis.remainder:
        lines.append(f"Instruction {i}: {g.operators[i].describe(g)}  (remainder: replicated)")
    return "\n".join(lines)


def summary_text(analysis: Analysis) -> str:
    g = analysis.graph
    covered = sum(len(b.operators) for b in analysis.blocks)
    return (f"operators: {len(g.operators)}  dots: {len(g.dots)}  ParallelBlocks: {len(analysis.blocks)}  "
            f"in blocks: {covered}  remainder: {len(analysis.remainder)}  opaque: {len(g.opaque_operators)}"
            + (f"  scans seen through: {len(g.loops)}" if g.loops else "") + "\n"
            f"segments: {len(analysis.segments)}  unique segments: {analysis.num_unique_segments}  "
            f"search space: {list(analysis.search_space)}")


def dump(analysis: Analysis, directory: str | Path) -> list[Path]:
    """Write parallel_blocks.txt, strategy_map.txt and analysis.json; returns the paths written."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    files = {
        "parallel_blocks.txt": parallel_blocks_text(analysis, None) + "\n" + segments_text(analysis) + "\n",
        "strategy_map.txt": strategy_map_text(analysis) + "\n",
        "analysis.json": analysis.to_json(),
    }
    out = []
    for name, text in files.items():
        out.append(d / name)
        write_text_atomic(out[-1], text)
    return out
