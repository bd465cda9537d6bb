"""Python's garbage collector across training steps.

A step dispatches tens of arrays per micro-batch (a kept micro-batch's residuals), so the collector runs several
times a step, and each full collection rescans every object alive -- the traced and compiled programs, about
2e5 objects for a small zoo model: measured 20-26 ms per step of a 0.2 s step on this repository's 4-stage
Llama-2 layout (`benchmarks/compute_once.py`). Once the first step has traced and compiled, those objects live as
long as the run, so they are frozen out of the collector's scans (`gc.freeze`, as Megatron-LM's ``--manual-gc``
takes the collector off the step) and given back to it when the run ends.
"""
from __future__ import annotations

import contextlib
import gc
from typing import Callable, Iterator


@contextlib.contextmanager
def steady() -> Iterator[Callable[[], None]]:
    """Yields ``settle()``, called after each step: the first call collects and freezes the objects alive; exit
    unfreezes (every frozen object goes back to the collector's oldest generation)."""
    frozen = []

    def settle() -> None:
        if not frozen:
            gc.collect()
            gc.freeze()
            frozen.append(True)

    try:
        yield settle
    finally:
        if frozen:
            gc.unfreeze()
