"""Batching methods 0/1/3/4 side by side on the training engine: same data, same steps, same devices (8 CPU
devices), on two corpora of real text with different length distributions.

Corpora (`--corpora`, each INPUT[:UNIT] as `cfp data train --input/--unit` takes them): by default the
Python standard library split into top-level definitions (long-tailed source code) and its docstrings
(English prose, mostly short), both on any Python install. Per corpus the runs are: methods 0 and 1 on the
best single-scheme mix the fits find, method 3 with the per-step mix choice, method 4 on the
mix `cfp data propose` finds and with the per-step choice. The per-step candidates are `--mixes`
(Hydraulis' notation) plus the single-scheme mix of method 0 and the proposed mix, so the choice can always
fall back on either.

Each corpus runs in a process of its own (`_each_corpus_alone`: ten runs in one process slowed some of them down).
Within it steps are interleaved (step k of every run, then step k+1; the order reversed every other step), so a
change in machine load hits all runs alike; runs share one compile cache, and compiling a new micro-batch shape
is kept out of the timed step (`HeteroTrainer.warm`), as is the first move into each candidate mix (done before
the steps).
Every run of a corpus trains the same sequences at every step, so their losses must agree (checked and printed).
Printed per run (measured unless said otherwise): non-pad tokens/s over the steps (host assignment and layout
included), padding (every padded slot computed), the ratio to method 0 with
its per-step spread, the ratio of work (estimated FLOPs of what ran, per real token, method 0 / this), where the
time went (`cfp.data.breakdown`: measured; compute split by the fits' shares) and the estimated / measured span of
every pipeline in every step (median and range; the share within ±20% over all steps and over the second half,
once each scheme's fits have been rescaled by the steps before), and how many cores the steps kept busy (the
process's CPU seconds, all threads, over the steps' wall seconds: on a host where every device shares the same
cores, a method gains beyond its work ratio only by keeping more of them busy). Usage:

    python benchmarks/batching.py [--steps 6] [--tokens-per-step 8192] [--max-seq-len 1024]
    python benchmarks/batching.py --quick        # CI size: 2 steps of 1024 tokens, rows of 128, methods 0 and 4
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from cfp.cli.common import ensure_host_devices, patient_collectives  # noqa: E402

ensure_host_devices(8)
patient_collectives()

# per-step candidates on 8 CPU devices: under the 48 MiB budget (1,1,1) holds rows up to 512 tokens and (1,1,2)
# up to 1024, so each pairs pipelines of the cheapest scheme for short sequences with some for long ones
CPU_MIXES = ("[[(1,1,2),(1,1,1),(1,1,1),(1,1,1),(1,1,1),(1,1,1),(1,1,1)], "
             "[(1,1,2),(1,1,2),(1,1,1),(1,1,1),(1,1,1),(1,1,1)], [" + ",".join(["(1,1,1)"] * 8) + "]]")
# Linux's default vm.max_map_count; every compiled program maps memory, and the default runs compile enough
# programs (schemes x row shapes x devices) to pass it, where LLVM fails to allocate and the process crashes
DEFAULT_MAP_COUNT = 65530
CORPORA = "stdlib:definition,stdlib:docstring"
QUICK = {"steps": 2, "tokens_per_step": 1024, "max_seq_len": 128, "methods": "0,4", "proposed": False,
         "mixes": "[[(1,2,1),(1,2,1)], [(1,4,1)]]", "uniform": "[(1,4,1)]"}


@dataclasses.dataclass
class Run:
    corpus: str
    label: str
    method: object
    candidates: list
    opts: object
    trainer: object
    layouts: list
    records: list = dataclasses.field(default_factory=list)
    factors: dict = dataclasses.field(default_factory=dict)   # `cfp.data.rescale`, as `cfp data train`

    @property
    def real(self) -> int:
        return sum(r.real_tokens for r in self.records)

    @property
    def seconds(self) -> float:
        return sum(r.seconds for r in self.records)


def _load(corpus: str, max_seq_len: int):
    """A corpus INPUT[:UNIT], sequences cut at `max_seq_len`."""
    from cfp.data.sources import Unit, load_sequences
    path, _, unit = corpus.partition(":")
    return load_sequences(path, max_seq_len=max_seq_len, unit=Unit.parse(unit) if unit else None)


def _runs(args, space, corpus, data, cfg, cache) -> list[Run]:
    import jax

    from cfp.data import train
    from cfp.data.batching import get_method
    from cfp.runtime.engine import HeteroTrainer
    n = jax.device_count()
    given = train.with_fits(train.parse_mixes(args.mixes), space)
    uniform = (train.with_fits(train.parse_mixes(args.uniform), space)[0] if args.uniform else
               train.uniform_mix(space, data.lengths, n, args.tokens_per_step).pipelines())
    methods = [get_method(int(m)) for m in args.methods.split(",")]
    proposed = (train.propose(space, data.lengths, n, args.tokens_per_step).pipelines()
                if args.proposed and any(m.heterogeneous for m in methods) else None)
    runs = []
    for method in methods:
        number = method.number
        sets = []
        if not method.heterogeneous:
            sets.append(("uniform", [uniform]))
        if number == 4 and proposed:
            sets.append(("proposed", [proposed]))
        if method.heterogeneous:   # the choice can always fall back on the fixed mix and on the proposal
            cands = list(given)
            cands += [m for m in (uniform, proposed) if m and m not in cands]
            sets.append(("per step", cands))
        for label, cands in sets:
            opts = train.DataTrainOptions(args.model, method, args.steps, args.tokens_per_step,
                                          parallel_pipelines=space.parallel_pipelines, recalibrate=args.recalibrate)
            layouts = [train.layout_of(c, cfg.num_layers, n) for c in cands]
            trainer = HeteroTrainer(cache.model, None, layouts[0], opts.schedule, cache=cache).init()
            for layout in layouts[1:] + layouts[:1]:
                # the first move into a mix builds its stage programs: done here, like compiling, so that the
                # timed steps pay what a switch between mixes costs after that
                trainer.set_layout(layout)
            runs.append(Run(corpus, label, method, cands, opts, trainer, layouts))
            print(f"{corpus}: method {number} ({method.name}), {label}: "
                  + " | ".join(train.describe(c) for c in cands))
    return runs


def _flops_per(cfg) -> tuple[float, float]:
    """Estimated forward FLOPs per token slot and per attention score entry computed."""
    from cfp.costs import ModelCost
    cost = ModelCost(cfg)
    return (cfg.num_layers * cost.layer_token_flops(1) + cost.head_dot_flops(1) / cfg.seq_len,
            cfg.num_layers * cfg.num_heads * 4 * cfg.head_dim)


def _mb_work(lengths, packed: bool, per: tuple[float, float]) -> tuple[float, int, int]:
    """(estimated FLOPs, real slots, padded slots) of one micro-batch of sequences of `lengths` as laid out."""
    from cfp.data.breakdown import compute_parts
    p = compute_parts(list(lengths), packed)
    return (per[0] * (p["real_slots"] + p["pad_slots"]) + per[1] * (p["own"] + p["cross"] + p["pad_entries"]),
            p["real_slots"], p["pad_slots"])


def _work(cfg, run: Run, data) -> float:
    """Estimated forward FLOPs of what the run computed (token slots and attention score entries, padding and
    masked entries included), per real token."""
    from cfp.data.batching import Packing
    per, packed = _flops_per(cfg), run.method.packing is not Packing.PAD
    flops = 0.0
    for rec in run.records:
        lengths = data.lengths[list(rec.sequences)]
        flops += sum(_mb_work(lengths[list(mb)].tolist(), packed, per)[0] for mbs in rec.plan for mb in mbs)
    return flops / run.real


def work_bound(args, caps: list[int]) -> None:
    """--work-bound: per corpus and row cap, the padding (every padded slot computed) and the estimated work per
    real token of methods 0 and 4 on one pipeline whose micro-batches hold up to the cap's token slots, the
    balanced packing priced by FLOPs; steps drawn as `cfp data train` draws them. Nothing is trained and no fit
    is needed: the most method 4 can gain over method 0 from what it leaves uncomputed."""
    import numpy as np

    from cfp.data import train
    from cfp.data.batching import assign_step, get_method
    from cfp.data.schemes import CostForm, Scheme
    from cfp.models import get_config
    seed = train.DataTrainOptions(args.model, train.METHODS[0], 1, 1).seed
    print("| corpus | rows up to | padding m0 | padding m4 | work m0/m4 (estimated) |\n|---|---|---|---|---|")
    for corpus in args.corpora.split(","):
        whole = _load(corpus, None)
        for cap in caps:
            cfg = get_config(args.model, args.config, seq_len=cap)
            per = _flops_per(cfg)
            data = dataclasses.replace(whole, tokens=tuple(t[:cap + 1] for t in whole.tokens))   # as cut at cap
            scheme = Scheme(1, 1, 1, per[1], per[0], 0.0, cap, CostForm.ROWS)
            totals = {}
            for number in (0, 4):
                method, work = get_method(number), np.zeros(3)
                for step in range(args.steps):
                    lengths = data.lengths[train.step_sequences(data, step, seed, args.tokens_per_step)]
                    for mb in assign_step(method, [scheme], lengths)[0]:
                        work += _mb_work(lengths[mb].tolist(), number != 0, per)
                totals[number] = work
            pad = {k: f"{100 * w[2] / (w[1] + w[2]):.1f}%" for k, w in totals.items()}
            ratio = (totals[0][0] / totals[0][1]) / (totals[4][0] / totals[4][1])
            print(f"| {corpus} | {cap} | {pad[0]} | {pad[4]} | {ratio:.2f}x |")


def _step_all(runs, corpora, step):
    """Step `step` of every run, in the runs' order on even steps and reversed on odd ones (ABBA), so no run is
    always the first (in a fixed order, method 1 ran 1.3-1.4x method 0 at equal work on a loaded host)."""
    from cfp.data import train
    for r in (runs if step % 2 == 0 else runs[::-1]):
        # a full collection of a process holding hundreds of compiled programs takes up to 0.7 s here; left to
        # chance it lands in whichever run allocates past the threshold, at the same steps in every run
        gc.collect()
        st, rec = train.train_step(r.opts, corpora[r.corpus], r.trainer, r.candidates, r.layouts, step, r.factors)
        r.records.append(rec)
        r.factors = train.next_factors(r.opts, r.factors, r.candidates, rec)
        print(f"  step {step + 1} {r.corpus} method {r.method.number} {r.label}: "
              f"{train.describe(r.candidates[rec.mix])}, {rec.real_tokens} tokens, {rec.micro_batches} "
              f"micro-batches, {rec.seconds:.2f} s, loss {rec.loss:.4f}")


def _table(cfg, runs: list[Run], data, corpus: str) -> None:
    import numpy as np

    from cfp.data import train
    from cfp.data.breakdown import LABELS, PARTS
    mine = [r for r in runs if r.corpus == corpus]
    base = mine[0]
    w0 = _work(cfg, base, data)
    losses = np.array([[rec.loss for rec in r.records] for r in mine])
    spread = float(np.max(np.abs(losses - losses[0]) / np.abs(losses[0])))
    print(f"\n{corpus}: {len(data)} sequences, median {int(np.median(data.lengths))} tokens, "
          f"p90 {int(np.percentile(data.lengths, 90))}; losses of all runs equal step by step within "
          f"{spread:.1e} relative ({'ok' if spread <= 1e-4 else 'NOT EQUAL'}, tolerance 1e-4)")
    head = ["method", "mix", "tokens/s", "padding", "vs m0", "per-step range", "work m0/this"]
    head += [LABELS[k] for k in PARTS] + ["est/meas span", "within ±20% (all / 2nd half)", "cores busy"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in mine:
        tps = r.real / r.seconds
        ratios = [b.seconds / rec.seconds * rec.real_tokens / b.real_tokens
                  for b, rec in zip(base.records, r.records)]
        slots = sum(rec.slots for rec in r.records)
        parts = {k: sum(rec.summary()[k] for rec in r.records) for k in PARTS}
        total = sum(parts.values())
        acc = train.span_ratios(r.records)
        used = sorted({rec.mix for rec in r.records})
        strat = r.label + ": ran " + " and ".join(train.describe(r.candidates[i]) for i in used)
        row = [f"{r.method.number} {r.method.name}", strat, f"{tps:,.0f}", f"{100 * (1 - r.real / slots):.1f}%",
               f"{tps / (base.real / base.seconds):.2f}x", f"{min(ratios):.2f}-{max(ratios):.2f}",
               f"{w0 / _work(cfg, r, data):.2f}x"]
        row += [f"{100 * parts[k] / total:.0f}%" for k in PARTS]
        row += [f"{np.median(acc):.2f} ({min(acc):.2f}-{max(acc):.2f})" if acc else "n/a"]
        row += [f"{_within(r.records, 0.2):.0%} / {_within(r.records[len(r.records) // 2:], 0.2):.0%}"]
        row += [f"{train.cores_busy_over(r.records):.2f}"]
        print("| " + " | ".join(row) + " |")


def _within(records, tol: float) -> float:
    """Share of the pipelines that ran in `records`' steps whose estimated span is within ``tol`` of the measured."""
    from cfp.data.train import span_ratios
    acc = span_ratios(records)
    return sum(abs(a - 1) <= tol for a in acc) / len(acc) if acc else float("nan")


