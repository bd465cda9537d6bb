"""Profiling pass: options, GPU catalog, segment sub-programs, measure/estimate profilers and the cache."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cfp.analysis.analysis import analyze_with_program
from cfp.errors import ConfigError
from cfp.hardware.collectives import collective_time
from cfp.hardware.gpus import GPUS, get_gpu
from cfp.profiling import gpu_estimate
from cfp.profiling.options import ProfileOptions, ProfilerKind
from cfp.profiling.profiler import Profiler, candidate_choices, profile
from cfp.profiling.subprogram import SegmentProgram, segment_io
from cfp.profiling.table import ProfileTable


def _loss(p, x, y):
    h = jnp.tanh(x @ p["w1"])
    return jnp.mean((h @ p["w2"] - y) ** 2)


def grad_step(p, x, y):
    return jax.value_and_grad(_loss)(p, x, y)


@pytest.fixture(scope="module")
def mlp():
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    p = {"w1": jax.random.normal(k[0], (32, 64)) * 0.1, "w2": jax.random.normal(k[1], (64, 32)) * 0.1}
    args = (p, jax.random.normal(k[2], (16, 32)), jax.random.normal(k[3], (16, 32)))
    analysis, program = analyze_with_program(grad_step, "2x4", *args)
    return analysis, program, args


def test_options_validate():
    assert ProfileOptions(kind="estimate", gpu="h100 sxm").kind is ProfilerKind.ESTIMATE
    with pytest.raises(ConfigError, match="iters=2"):
        ProfileOptions(iters=2)
    with pytest.raises(ConfigError, match="'timing'"):
        ProfileOptions(kind="timing")
    with pytest.raises(ConfigError, match="needs a gpu"):
        ProfileOptions(kind="estimate")
    with pytest.raises(ConfigError, match="'TPU-v9'"):
        ProfileOptions(kind="estimate", gpu="TPU-v9")
    with pytest.raises(ConfigError, match="max_combinations=0"):
        ProfileOptions(max_combinations=0)


def test_gpu_catalog():
    assert {"A100-PCIe-40G", "A100-SXM-80G", "H100-SXM", "H200", "RTX3090", "RTX4090", "RTX3080Ti"} <= set(GPUS)
    assert get_gpu("rtx 3080 ti").name == "RTX3080Ti"
    h100 = get_gpu("H100-SXM")
    assert h100.peak_flops("bfloat16") > h100.peak_flops("float32")
    # ring all-reduce moves twice what an all-gather does
    assert collective_time("all-reduce", 1e9, 8, 1e9) == pytest.approx(
        2 * collective_time("all-gather", 1e9, 8, 1e9))
    assert collective_time("all-reduce", 1e9, 1, 1e9) == 0.0


def test_subprogram_matches_whole_program(mlp):
    """A segment covering the whole MLP, run on the real inputs, gives the step's own outputs."""
    analysis, program, args = mlp
    seg = analysis.segments[0]
    assert (seg.start, seg.stop) == (0, len(analysis.blocks))
    io = segment_io(analysis, seg)
    sp = SegmentProgram(program, analysis, seg, [1] * (seg.stop - seg.start), analysis.mesh.make())
    flat = jax.tree_util.tree_leaves(args)
    pos = analysis.graph.input_position
    vals = [flat[pos[t]] for t in io.inputs]
    outs = dict(zip(io.outputs, sp.compile()(*[jax.device_put(v, s) for v, s in zip(vals, sp.in_shardings)])))
    ref = jax.tree_util.tree_leaves(grad_step(*args))
    for t, r in zip(analysis.graph.outputs, ref):
        np.testing.assert_allclose(np.asarray(outs[t]), np.asarray(r), rtol=1e-5, atol=1e-6)


def test_pruning_rule(mlp):
    analysis, _, _ = mlp
    seg = analysis.segments[0]
    full, rule = candidate_choices(analysis, seg, ProfileOptions(max_combinations=10**6))
    assert rule.startswith("exhaustive") and len(full) == np.prod([len(analysis.blocks[b].strategies) for b in seg.blocks])
    few, rule = candidate_choices(analysis, seg, ProfileOptions(max_combinations=3, per_block=2))
    assert rule.startswith("pruned") and len(few) == 3 and len(set(few)) == 3


