"""One process of tests/test_first_collective.py (started by `cfp launch --nprocs 2 --devices-per-proc 4`): process
1 reaches each first cross-process collective -- a gather of stage trees (`gather_stages`), then a move from
process 0's first device to process 1's second (`comm.move`) -- ``argv[1]`` seconds after process 0, longer than
the 30 s in which XLA's gloo builds a clique's connections; prints what it got."""
import sys
import time

from cfp.runtime.launch import maybe_initialize_distributed

maybe_initialize_distributed()      # before any device use

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from cfp.runtime import comm  # noqa: E402
from cfp.runtime.host_state import gather_stages  # noqa: E402


def main(late_s: float) -> None:
    me = jax.process_index()
    like = jax.ShapeDtypeStruct((3,), jnp.float32)
    held = {(0, me): np.arange(3, dtype=np.float32) + 10 * me}
    if me == 1:
        time.sleep(late_s)
    trees = gather_stages([(0, 0), (0, 1)], held, lambda k: like, lambda k: k[1] == me)
    print(f"process {me} gathered {[t.tolist() for t in trees]}", flush=True)
    # process 1's second device: the gather above built the cliques of equal local indices ({0, 4}, ...)
    src, dst = jax.devices()[0], [d for d in jax.devices() if d.process_index == 1][1]
    if me == 1:
        time.sleep(late_s)
    x = jax.device_put(jnp.arange(3.0) + 100, src) if me == 0 else None
    out = comm.move(x, [src], [dst], NamedSharding(Mesh(np.array([dst]), ("d",)), P()), like)
    print(f"process {me} moved {None if out is None else np.asarray(out).tolist()}", flush=True)


if __name__ == "__main__":
    main(float(sys.argv[1]))