def _warn_map_count(args) -> None:
    """A full-size run passes Linux's default limit on mapped memory areas; say so before it crashes there."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            limit = int(f.read())
    except (OSError, ValueError):
        return
    if limit <= DEFAULT_MAP_COUNT and not args.quick:
        print(f"warning: vm.max_map_count is {limit}: a run of this size can pass it (LLVM then reports 'Cannot "
              "allocate memory' and the process crashes); raise it with `sysctl -w vm.max_map_count=1048576`",
              file=sys.stderr)


def _each_corpus_alone(names: list[str]) -> int:
    """Each corpus's runs in a process of their own, one after the other (a table compares methods within one
    corpus). With both corpora's ten runs in one process, method 4 on the same mix as method 0 ran 0.90-0.91x it
    over twelve steps in two runs (slower from the fourth step on), 1.03-1.04x with its corpus alone and in a
    process of its own (measured). The first process measures the fits where --schemes lacks them; the next
    read them there."""
    import subprocess
    for name in names:
        rc = subprocess.run([sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--corpora", name]).returncode
        if rc:
            return rc
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama2")
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--corpora", default=CORPORA, help=f"INPUT[:UNIT],... (default {CORPORA})")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--tokens-per-step", type=int, default=8192)
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ap.add_argument("--memory-mb", type=float, default=48.0)
    ap.add_argument("--schemes", default="parallel_scheme_space.json")
    ap.add_argument("--methods", default="0,1,3,4")
    ap.add_argument("--mixes", default=CPU_MIXES, help="per-step candidates of methods 3 and 4 (Hydraulis' "
                    "notation; default: three mixes of (1,1,2) and (1,1,1) pipelines)")
    ap.add_argument("--uniform", default=None,
                    help="the mix of methods 0 and 1 (default: the best single-scheme one the fits find)")
    ap.add_argument("--no-proposed", dest="proposed", action="store_false",
                    help="leave out method 4 on the proposed mix")
    ap.add_argument("--no-recalibrate", dest="recalibrate", action="store_false",
                    help="price every step with the fits as measured (as `cfp data train --no-recalibrate`)")
    ap.add_argument("--quick", action="store_true", help="CI size: " + ", ".join(f"{k} {v}" for k, v in QUICK.items()))
    ap.add_argument("--work-bound", metavar="CAPS", default=None,
                    help="only estimate, for row caps such as 1024,2048,4096, the padding and work of methods 0 and "
                         "4 over --steps steps of --tokens-per-step (no training)")
    args = ap.parse_args()
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    if args.work_bound is not None:
        try:
            caps = [int(c) for c in args.work_bound.split(",")]
        except ValueError:
            caps = []
        from cfp.data.rows import WIDTHS
        if not caps or any(c not in WIDTHS for c in caps):
            ap.error(f"--work-bound {args.work_bound!r} must be row widths such as 512,1024,2048,4096")
        return work_bound(args, caps)

    names = args.corpora.split(",")
    if len(names) > 1:
        sys.exit(_each_corpus_alone(names))

    import jax

    from cfp.data import train
    from cfp.data.scheme_space import reused_or_measured
    from cfp.models import get_config, init_params
    from cfp.models.layered import zoo_model
    from cfp.runtime.engine import adamw
    from cfp.runtime.stage.cache import CompileCache

    t0 = time.perf_counter()
    _warn_map_count(args)
    print(f"host load average at start: {' '.join(f'{x:.1f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)")
    cfg = get_config(args.model, args.config, seq_len=args.max_seq_len)
    params = init_params(args.model, cfg, 0)
    corpora = {c: _load(c, args.max_seq_len) for c in args.corpora.split(",")}
    named = train.parse_mixes(args.mixes) + (train.parse_mixes(args.uniform) if args.uniform else [])
    # every mix named (no proposal, no search of a uniform one): only their schemes are measured
    space = reused_or_measured(args.schemes, args.model, args.config, cfg, params, args.memory_mb,
                               shapes=train.shapes_of(named), only_shapes=bool(args.uniform and not args.proposed))
    print(f"scheme space: {space.source}; {space.parallel_pipelines} pipelines side by side at full speed")
    if args.uniform:    # method 0's mix must hold every sequence: cut them where it ends, as `cfp data train`
        cap = max(s.max_len for s in train.with_fits(train.parse_mixes(args.uniform), space)[0])
        if cap < args.max_seq_len:
            print(f"sequences cut at {cap} tokens, the longest {args.uniform} holds under the fits")
            corpora = {c: _load(c, cap) for c in corpora}
    defaults = train.DataTrainOptions(args.model, train.METHODS[0], 1, 1)   # the runs' optimizer settings
    cache = CompileCache(zoo_model(args.model, cfg, 0), adamw(defaults.learning_rate, defaults.weight_decay))
    runs = [r for c, data in corpora.items() for r in _runs(args, space, c, data, cfg, cache)]
    for step in range(args.steps):
        _step_all(runs, corpora, step)
    print(f"\nmeasured, {args.steps} interleaved steps x {args.tokens_per_step} tokens, {jax.device_count()} "
          f"{jax.devices()[0].platform} devices, {args.model} {args.config}, rows <= {args.max_seq_len}; compilation "
          f"excluded ({sum(r.trainer.warm_s for r in runs):.0f} s); 'work' is estimated (FLOPs of the slots and "
          "score entries computed); the time columns are measured, compute split by the fits' shares; 'cores busy' "
          f"is measured, the process's CPU seconds over the wall seconds of its steps ({os.cpu_count()} CPUs here)")
    for c, data in corpora.items():
        _table(cfg, runs, data, c)
    print(f"\nhost load average at end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}; "
          f"{time.perf_counter() - t0:.0f} s in all")


if __name__ == "__main__":
    main()
