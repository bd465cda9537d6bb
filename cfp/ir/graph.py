"""The captured program as plain, immutable, JSON-serialisable data: tensors and operators."""
from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

from cfp.dtypes import hlo_name, itemsize


@dataclasses.dataclass(frozen=True)
class Tensor:
    """A value of the program: a flat input, a constant or an operator output."""

    id: int
    shape: tuple[int, ...]
    dtype: str

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.size * itemsize(self.dtype)

    def short(self) -> str:
        """HLO-style type, e.g. `f32[8,64]`."""
        return f"{hlo_name(self.dtype)}[{','.join(map(str, self.shape))}]"


@dataclasses.dataclass(frozen=True)
class DotDims:
    """dot_general dimension numbers: out dims are batch, then lhs free, then rhs free (JAX's order)."""

    lhs_contract: tuple[int, ...]
    rhs_contract: tuple[int, ...]
    lhs_batch: tuple[int, ...]
    rhs_batch: tuple[int, ...]


# The primitive re-emitted in front of an inlined differentiated remat (cfp/ir/_jax_internals.py): an identity
# on each operand (output k is operand k) that XLA may not look through.
BARRIER = "optimization_barrier"


@dataclasses.dataclass(frozen=True)
class Operator:
    """One primitive application. `inputs` holds tensor ids, or None for an inline literal."""

    index: int
    primitive: str
    inputs: tuple[int | None, ...]
    outputs: tuple[int | None, ...]
    scope: tuple[str, ...]
    source: str
    backward: bool           # produced by differentiation (a `transpose` transform in its name stack)
    opaque: bool = False     # control flow whose body cfp does not analyse (while, cond, shard_map, ...)
    dot: DotDims | None = None
    params: tuple[tuple[str, str], ...] = ()
    recomputed: bool = False  # a forward operation re-run in the backward pass under remat (jax.checkpoint)
    loop: int | None = None  # the innermost ScanLoop whose body holds it (None: top level, and its ports)

    @property
    def is_dot(self) -> bool:
        return self.dot is not None

    def param(self, name: str, default: str | None = None) -> str | None:
        return dict(self.params).get(name, default)

    def describe(self, graph: "OpGraph") -> str:
        """A one-line HLO-like rendering: `12 dot_general f32[8,64] = (t3 f32[8,32], t4 f32[32,64])`."""
        outs = ", ".join(graph.tensor(t).short() if t is not None else "_" for t in self.outputs)
        ins = ", ".join(f"t{t}:{graph.tensor(t).short()}" if t is not None else "lit" for t in self.inputs)
        extra = ""
        if self.dot:
            extra = (f" contract={self.dot.lhs_contract}x{self.dot.rhs_contract}"
                     f" batch={self.dot.lhs_batch}x{self.dot.rhs_batch}")
        return f"{self.index} {self.primitive} {outs} = ({ins}){extra}  [{'/'.join(self.scope)}]"


SCAN_PORTS = frozenset({"scan_enter", "scan_exit"})


@dataclasses.dataclass(frozen=True)
class ScanLoop:
    """A `lax.scan` seen through. Operators [start, stop) are its enter ports (one per body input: param
    `role` const, carry or xs), its body, run `length` times, and its exit ports (one per result: carry or
    ys); the stacked (xs, ys) leading dim is the iteration's and exists outside the body only."""

    index: int
    parent: int | None
    length: int
    enters: tuple[int, ...]
    exits: tuple[int, ...]
    start: int
    stop: int

    @property
    def body(self) -> range:
        return range(self.enters[-1] + 1 if self.enters else self.start,
                     self.exits[0] if self.exits else self.stop)


@dataclasses.dataclass(frozen=True)
class OpGraph:
    """A flat operator graph of a traced step: every operator with inputs, outputs and origin."""

    tensors: tuple[Tensor, ...]
    operators: tuple[Operator, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int | None, ...]
    input_paths: tuple[str, ...]
    output_paths: tuple[str, ...] = ()
    loops: tuple[ScanLoop, ...] = ()

    def loop_chain(self, loop: int | None) -> tuple[int, ...]:
        """`loop` and the loops around it, innermost first (empty at top level)."""
        chain = []
        while loop is not None:
            chain.append(loop)
            loop = self.loops[loop].parent
        return tuple(chain)

    def repeat(self, op: int) -> int:
        """How many times operator `op` runs per step: the product of the trip counts of the loops around it."""
        n = 1
        for lp in self.loop_chain(self.operators[op].loop):
            n *= self.loops[lp].length
        return n

    @functools.cached_property
    def _tensor_index(self) -> dict[int, Tensor]:
        return {t.id: t for t in self.tensors}

    def tensor(self, tid: int) -> Tensor:
        return self._tensor_index[tid]

    @functools.cached_property
    def producer(self) -> dict[int, int]:
        """tensor id -> index of the operator that produces it (flat inputs and constants have none)."""
        return {t: op.index for op in self.operators for t in op.outputs if t is not None}

    @functools.cached_property
    def consumers(self) -> dict[int, tuple[int, ...]]:
        out: dict[int, list[int]] = {}
        for op in self.operators:
            for t in op.inputs:
                if t is not None:
                    out.setdefault(t, []).append(op.index)
        return {k: tuple(v) for k, v in out.items()}

    @functools.cached_property
    def input_position(self) -> dict[int, int]:
        return {t: i for i, t in enumerate(self.inputs)}

    @property
    def dots(self) -> list[Operator]:
        return [op for op in self.operators if op.is_dot]

    @property
    def opaque_operators(self) -> list[Operator]:
        return [op for op in self.operators if op.opaque]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "OpGraph":
        tensors = tuple(Tensor(t["id"], tuple(t["shape"]), t["dtype"]) for t in d["tensors"])
        ops = []
        for o in d["operators"]:
            dot = DotDims(**{k: tuple(v) for k, v in o["dot"].items()}) if o.get("dot") else None
            ops.append(Operator(index=o["index"], primitive=o["primitive"], inputs=tuple(o["inputs"]),
                                outputs=tuple(o["outputs"]), scope=tuple(o["scope"]), source=o["source"],
                                backward=o["backward"], opaque=o["opaque"], dot=dot,
                                params=tuple(tuple(p) for p in o["params"]), recomputed=o.get("recomputed", False),
                                loop=o.get("loop")))
        loops = tuple(ScanLoop(lp["index"], lp["parent"], lp["length"], tuple(lp["enters"]), tuple(lp["exits"]),
                               lp["start"], lp["stop"]) for lp in d.get("loops", ()))
        return cls(tensors, tuple(ops), tuple(d["inputs"]), tuple(d["outputs"]), tuple(d["input_paths"]),
                   tuple(d.get("output_paths", ())), loops)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())