def test_cache_hit_compiles_nothing(mlp, tmp_path):
    analysis, program, _ = mlp
    opts = ProfileOptions(iters=3, warmup=1, max_combinations=3, cache_dir=str(tmp_path), progress=False)
    first = Profiler(program, analysis, opts, log=lambda *_: None)
    t1 = first.run()
    assert first.compiles == 3 and t1.compiles == 3
    seg = t1.segments[0]
    assert all(e.time > 0 and e.memory > 0 and e.measured == e.time for e in seg.entries)
    assert len(list(tmp_path.iterdir())) == 1
    second = Profiler(program, analysis, opts, log=lambda *_: None)
    t2 = second.run()
    assert second.compiles == 0 and t2.compiles == 0
    assert t2.segments[0].entries == seg.entries
    assert ProfileTable.from_json(t2.to_json()).segments == t2.segments
    # other settings are another cache entry
    third = Profiler(program, analysis, ProfileOptions(iters=4, warmup=1, max_combinations=3,
                                                       cache_dir=str(tmp_path), progress=False), log=lambda *_: None)
    third.run()
    assert third.compiles == 3


def test_estimate_profiler_and_top_k(mlp):
    analysis, program, _ = mlp
    table = profile(program, analysis, ProfileOptions(kind="estimate", gpu="A100-PCIe-40G", max_combinations=4,
                                                      overlap_compile=False, progress=False),
                    log=lambda *_: None)
    assert str(table.profiler) == "estimate:A100-PCIe-40G"
    seg = table.segments[0]
    assert all(e.measured is None and e.time > 0 and e.flops > 0 for e in seg.entries)
    # a sharded contraction shows up as communication somewhere in the profiled combinations
    assert any(e.comm_bytes > 0 for e in seg.entries)
    cands = seg.candidates(1)
    assert cands[0].time == min(e.time for e in seg.entries)
    assert min(e.memory for e in cands) == min(e.memory for e in seg.entries)


def test_cli_profile_then_cache(tmp_path, capsys):
    """`cfp profile` on a 1-layer GPT writes its table; the same command again compiles nothing."""
    import json

    from cfp.cli.main import main
    argv = ["profile", "--model", "gpt", "--num-layers", "1", "--batch-size", "8", "--mesh", "8",
            "--profiler", "estimate", "--gpu", "RTX4090", "--max-combinations", "1", "--no-progress",
            "--cache-dir", str(tmp_path / "cache"), "--dump-dir", str(tmp_path / "dump")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "compiles: 2" in out and "pruned: 11664 combinations > max 1" in out
    table = json.loads((tmp_path / "dump" / "profile_table.json").read_text())
    assert table["profiler"] == "estimate:RTX4090" and len(table["segments"]) == 2
    assert main(argv) == 0
    assert "compiles: 0" in capsys.readouterr().out


def test_profiler_spec_round_trips_and_rejects_unknown():
    from cfp.errors import ConfigError
    from cfp.profiling.options import ProfilerKind, ProfilerSpec
    for text in ("measure", "estimate:A100-SXM-80G"):
        assert str(ProfilerSpec.parse(text)) == text
    assert ProfilerSpec.parse("estimate:H100-SXM").gpu == "H100-SXM"
    assert ProfilerSpec.parse("measure").kind is ProfilerKind.MEASURE
    with pytest.raises(ConfigError, match="'guess'"):
        ProfilerSpec.parse("guess")


def test_cache_never_mixes_models(tmp_path, capsys):
    """GPT, BERT and Llama-2 profiled into one cache: no segment profile of one model is read back for another
    (their segment fingerprints collide: GPT's and BERT's layers, GPT's and Llama-2's heads, so a cache keyed on
    fingerprints gave BERT GPT's layer timings); the same three runs again read every segment back and compile
    nothing, with the same figures."""
    import json

    from cfp.cli.main import main
    cache = tmp_path / "cache"

    def run(model: str) -> dict:
        dump = tmp_path / model
        assert main(["profile", "--model", model, "--num-layers", "1", "--batch-size", "8", "--mesh", "2x4",
                     "--profiler", "estimate", "--gpu", "RTX4090", "--max-combinations", "1", "--no-progress",
                     "--cache-dir", str(cache), "--dump-dir", str(dump)]) == 0
        capsys.readouterr()
        return json.loads((dump / "profile_table.json").read_text())

    models = ("gpt", "bert", "llama2")
    first, files = {}, 0
    for m in models:
        t = first[m] = run(m)
        kinds = len(t["segments"])
        assert t["reused"] == [] and t["compiles"] == kinds, (m, t["reused"], t["compiles"])
        files += kinds
        assert len(list(cache.iterdir())) == files
    for m in models:
        t = run(m)
        assert t["compiles"] == 0 and t["reused"] == sorted(map(int, t["segments"])), (m, t["reused"])
        assert t["segments"] == first[m]["segments"]
    assert len(list(cache.iterdir())) == files
