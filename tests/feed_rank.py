"""One process of tests/test_feed_multiprocess.py (started by `cfp launch --nprocs 2 --devices-per-proc 4`): trains
test_feed's model on test_feed_share's crossing layout twice, from a generator yielding only this process's share
of each step (`cfp.process_share`) with verify, then from the list of whole global batches; writes what it fed and
got to ``<argv[1]>/rank<i>.json``."""
import json
import os
import sys

from cfp.runtime.launch import maybe_initialize_distributed

maybe_initialize_distributed()      # before any device use

import jax  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cfp  # noqa: E402
from cfp.runtime.stage.cache import CompileCache  # noqa: E402
from test_feed import STEPS, _batches, _model, _own_steps, _rel  # noqa: E402
from test_feed_share import CROSSING  # noqa: E402


def main(out: str) -> None:
    model, tx = _model(), optax.adamw(1e-2, weight_decay=0.1)
    batches, cache, quiet = _batches(STEPS), CompileCache(model, tx), lambda *a, **k: None
    share, fed = cfp.process_share(CROSSING), []

    def loader():                   # reads only this process's rows of each step
        for b in batches:
            mine = share.take(b)
            fed.append(int(mine["x"].shape[0]))
            yield mine
    mine = cfp.train_pipelines(model, tx, CROSSING, loader(), steps=STEPS, verify=True, cache=cache, log=quiet)
    whole = cfp.train_pipelines(model, tx, CROSSING, list(batches), steps=STEPS, cache=cache, log=quiet)
    own_losses, own_params = _own_steps(model, tx, batches)
    result = {"process": jax.process_index(), "processes": jax.process_count(), "fed_rows": fed,
              "pipelines": list(share.pipelines), "share_losses": [mine.losses[s] for s in range(1, STEPS + 1)],
              "whole_losses": [whole.losses[s] for s in range(1, STEPS + 1)], "own_losses": own_losses,
              "verify_ok": mine.verify_ok, "verify_error": mine.verify_error,
              "share_vs_own": _rel(mine.params, own_params), "whole_vs_share": _rel(whole.params, mine.params)}
    with open(os.path.join(out, f"rank{jax.process_index()}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
