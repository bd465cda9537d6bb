"""A pipeline stage's forward and backward cut into the programs the schedules run -- F, the whole backward, and
its split into B and W -- from one traced program, so that each computes what it must and nothing twice.

The traced program is ``(params, x, batch, ct) -> (out, g_params, g_x)``: the stage's forward and its VJP in one
(`cfp.ir._jax_internals.trace_whole`: call-likes inlined, a ``scan``/``while`` kept as one equation), with
equations that repeat another's on the same operands merged (a backward cut from an analysed step recomputes its
forward: those copies are the forward's). Each value is classed by what it is: *forward* (what the output needs,
from the stage input ``x`` or the micro-batch), *parameter-only* (from neither, nor from ``ct``: a function of
the parameters and constants) or *backward* (the rest). Then, under a recompute policy
(`cfp.recompute.Recompute`):

* the forward values the backward needs are **kept** (``none``: all; ``selective``: the outputs of dots without
  batch dims, `jax.checkpoint_policies.dots_with_no_batch_dims_saveable`'s rule; ``full``: none) and F returns
  them -- the *residuals*, with the stage input's own leaves where the backward reads them; parameter-only values
  are never kept (they would be a copy of the parameters per micro-batch): the backward recomputes them;
* the whole backward runs every equation the parameter and input gradients need, from the residuals, recomputing
  the forward values not kept;
* B runs what the input gradient needs and, besides, every forward value W needs that was not kept, and hands W
  the values of its own that W reads (the cotangents at the parameter-consuming operations); W runs the rest:
  only backward and parameter-only equations, never the forward.

Everything here is a function of the traced program: the runtime (`cfp.runtime.stage.program`) evaluates the
cuts, the planner's cost facts read their sizes.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any, Iterable, Sequence

import numpy as np

from cfp.ir import _jax_internals as jxi
from cfp.recompute import Recompute


class Kind(enum.Enum):
    FORWARD = "forward"        # depends on the stage input or the micro-batch, not on the cotangent
    BACKWARD = "backward"      # depends on the cotangent
    PARAMETER = "parameter"    # depends on neither: a function of the parameters (and constants) alone


@dataclasses.dataclass(frozen=True)
class Groups:
    """How many flat inputs and outputs the traced program's groups have, in order: inputs ``params, x, batch,
    ct``; outputs ``out, g_params, g_x``."""
    params: int
    x: int
    batch: int
    ct: int
    out: int
    g_params: int
    g_x: int

    def inputs(self, prog: jxi.OptProgram) -> dict[str, tuple[int, ...]]:
        ids, out, at = prog.invars, {}, 0
        for name in ("params", "x", "batch", "ct"):
            n = getattr(self, name)
            out[name], at = tuple(ids[at:at + n]), at + n
        return out

    def outputs(self, prog: jxi.OptProgram) -> dict[str, tuple]:
        atoms, out, at = prog.outvars, {}, 0
        for name in ("out", "g_params", "g_x"):
            n = getattr(self, name)
            out[name], at = tuple(atoms[at:at + n]), at + n
        return out


@dataclasses.dataclass(frozen=True)
class StageSplit:
    """The cuts of one traced stage under one policy: equation indices (program order) and value ids.

    ``residuals``: what F returns for the backward; ``handoff``: what B returns for W; ``w_residuals`` /
    ``w_ct``: the residuals and cotangent inputs W reads (the dispatcher keeps them from B to W)."""
    prog: jxi.OptProgram
    groups: Groups
    policy: Recompute
    forward: tuple[int, ...]
    whole: tuple[int, ...]
    b: tuple[int, ...]
    w: tuple[int, ...]
    residuals: tuple[int, ...]
    handoff: tuple[int, ...]
    w_residuals: tuple[int, ...]
    w_ct: tuple[int, ...]

    def bytes_of(self, ids: Iterable[int]) -> int:
        """Bytes of the values ``ids`` (whole arrays, unsharded)."""
        total = 0
        for i in ids:
            shape, dtype = self.prog.avals[i]
            total += int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        return total

    @property
    def residual_bytes(self) -> int:
        """Bytes one micro-batch keeps from its F to its backward."""
        return self.bytes_of(self.residuals)

    @property
    def handoff_bytes(self) -> int:
        """Bytes one micro-batch keeps from its B to its W (B's handoff and the residuals and cotangents W
        reads)."""
        return self.bytes_of(self.handoff) + self.bytes_of(self.w_residuals) + self.bytes_of(self.w_ct)

    def recomputed(self, eqns: Sequence[int]) -> tuple[int, ...]:
        """The forward equations among ``eqns`` (what that program recomputes of F)."""
        kinds = _kinds(self.prog, self.groups)[1]
        return tuple(e for e in eqns if kinds[e] is Kind.FORWARD)


def split_stage(prog: jxi.OptProgram, groups: Groups, policy: Recompute) -> StageSplit:
    """Cut ``prog`` (the stage's forward and VJP, `Groups`) under ``policy`` (none, selective or full)."""
    policy = Recompute.policy(policy)
    prog = merged(prog)
    var_kind, eqn_kind = _kinds(prog, groups)
    ins, outs = groups.inputs(prog), groups.outputs(prog)
    producer = _producers(prog)
    kept = {v for v, k in var_kind.items() if k is Kind.FORWARD and v in producer
            and _keeps(policy, prog.eqns[producer[v]])} | set(ins["x"])
    given = set(ins["params"]) | set(ins["batch"]) | set(ins["ct"])
    targets = lambda name: [a[1] for a in outs[name] if a[0] == "var"]
    whole = _closure(prog, producer, targets("g_params") + targets("g_x"), given | kept)
    b0 = _closure(prog, producer, targets("g_x"), given | kept)
    w0 = _closure(prog, producer, targets("g_params"), given | kept | _defined(prog, b0))
    b = b0 | {e for e in w0 if eqn_kind[e] is Kind.FORWARD}          # W recomputes no forward value
    b = _closure(prog, producer, [v for e in b for v in prog.eqns[e].outvars if v is not None], given | kept)
    w = _closure(prog, producer, targets("g_params"), given | kept | _defined(prog, b))
    reads = lambda eqns, extra: _read(prog, eqns) | set(extra)
    residuals = tuple(sorted(kept & reads(whole, targets("g_params") + targets("g_x"))))
    w_reads = reads(w, targets("g_params"))
    forward = _closure(prog, producer, targets("out") + [v for v in residuals if v in producer], given | set(ins["x"]))
    return StageSplit(prog=prog, groups=groups, policy=policy, forward=_ordered(forward), whole=_ordered(whole),
                      b=_ordered(b), w=_ordered(w), residuals=residuals,
                      handoff=tuple(sorted(w_reads & _defined(prog, b))),
                      w_residuals=tuple(sorted(w_reads & set(residuals))),
                      w_ct=tuple(sorted(w_reads & set(ins["ct"]))))


def evaluate(prog: jxi.OptProgram, eqns: Sequence[int], env: dict[int, Any]) -> dict[int, Any]:
    """Bind ``eqns`` (program order) on ``env`` (value id -> value; the program's constants are added), in place."""
    for i, c in prog.consts.items():
        env.setdefault(i, c)
    for e in eqns:
        eqn = prog.eqns[e]
        vals = [a[1] if a[0] == "lit" else env[a[1]] for a in eqn.invars]
        for v, out in zip(eqn.outvars, jxi.bind_whole(eqn, vals)):
            if v is not None:
                env[v] = out
    return env


# ---------------------------------------------------------------------------------------------------------------
def _kinds(prog: jxi.OptProgram, groups: Groups) -> tuple[dict[int, Kind], list[Kind]]:
    """Each value's and each equation's `Kind`: parameter-only where no input but the parameters (and constants)
    reaches it, forward where the output needs it, backward otherwise."""
    ins, outs = groups.inputs(prog), groups.outputs(prog)
    moving = set(ins["x"]) | set(ins["batch"]) | set(ins["ct"])
    forward = _closure(prog, _producers(prog), [a[1] for a in outs["out"] if a[0] == "var"], set())
    var_kind = {v: Kind.FORWARD if v in ins["x"] or v in ins["batch"] else Kind.BACKWARD if v in moving
                else Kind.PARAMETER for v in prog.invars}
    for v in prog.consts:
        var_kind[v] = Kind.PARAMETER
    eqn_kind = []
    for e, eqn in enumerate(prog.eqns):
        kinds = {var_kind[a[1]] for a in eqn.invars if a[0] == "var"}
        k = (Kind.PARAMETER if kinds <= {Kind.PARAMETER} else Kind.FORWARD if e in forward else Kind.BACKWARD)
        eqn_kind.append(k)
        for v in eqn.outvars:
            if v is not None:
                var_kind[v] = k
    return var_kind, eqn_kind


def merged(prog: jxi.OptProgram) -> jxi.OptProgram:
    """``prog`` with every equation that repeats an earlier one (same primitive, parameters and operands) dropped
    and its results read from the earlier one's (equations whose parameters cannot be compared are kept)."""
    alias: dict[int, int] = {}
    seen: dict[Any, tuple] = {}
    eqns = []
    atom = lambda a: a if a[0] == "lit" else ("var", alias.get(a[1], a[1]))
    for eqn in prog.eqns:
        ins = tuple(atom(a) for a in eqn.invars)
        key = _eqn_key(eqn, ins)
        if key is not None and key in seen and len(seen[key]) == len(eqn.outvars):
            for v, w in zip(eqn.outvars, seen[key]):
                if v is not None and w is not None:
                    alias[v] = w
            if all(w is not None for v, w in zip(eqn.outvars, seen[key]) if v is not None):
                continue
        new = jxi.OptEqn(eqn.primitive, eqn.params, ins, eqn.outvars)
        eqns.append(new)
        if key is not None:
            seen.setdefault(key, eqn.outvars)
    outvars = tuple(atom(a) for a in prog.outvars)
    return jxi.OptProgram(prog.avals, prog.invars, outvars, tuple(eqns), prog.consts)


def _eqn_key(eqn: jxi.OptEqn, ins: tuple):
    """A hashable key of what ``eqn`` computes, or None where its parameters (or literals) are not hashable or it
    has effects (random number generators excepted: they are pure functions of their key)."""
    if getattr(eqn.primitive, "name", "") in _NEVER_MERGED:
        return None
    try:
        key = (eqn.primitive, tuple(sorted(eqn.params.items())), ins)
        hash(key)
    except TypeError:
        return None
    return key


_NEVER_MERGED = frozenset({"while", "cond", "scan", "shard_map", "custom_linear_solve", "pure_callback",
                           "io_callback", "debug_callback"})


def _keeps(policy: Recompute, eqn: jxi.OptEqn) -> bool:
    """Whether F keeps the forward value ``eqn`` produced for the backward under ``policy``."""
    if policy is Recompute.NONE:
        return True
    if policy is Recompute.SELECTIVE:
        return eqn.name == "dot_general" and not any(eqn.params["dimension_numbers"][1])
    return False


def _producers(prog: jxi.OptProgram) -> dict[int, int]:
    return {v: e for e, eqn in enumerate(prog.eqns) for v in eqn.outvars if v is not None}


def _closure(prog: jxi.OptProgram, producer: dict[int, int], targets: Iterable[int], given: set) -> set[int]:
    """The equations computing ``targets`` from the values ``given`` (and constants)."""
    seen: set[int] = set()
    todo = [v for v in targets if v not in given and v in producer]
    while todo:
        e = producer[todo.pop()]
        if e in seen:
            continue
        seen.add(e)
        todo.extend(a[1] for a in prog.eqns[e].invars
                    if a[0] == "var" and a[1] not in given and a[1] in producer)
    return seen


def _defined(prog: jxi.OptProgram, eqns: Iterable[int]) -> set[int]:
    return {v for e in eqns for v in prog.eqns[e].outvars if v is not None}


def _read(prog: jxi.OptProgram, eqns: Iterable[int]) -> set[int]:
    return {a[1] for e in eqns for a in prog.eqns[e].invars if a[0] == "var"}


def _ordered(eqns: set[int]) -> tuple[int, ...]:
    return tuple(sorted(eqns))
