"""`cfp data`: variable-length data (Hydraulis): analyze lengths, build the scheme space, propose mixes,
train with a batching method, and time the planner at scale.

    cfp data analyze --input stdlib --max-seq-len 2048
    cfp data schemes --model llama2 --config 32B --gpu A100-SXM-80G --out parallel_scheme_space.json
    cfp data propose --schemes parallel_scheme_space.json --input stdlib --gpus 64 --tokens-per-step 262144
    cfp data train --model llama2 --config tiny --input stdlib --batching-method 4 --steps 5
    cfp data train --model llama2 --config tiny --input stdlib --batching-method 4 --steps 4 --verify \
        --mixes "[[(1,2,2),(2,1,1),(1,2,1)], [(1,4,2)]]"
    cfp data bench-planner --gpus 1024 --model llama2 --config 32B --tokens-per-step 1600000 --max-seq-len 32768
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time

from cfp.cli import common
from cfp.cli.common import ensure_host_devices, patient_collectives, positive_int
from cfp.models.configs import MODEL_NAMES


def _input_options(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("--input", required=required, default=None if required else "stdlib",
                   help='"stdlib" (the Python standard library sources), a .jsonl file or a folder of text files')
    p.add_argument("--key", default="text", help="JSONL field holding the text (default: text)")
    p.add_argument("--unit", choices=("document", "definition", "docstring"), default=None,
                   help="sequence unit: a whole document, each top-level def/class of Python source, or each "
                        "docstring of Python source (English prose) (default: definition for stdlib, document "
                        "otherwise)")
    p.add_argument("--split", action="store_true", help="cut over-long units into pieces instead of truncating")


def _load(args, max_seq_len):
    from cfp.data.sources import Unit, load_sequences
    unit = Unit.parse(args.unit) if args.unit else None
    return load_sequences(args.input, args.key, max_seq_len, unit=unit, split=args.split)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("data", help="variable-length data: analyze lengths, build schemes, propose "
                              "mixes, train, time the planner", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="data_command", required=True, metavar="ACTION", parser_class=type(p))
    _analyze_parser(sub)
    _schemes_parser(sub)
    _propose_parser(sub)
    _train_parser(sub)
    _bench_parser(sub)
    return p


def _analyze_parser(sub) -> None:
    a = sub.add_parser("analyze", help="length histogram, percentiles and padding waste (PNG + JSON)")
    _input_options(a)
    a.add_argument("--max-seq-len", type=positive_int, default=None,
                   help="truncate (or with --split, cut) longer units (default: no limit)")
    a.add_argument("--batch-size", type=positive_int, default=8, help="naive batch size for the waste figure")
    a.add_argument("--out", default="data_analysis", help="output folder (lengths.json, lengths.png)")
    a.set_defaults(func=run, action=run_analyze, out_dirs={"out": "--out"})


def _schemes_parser(sub) -> None:
    s = sub.add_parser("schemes", help="per <CP,TP,PP>: fitted time a·s²+b·s+c and longest sequence")
    common.add_model(s)
    common.add_config(s)
    common.add_gpu(s, None, "estimate with the cost model of this GPU (default: measure on this machine)")
    s.add_argument("--max-devices", type=positive_int, default=64, help="largest scheme (cost model)")
    s.add_argument("--mfu", type=common.positive_float, default=0.5,
                   help="model FLOPs utilisation assumed by the cost model")
    s.add_argument("--max-seq-len", type=positive_int, default=2048, help="measure: longest sequence considered")
    s.add_argument("--memory-mb", type=common.positive_float, default=48.0,
                   help="measure: memory budget per device (MiB)")
    s.add_argument("--out", default="parallel_scheme_space.json", help="scheme-space JSON to write")
    s.set_defaults(func=run, action=run_schemes, out_files={"out": "--out"})


def _propose_parser(sub) -> None:
    q = sub.add_parser("propose", help="heterogeneous mixes for a length distribution (DP)")
    q.add_argument("--schemes", required=True, help="scheme-space JSON from `cfp data schemes`")
    _input_options(q)
    q.add_argument("--gpus", type=positive_int, required=True, help="GPUs the mix may use")
    q.add_argument("--tokens-per-step", type=positive_int, required=True, help="tokens in one training step")
    q.add_argument("--max-seq-len", type=positive_int, default=None,
                   help="truncate longer sequences (default: the schemes' longest)")
    q.add_argument("--out", default="mixes.json", help="mix JSON to write")
    q.set_defaults(func=run, action=run_propose, out_files={"out": "--out"})


def _train_parser(sub) -> None:
    t = sub.add_parser("train", help="train with a batching method on this machine's devices")
    common.add_model(t, choices=("llama2", "gpt", "moe"))
    common.add_config(t)
    _input_options(t)
    t.add_argument("--batching-method", type=int, choices=(0, 1, 3, 4), default=4,
                   help="0: pad to the longest, 1: pack, 3: heterogeneous mix, 4: heterogeneous with "
                        "fine-grained packing")
    common.add_steps(t)
    t.add_argument("--tokens-per-step", type=positive_int, default=16384, help="tokens in one training step")
    t.add_argument("--max-seq-len", type=positive_int, default=2048, help="longest sequence (longer ones are cut)")
    t.add_argument("--mixes", "--strategies", default=None,
                   help="mix JSON from `cfp data propose`, or Hydraulis' notation: a list of mixes (Hydraulis' "
                        "strategies, hence the flag's other name), "
                        "each a list of (cp, tp, pp) pipelines, e.g. \"[[(1,2,2),(2,1,1),(1,2,1)], [(1,4,2)]]\"; "
                        "each step runs the one the fitted costs rate fastest (default: proposed here)")
    t.add_argument("--schemes", default="parallel_scheme_space.json",
                   help="scheme-space JSON; measured here (the schemes missing from it) and written to this path "
                        "if it is missing or was made for another model/config (default: parallel_scheme_space.json)")
    t.add_argument("--memory-mb", type=common.positive_float, default=48.0,
                   help="memory budget per device when measuring (MiB)")
    t.add_argument("--ilp-max-sequences", type=common.non_negative_int, default=0,
                   help="steps with at most this many sequences also try the dispatch ILP (HiGHS, 0.5 s limit)")
    t.add_argument("--no-recalibrate", dest="recalibrate", action="store_false",
                   help="price every step with the fits as measured (default: each scheme's fits rescaled by its "
                        "pipelines' measured spans in the steps before)")
    common.add_schedule(t)
    common.add_optimizer(t)
    common.add_seed(t)
    t.add_argument("--verify", action="store_true",
                   help="replay every step on one device (each sequence alone, reference AdamW) and compare the "
                        "losses and the final parameters")
    t.add_argument("--verbose", action="store_true",
                   help="print every step's time per pipeline (host, compute on real tokens / padding / "
                        "cross-sequence attention / per micro-batch, bubble, idle, gradient sync) and its "
                        "estimated span")
    t.set_defaults(func=run, action=run_train, out_files={"schemes": "--schemes"})


def _bench_parser(sub) -> None:
    b = sub.add_parser("bench-planner", help="time the proposal DP and the per-step assignment at scale")
    b.add_argument("--gpus", type=positive_int, default=1024, help="GPUs of the simulated cluster")
    common.add_model(b, required=False, default="llama2")
    common.add_config(b, default="32B")
    common.add_gpu(b, common.DEFAULT_CATALOG_GPU, "GPU of the cost model")
    b.add_argument("--tokens-per-step", type=positive_int, default=1_600_000, help="tokens in one training step")
    b.add_argument("--max-seq-len", type=positive_int, default=32768, help="longest synthetic sequence")
    b.add_argument("--sequences", type=positive_int, default=100_000,
                   help="sequences of the large step also timed (the goal: 10^5 in < 300 ms CPU)")
    common.add_steps(b, help="timed repetitions of the per-step assignment")
    common.add_seed(b, help="seed of the synthetic lengths")
    b.set_defaults(func=run, action=run_bench_planner)


def run(args) -> int:
    """Every action: its output paths are checked before any work, then it runs."""
    common.check_outputs(args, files_=getattr(args, "out_files", None), dirs=getattr(args, "out_dirs", None))
    return args.action(args)


def run_analyze(args) -> int:
    from cfp.data.lengths import analyze_lengths, save_report
    seqs = _load(args, args.max_seq_len)
    rep = analyze_lengths(seqs.lengths, args.input, args.batch_size)
    jpath, ppath = save_report(rep, args.out)
    pc = "  ".join(f"p{k} {v:.0f}" for k, v in rep.percentiles.items())
    print(f"{rep.num_sequences} sequences, {rep.total_tokens} tokens (measured on {args.input})")
    print(f"length percentiles: {pc}")
    print(f"padding waste: pad to longest {100 * rep.padding_waste_pad_to_max:.1f}%, batches of "
          f"{args.batch_size} padded to their longest {100 * rep.padding_waste_batch_max:.1f}%")
    print(f"wrote {jpath} and {ppath}")
    return 0


def run_schemes(args) -> int:
    from cfp.data import scheme_space
    from cfp.models import get_config
    if args.gpu:
        cfg = get_config(args.model, args.config)
        space = scheme_space.estimate_space(args.model, args.config, cfg, args.gpu, args.max_devices, args.mfu)
    else:
        ensure_host_devices(8)
        patient_collectives()
        from cfp.models import init_params
        cfg = get_config(args.model, args.config, seq_len=args.max_seq_len)
        space = scheme_space.measure_space(args.model, args.config, cfg, init_params(args.model, cfg, 0),
                                           args.memory_mb, log=print)
    space.save(args.out)
    print(f"{len(space.schemes)} schemes ({space.source}); wrote {args.out}")
    for s in space.schemes:
        form = "E" if s.form.value == "rows" else "s²"
        print(f"  {s.name}: {s.a:.3g}·{form} + {s.b:.3g}·{'R·W' if form != 's²' else 's'} + {s.c:.3g} s per "
              f"micro-batch, max_len {s.max_len}")
    return 0


def run_propose(args) -> int:
    from cfp.data.propose import propose
    from cfp.data.schemes import SchemeSpace
    space = SchemeSpace.load(args.schemes)
    seqs = _load(args, args.max_seq_len or space.longest)
    _check_gpus(space, int(max(seqs.lengths)), args.gpus, args.schemes)
    t0 = time.perf_counter()
    st = propose(space, seqs.lengths, args.gpus, args.tokens_per_step)
    dt = time.perf_counter() - t0
    st.save(args.out)
    print(f"mix on {st.devices} of {args.gpus} GPUs: {st.describe()}")
    print(f"estimated step time: {st.estimated_step_s:.4g} s ({space.source})")
    print(f"proposal time: {dt:.2f} s (measured); wrote {args.out}")
    return 0


def _check_gpus(space, longest: int, gpus: int, path: str) -> None:
    """--gpus must afford a scheme, and a scheme that holds the longest sequence: say which values would do."""
    from cfp.errors import ConfigError
    smallest = min(s.devices for s in space.schemes)
    if gpus < smallest:
        raise ConfigError(f"--gpus {gpus} is too few: the smallest scheme in {path!r} needs {smallest} GPUs; "
                          f"give --gpus {smallest} or more")
    holding = [s for s in space.schemes if s.max_len >= longest]
    if not holding:
        raise ConfigError(f"the longest sequence ({longest} tokens) fits no scheme in {path!r} (longest "
                          f"capacity {space.longest}); give --max-seq-len {space.longest} or less")
    best = min(holding, key=lambda s: (s.devices, -s.max_len))
    if gpus < best.devices:
        cap = max(s.max_len for s in space.schemes if s.devices <= gpus)
        raise ConfigError(f"--gpus {gpus} is too few for the longest sequence ({longest} tokens): the smallest "
                          f"scheme that holds it, {best.name}, needs {best.devices} GPUs; give --gpus "
                          f"{best.devices} or more, or --max-seq-len {cap} or less")


def run_train(args) -> int:
    from cfp.runtime.launch import maybe_initialize_distributed
    patient_collectives()
    maybe_initialize_distributed()  # before any device use: the job of `cfp launch` or the cluster's launcher
    ensure_host_devices(8)
    import jax

    from cfp.data import train
    from cfp.data.batching import get_method
    from cfp.data.breakdown import format_summary
    from cfp.models import get_config, init_params
    from cfp.runtime.engine import zoo_trainer
    from cfp.schedules.registry import ScheduleSpec

    method = get_method(args.batching_method)
    cfg = get_config(args.model, args.config, seq_len=args.max_seq_len)
    if args.verify:
        train.check_verifiable(args.model, cfg)      # before any scheme is measured or step run
    seqs = _load(args, args.max_seq_len)
    params = init_params(args.model, cfg, args.seed)
    candidates, parallel = _candidates(args, method, cfg, params, seqs)
    cap = max(s.max_len for pipes in candidates for s in pipes)
    if cap < int(seqs.lengths.max()):   # given mixes: no pipeline holds the longest sequences
        print(f"sequences cut at {cap} tokens, the longest any pipeline of the mixes holds under the "
              f"scheme fits (--max-seq-len {args.max_seq_len}, --memory-mb {args.memory_mb})")
        seqs = _load(args, cap)
    for i, pipes in enumerate(candidates):
        print(f"method {method.number} ({method.name}); mix {i}: {train.describe(pipes)}")
    opts = train.DataTrainOptions(model=args.model, method=method, steps=args.steps,
                                  tokens_per_step=args.tokens_per_step, learning_rate=args.lr, seed=args.seed,
                                  ilp_max_sequences=args.ilp_max_sequences, weight_decay=args.weight_decay,
                                  schedule=ScheduleSpec.parse(args.schedule),
                                  parallel_pipelines=parallel, recalibrate=args.recalibrate)
    layout0 = train.layout_of(candidates[0], cfg.num_layers, jax.device_count())
    trainer = zoo_trainer(args.model, cfg, layout0, opts.schedule, learning_rate=args.lr,
                          weight_decay=args.weight_decay, seed=args.seed).init()
    init_state = trainer.state()[:2] if args.verify else None
    res = train.run(opts, seqs, trainer, candidates, verbose=args.verbose)
    print(f"non-pad tokens/s: {res.tokens_per_s:.0f}  (measured over {args.steps} steps, "
          f"{res.seconds:.2f} s with the host's assignment and layout; compilation {res.compile_s:.1f} s excluded)")
    print(f"padding: {100 * res.padding:.1f}% of the token slots computed (bucket rounding and padding rows "
          "included; measured)")
    print(f"time: {format_summary(res.breakdown())} (measured; compute split by the fits' shares)")
    print(f"estimated / measured pipeline span: {train.estimate_accuracy(res)} (per pipeline and step)")
    if jax.devices()[0].platform == "cpu":   # devices sharing the host's cores: idle time is lost only if they idle
        print(f"cores busy: {res.cores_busy:.2f} of the {train.usable_cores()} this process may use (measured: its "
              "CPU seconds over the steps' wall seconds)")
    if args.verify:
        err, ok = train.verify_run(opts, seqs, cfg, init_state, res, trainer.state()[0])
        print(f"verify: max relative error {err:.3e} over {len(res.steps)} steps "
              f"({'ok' if ok else 'ABOVE'} tolerance {train.verify_tolerance(cfg):g})")
        return 0 if ok else 1
    return 0


def _candidates(args, method, cfg, params, seqs) -> tuple[list, float | None]:
    """The candidate mixes (per pipeline its fitted scheme): given (Hydraulis' notation or a proposal's
    JSON) or proposed here from the measured scheme space; with the space's `parallel_pipelines`."""
    import jax

    from cfp.data import train
    from cfp.data.propose import SchemeMix
    from cfp.data.scheme_space import reused_or_measured
    given = train.load_mixes(args.mixes) if args.mixes else None
    if isinstance(given, SchemeMix):
        return [given.pipelines()], None
    space = reused_or_measured(args.schemes, args.model, args.config, cfg, params, args.memory_mb,
                               shapes=train.shapes_of(given) if given else (), only_shapes=bool(given))
    if given:
        return train.with_fits(given, space), space.parallel_pipelines
    propose_fn = train.propose if method.heterogeneous else train.uniform_mix
    return ([propose_fn(space, seqs.lengths, jax.device_count(), args.tokens_per_step).pipelines()],
            space.parallel_pipelines)


