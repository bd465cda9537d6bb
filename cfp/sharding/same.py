"""Whether two compiled steps lay out every array the same way: then a side-by-side ratio of them compares a
sharding with itself, and reports must say "same sharding" instead of a ratio."""
from __future__ import annotations

import jax


def placements(compiled) -> tuple[tuple[object, int], ...]:
    """(sharding, rank) of every input, then every output, of a compiled step (flattened pytree order)."""
    ins = zip(jax.tree_util.tree_leaves(compiled.input_shardings[0]),
              (len(a.shape) for a in jax.tree_util.tree_leaves(compiled.in_avals[0])))
    outs = ((o.sharding, len(o.shape)) for o in jax.tree_util.tree_leaves(compiled.out_info))
    return tuple(ins) + tuple(outs)


def same_sharding(a, b) -> bool:
    """Whether compiled steps `a` and `b` take and return arrays of the same ranks with equivalent shardings
    (`Sharding.is_equivalent_to`: the same devices hold the same pieces, however the specs are spelt)."""
    pa, pb = placements(a), placements(b)
    return len(pa) == len(pb) and all(ra == rb and sa.is_equivalent_to(sb, ra) for (sa, ra), (sb, rb) in zip(pa, pb))
