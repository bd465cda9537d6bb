"""Length statistics of a sequence set: histogram, percentiles and the padding waste of naive batching."""
from __future__ import annotations

import dataclasses
import math
import os

import numpy as np

from cfp.errors import ConfigError
from cfp.files import write_json_atomic

PERCENTILES = (50, 75, 90, 95, 99, 100)


def _rounded_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def bucket_len(n: int, multiple: int = 64) -> int:
    """Padded length used to bound compiles: a power of two up to `multiple`, then a multiple of it."""
    if n <= multiple:
        return 1 << max(0, math.ceil(math.log2(max(n, 1))))
    return _rounded_up(n, multiple)


@dataclasses.dataclass(frozen=True)
class LengthReport:
    """What `cfp data analyze` saves: counts, percentiles, histogram and padding waste (all measured)."""
    source: str
    num_sequences: int
    total_tokens: int
    max_seq_len: int
    percentiles: dict
    hist_edges: tuple
    hist_counts: tuple
    padding_waste_pad_to_max: float    # every sequence padded to the longest in the data set
    padding_waste_batch_max: float     # batches of `batch_size` in data order padded to their longest

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def padding_waste(lengths: np.ndarray, batch_size: int) -> float:
    """Fraction of padded token slots when consecutive batches of `batch_size` pad to their own longest."""
    lengths = np.asarray(lengths, np.int64)
    slots = sum(int(lengths[i:i + batch_size].max()) * lengths[i:i + batch_size].size
                for i in range(0, lengths.size, batch_size))
    return 1.0 - lengths.sum() / slots


def analyze_lengths(lengths, source: str = "", batch_size: int = 8, bins: int = 40) -> LengthReport:
    lengths = np.asarray(lengths, np.int64)
    if lengths.size == 0 or lengths.min() < 1:
        raise ConfigError("analyze needs at least one sequence, each of length >= 1")
    if batch_size < 1:
        raise ConfigError(f"batch_size={batch_size!r} must be a positive integer")
    # log-spaced bins show a long tail; linear would put almost everything in the first bin
    edges = np.unique(np.geomspace(1, lengths.max() + 1, bins + 1).astype(np.int64))
    counts, edges = np.histogram(lengths, bins=edges)
    longest = int(lengths.max())
    return LengthReport(
        source=source, num_sequences=int(lengths.size), total_tokens=int(lengths.sum()), max_seq_len=longest,
        percentiles={str(p): float(np.percentile(lengths, p)) for p in PERCENTILES},
        hist_edges=tuple(int(e) for e in edges), hist_counts=tuple(int(c) for c in counts),
        padding_waste_pad_to_max=float(1.0 - lengths.sum() / (longest * lengths.size)),
        padding_waste_batch_max=float(padding_waste(lengths, batch_size)))


def save_report(report: LengthReport, out_dir: str) -> tuple[str, str]:
    """Write lengths.json and lengths.png (log-x histogram with percentile marks) into `out_dir`."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    jpath, ppath = os.path.join(out_dir, "lengths.json"), os.path.join(out_dir, "lengths.png")
    write_json_atomic(jpath, report.to_json())
    fig, ax = plt.subplots(figsize=(7, 4))
    e = np.array(report.hist_edges)
    ax.bar(e[:-1], report.hist_counts, width=np.diff(e), align="edge", edgecolor="k", linewidth=0.3)
    ax.set_xscale("log")
    for p, v in report.percentiles.items():
        ax.axvline(v, color="r", lw=0.6, ls="--")
        ax.text(v, ax.get_ylim()[1] * 0.95, f"p{p}", rotation=90, fontsize=7, va="top")
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("sequences")
    ax.set_title(f"{report.source}: {report.num_sequences} sequences (measured); pad-to-max waste "
                 f"{100 * report.padding_waste_pad_to_max:.1f}%", fontsize=8)
    fig.tight_layout()
    fig.savefig(ppath, dpi=110)
    plt.close(fig)
    return jpath, ppath