def run_bench_planner(args) -> int:
    import numpy as np

    from cfp.data.batching import METHODS, assign_step
    from cfp.data.propose import propose
    from cfp.data.scheme_space import estimate_space
    from cfp.models import get_config

    cfg = get_config(args.model, args.config)
    space = estimate_space(args.model, args.config, cfg, args.gpu, max_devices=min(64, args.gpus))
    rng = np.random.default_rng(args.seed)
    # synthetic long tail: log-normal lengths (median ~1.1K, mean ~3K tokens), cut at max_seq_len
    lengths = np.clip(rng.lognormal(7.0, 1.4, max(200_000, 2 * args.sequences)).astype(np.int64), 16,
                      args.max_seq_len)
    t0 = time.perf_counter()
    st = propose(space, lengths, args.gpus, args.tokens_per_step)
    t_prop = time.perf_counter() - t0
    pipes = st.pipelines()
    times, counts = [], []
    for step in range(args.steps):
        ids = rng.permutation(lengths.size)
        n = int(np.searchsorted(np.cumsum(lengths[ids]), args.tokens_per_step)) + 1
        step_lens = lengths[ids[:n]]
        times.append(_timed(lambda: assign_step(METHODS[4], pipes, step_lens)))
        counts.append(n)
    print(f"mix on {st.devices} GPUs: {st.describe()}")
    print(f"estimated step time: {st.estimated_step_s:.3f} s ({space.source})")
    print(f"proposal time: {t_prop:.2f} s (measured)")
    cpu, wall = np.median(times, axis=0) * 1e3
    print(f"per-step assignment time: {cpu:.1f} ms CPU, {wall:.1f} ms wall (measured, median of {args.steps} "
          f"steps of ~{int(np.mean(counts))} sequences; dispatch + fine-grained packing)")
    big = []
    for _ in range(args.steps):   # the goal's size: 10^5 sequences in one step (ByteScale's scale), same mix
        step_lens = lengths[rng.permutation(lengths.size)[:args.sequences]]
        big.append(_timed(lambda: assign_step(METHODS[4], pipes, step_lens)))
    cpu, wall = np.median(big, axis=0) * 1e3
    print(f"per-step assignment time for {args.sequences} sequences: {cpu:.1f} ms CPU, {wall:.1f} ms wall "
          f"(measured, median of {args.steps}; goal < 300 ms CPU for 10^5: {'met' if cpu < 300 else 'not met'})")
    return 0


def _timed(fn) -> tuple[float, float]:
    """(CPU seconds of this process, wall seconds) of fn(): CPU time is what the planner costs; wall time on a
    shared host also counts other processes."""
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - c0, time.perf_counter() - t0
