"""`cfp data train`: variable-length training with a batching method on this machine's devices.

Each step draws sequences (shuffled, seeded by (seed, step)) until `tokens_per_step` real tokens, assigns them
with the method (cfp.data.batching), and runs the pipelines with cfp.runtime.varlen. Uniform methods (0, 1)
use the best single-scheme strategy the proposal DP finds for the same scheme space; heterogeneous ones
(3, 4) use the proposed (or given) heterogeneous strategy.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import numpy as np

from cfp.data.batching import METHODS, Method, Packing, assign_step, materialize
from cfp.data.propose import Strategy, propose
from cfp.data.schemes import SchemeSpace
from cfp.data.sources import Sequences
from cfp.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class DataTrainOptions:
    model: str
    method: Method
    steps: int
    tokens_per_step: int
    learning_rate: float = 1e-3
    seed: int = 0
    ilp_max_sequences: int = 0

    def __post_init__(self):
        if self.method not in METHODS.values():
            raise ConfigError(f"method {self.method!r} is not a registered batching method")
        for f in ("steps", "tokens_per_step"):
            if getattr(self, f) < 1:
                raise ConfigError(f"{f}={getattr(self, f)!r} must be a positive integer")


@dataclasses.dataclass(frozen=True)
class DataTrainResult:
    losses: tuple[float, ...]
    real_tokens: int
    slots: int
    seconds: float           # measured step time, compilation excluded
    compile_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.real_tokens / self.seconds

    @property
    def padding(self) -> float:
        return 1.0 - self.real_tokens / self.slots


def uniform_strategy(space: SchemeSpace, lengths, gpus: int, tokens_per_step: int) -> Strategy:
    """Best strategy using one scheme only (what a fixed-strategy system would run)."""
    best = None
    for s in space.schemes:
        if s.max_len < np.max(lengths) or s.devices > gpus:
            continue
        one = SchemeSpace(space.model, space.config, space.source, (s,))
        st = propose(one, lengths, gpus, tokens_per_step)
        if best is None or st.estimated_step_s < best.estimated_step_s:
            best = st
    if best is None:
        raise ConfigError(f"no single scheme holds the longest sequence ({int(np.max(lengths))} tokens)")
    return best


def step_sequences(data: Sequences, step: int, seed: int, tokens_per_step: int) -> np.ndarray:
    """Indices of this step's sequences: a seeded shuffle, cut when the real tokens reach the budget."""
    order = np.random.default_rng([seed, step]).permutation(len(data))
    lens = data.lengths[order]
    n = int(np.searchsorted(np.cumsum(lens), tokens_per_step)) + 1
    return order[:min(n, order.size)]


def use_strategy(trainer, strategy: Strategy) -> None:
    """Place the strategy's pipelines on consecutive devices and switch the trainer to them."""
    from cfp.runtime.varlen import place_pipelines
    trainer.set_pipelines(place_pipelines([(s.cp, s.tp) for s in strategy.pipelines()], _devices()))


def train_step(opts: DataTrainOptions, data: Sequences, trainer, strategy: Strategy, step: int):
    """Draw, assign, materialise and run one step; (StepStats, number of micro-batches)."""
    pipes = strategy.pipelines()
    ids = step_sequences(data, step, opts.seed, opts.tokens_per_step)
    plan = assign_step(opts.method, pipes, data.lengths[ids], opts.ilp_max_sequences)
    packed = opts.method.packing is not Packing.PAD
    mbs = [[materialize(data.tokens, [int(ids[i]) for i in mb], packed, pipes[k].max_len) for mb in p]
           for k, p in enumerate(plan)]
    return trainer.step(mbs), sum(len(p) for p in plan)


def run(opts: DataTrainOptions, data: Sequences, trainer, strategy: Strategy,
        log: Optional[Callable[[str], None]] = print) -> DataTrainResult:
    use_strategy(trainer, strategy)
    losses, real, slots, secs = [], 0, 0, 0.0
    for step in range(opts.steps):
        st, n_mb = train_step(opts, data, trainer, strategy, step)
        losses.append(st.loss)
        real, slots, secs = real + st.real_tokens, slots + st.padded_tokens, secs + st.seconds
        if log:
            log(f"step {step + 1}: loss {st.loss:.4f}  {st.real_tokens} tokens in "
                f"{n_mb} micro-batches  non-pad tokens/s: {st.real_tokens / st.seconds:.0f}  "
                f"padding: {100 * (1 - st.real_tokens / st.padded_tokens):.1f}%  (measured)")
    return DataTrainResult(tuple(losses), real, slots, secs, trainer.compile_s)


def _devices() -> int:
    import jax
    return jax.device_count()
