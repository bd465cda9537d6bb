"""Collective communication times: the one model every cost estimate in cfp uses.

Ring algorithms on a group of n devices with per-direction link bandwidth `bw` (bytes/s): all-reduce
2(n-1)/n·B/bw, all-gather / reduce-scatter / all-to-all (n-1)/n·B/bw, collective-permute B/bw, where B is the
per-device bytes of the (larger) buffer.
"""
from __future__ import annotations


def collective_time(kind: str, nbytes: float, n: int, link_bytes_per_s: float) -> float:
    """Seconds of one collective of `kind` ("all-reduce", "all-gather", ...) over `n` devices."""
    if n <= 1:
        return 0.0
    if kind == "all-reduce":
        factor = 2 * (n - 1) / n
    elif kind == "collective-permute":
        factor = 1.0
    else:
        factor = (n - 1) / n
    return factor * nbytes / link_bytes_per_s
