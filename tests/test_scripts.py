"""Every script of benchmarks/ and examples/ and every shell script of cfp_test/ runs, shrunk, so a renamed field
or option cannot break one unnoticed (`make test-scripts`, and in CI `make test-rest`).

* `SCRIPTS` lists each script (`*.py` and `*.sh` under those folders) with its shrunk runs: small arguments
  (fewer layers, steps, rounds and profiled combinations; the estimate profiler where the script's figures are
  not the point) and the text its output must show, besides exiting 0. A script found on disk that the table
  does not list fails `test_every_script_has_a_shrunk_run` (part of `make test`), and so does a listed one that
  is gone: no script can be added without a run.
* The per-GPU scripts of benchmarks/scripts/ run in both modes: `MODE=estimate` (the GPU's cost model on
  simulated CPU devices) and `MODE=measured`, which without those GPUs runs benchmarks/compare.py on as many
  simulated CPU devices as the script has GPUs, the ILP priced with the GPU's cost model. Only the same
  command on the real GPUs needs hardware this machine lacks; it differs by `CUDA_VISIBLE_DEVICES` alone.
* `Covered` scripts are not run on their own (a module other benchmarks import, the shared body of the per-GPU
  scripts): the scripts named in `by` run them, and each of those must name it. `DocRun` scripts have their
  shrunk run in tests/test_readme.py, as the documented command that quotes them (its tables must hold a `Run`
  of a command naming the script); `CiRun` ones are run whole by a `make` target that .ci/run runs (the demo);
  `InSuite` ones are imported and exercised by a test of `make test` (`by`: the test, `path::name[param]`),
  which must name the script, so running them here again would only repeat it.
* Runs use test_readme's working directory (links to the repository's folders, a copy of cfp_test/, whose
  scripts write next to themselves, and `.venv/bin/{python,cfp}` = this interpreter) and inherit the suite's
  XLA flags (8 devices, backend optimisation level 0: the runs check that scripts work, not their speed).
  Each run's wall and CPU time (its processes' user + system seconds) are printed and, when CFP_SCRIPT_TIMES
  names a file, appended to it (`make test-scripts` and `make test-rest` print them sorted).
"""
from __future__ import annotations

import dataclasses
import os
import re
import resource
import subprocess
import time
from pathlib import Path

import pytest

from test_readme import _workdir

ROOT = Path(__file__).resolve().parents[1]
SCRIPT_DIRS = ("benchmarks", "examples", "cfp_test")


@dataclasses.dataclass(frozen=True)
class Run:
    args: str = ""                              # after `python SCRIPT` or `bash SCRIPT`
    expect: str = ""                            # a regex its output (stdout and stderr) must match
    env: tuple[tuple[str, str], ...] = ()       # extra environment
    name: str = ""                              # which run of the script (when it has several)


@dataclasses.dataclass(frozen=True)
class Covered:
    reason: str
    by: tuple[str, ...]                         # scripts whose runs run this one; each names it


@dataclasses.dataclass(frozen=True)
class DocRun:
    """Run shrunk by tests/test_readme.py, where a documented command quotes it."""


@dataclasses.dataclass(frozen=True)
class CiRun:
    target: str                                 # the make target .ci/run runs and whose recipe runs the script


@dataclasses.dataclass(frozen=True)
class InSuite:
    by: str                                     # tests/FILE.py::TEST[PARAM]: the suite's test that runs it
    reason: str


_SEARCHED = r"searched ParallelBlock Strategies solution"
_SMALL_CFP = "--profiler estimate --gpu A100-SXM-80G --max-combinations 2 --no-progress"

SCRIPTS: dict[str, tuple[Run, ...] | Covered | DocRun | CiRun | InSuite] = {
    # benchmarks: each prints measured or estimated figures; the runs check that they come out
    "benchmarks/analysis_time.py": (Run("--num-layers 2 --configs tiny --repeats 1", r"tiny"),),
    "benchmarks/batching.py": DocRun(),
    "benchmarks/calibrate_cpu.py": (Run("--repeats 1 --micro-batches 1,2", r"all-reduce fit: latency"),),     # never --write here
    "benchmarks/compute_once.py": (Run("--steps 2 --num-layers 2 --layer-partitions [[1,1]] --hetero-configs "
                                       "[[1,1]] --chunks 2 --global-batch-size 4 --schedules 1f1b zb-h1 "
                                       "--recompute none full --rounds 1", r"zb-h1 none / 1f1b none tokens/s"),),
    "benchmarks/compare.py": (
        Run("--model gpt --num-layers 1 --batch-size 8 --iters 2 --profile-iters 3 --max-combinations 2 "
            "--verify 1", r"cfp speedup vs alpa-ilp", name="cpu"),
        Run("--model llama2 --num-layers 1 --batch-size 8 --mesh 2x4 --iters 1 --gpu A100-PCIe-40G --profiler "
            "estimate --max-combinations 1 --verify 0 --rows alpa-ilp,cfp", r"cfp speedup vs alpa-ilp", name="gpu")),
    "benchmarks/moe_wi.py": (Run("--batch-size 8 --iters 1 --meshes 2x4", r"median step .* ms \(measured\)"),),
    "benchmarks/mutants.py": (Run("--list", r"\w+ +\w+ +cfp/"),),     # the full run is the suite many times over
    "benchmarks/optimizer_partition.py": (Run("--layers 2 --width 16 --rounds 1", r"staged/whole median"),),
    "benchmarks/schedules_sim.py": (Run("", r"equal stages, p=4, m=8"),),        # simulated only: seconds
    "benchmarks/stage_time_ratios.py": (Run("--small --rounds 3", r"worst estimated/measured ratio"),),
    "benchmarks/planner_measured.py": (Run("--config tiny --num-layers 1 --global-batch-size 8 --rounds 1 "
                                           "--max-layouts 1", r"worst estimate/measured ratio"),),
    "benchmarks/planner_optimality.py": DocRun(),
    "benchmarks/planner_paper.py": (Run("--rows 1", r"paper-llama2-a\.yaml +7B .*%"),),
    "benchmarks/planner_phase2.py": (Run("--sizes 64 --paper 1", r"planner_scale 64 .*%"),),
    "benchmarks/planner_scale.py": (Run("--sizes 64", r"64"),),
    # planned twice, the second run compared with the first: identical plans, the check's own verdict
    "benchmarks/planner_same_plans.py": (Run("--only 64-1f1b --out a.json && python benchmarks/planner_same_plans.py "
                                             "--only 64-1f1b --out b.json --against a.json",
                                             r"64-1f1b: .* s CPU \(measured\)[\s\S]*1 cases against a.json: every "
                                             r"layout and estimate identical"),),
    "benchmarks/planner_user_model.py": (Run("--model tests/layered_mixer.py:make --global-batch-size 8 "
                                             "--example-rows 1 --layouts planner --rounds 1 --steps 1",
                                             r"worst estimate/measured ratio"),),
    "benchmarks/random_plan_check.py": (Run("--models gpt --num-layers 1 --plans 1", r"gpt"),),
    "benchmarks/regen_golden_plans.py": DocRun(),
    "benchmarks/remat.py": (Run("--layers 1 --batch 8 --rounds 3 --profiler estimate --gpu A100-SXM-80G "
                                "--max-combinations 1 --verify 0", r"remat: \d+ blocks"),),
    "benchmarks/reshard_rule.py": (Run("--meshes 8 --max-rank 2", r"layout pairs, measured"),),
    "benchmarks/scan_vs_unrolled.py": (Run("--layers 1 --scaling 1 --rounds 3 --profiler estimate "
                                           "--scaling-profiler estimate --scaling-runs 1 --max-combinations 1 --verify 0",
                                           r"autoshard total"),),
    "benchmarks/side_by_side.py": Covered(
        "the benchmarks' shared timing module, imported (not run) by the benchmarks that time plans side by side",
        ("benchmarks/remat.py", "benchmarks/scan_vs_unrolled.py", "benchmarks/user_programs.py", "examples/demo.py")),
    "benchmarks/stage_plans.py": (Run("--steps 2 --profiler estimate --gpu A100-SXM-80G --layouts moe --verify 0 "
                                      "--max-combinations 1", r"ratio searched / megatron tokens/s"),),
    "benchmarks/user_programs.py": DocRun(),
    "benchmarks/validate_costmodel.py": DocRun(),
    "benchmarks/scripts/run_gpu_benchmark.sh": Covered(
        "the per-GPU scripts' shared body (it needs their MODEL, GPU, NGPU, ... variables)",
        tuple(f"benchmarks/scripts/{m}_{g}_{n}GPU.sh" for m in ("gpt", "llama2", "moe") for g in ("A100", "H100")
              for n in (4, 8))),
    # examples: the docs quote each (tests/test_user_programs.py checks the user programs' training); the demo
    # is `make demo`, which .ci/run runs whole
    "examples/demo.py": CiRun("demo"),
    "examples/equinox_gpt.py": DocRun(),
    "examples/flax_nnx.py": DocRun(),
    "examples/hetero_train.py": DocRun(),
    "examples/linen_cnn.py": DocRun(),
    "examples/scanned_linen.py": DocRun(),
    **{f"examples/own_model_{style}.py": InSuite(
        f"tests/test_own_model_examples.py::test_example_trains_like_the_users_own_step[{style}]",
        "the suite imports the example and trains its factory() on the example's own uneven layout, checked "
        "against its own_step (the user's unsharded step)") for style in ("linen", "nnx", "equinox")},
    # cfp_test: the paper's per-model scripts, one mode each, and the three-mode checks
    "cfp_test/run_mode.sh": (Run("gpt --num_layer 1 --batch_size 8 --mode analysis", r"global analysis time"),),
    "cfp_test/bert/bert_test.sh": (Run("--num_layer 1 --batch_size 8 --mode analysis", r"global analysis time"),),
    "cfp_test/gpt/gpt_test.sh": (Run(f"--num_layer 1 --batch_size 8 --mode profile {_SMALL_CFP}",
                                     r"profile time:"),),
    "cfp_test/llama2/llama2_test.sh": (Run(f"--num_layer 1 --batch_size 8 --mode search {_SMALL_CFP} --verify 1",
                                           _SEARCHED),),
    "cfp_test/moe/moe_test.sh": DocRun(),
    "cfp_test/scripts/functionality_check.sh": Covered(
        "the three-mode check's body, run by each model's check with its model name",
        tuple(f"cfp_test/scripts/{m}_functionality_check.sh" for m in ("bert", "gpt", "llama2", "moe"))),
}

# the three-mode checks: estimate profiler, one combination per segment, a 2-device mesh
_CHECK_ENV = (("MESH", "2"), ("PROFILE_OPTIONS", "--profiler estimate --gpu A100-SXM-80G --max-combinations 1"))
for _m in ("bert", "gpt", "moe"):
    SCRIPTS[f"cfp_test/scripts/{_m}_functionality_check.sh"] = (
        Run("--num_layer 1 --batch_size 8", r"PASS \w+ search", _CHECK_ENV),)
SCRIPTS["cfp_test/scripts/llama2_functionality_check.sh"] = DocRun()

# the per-GPU scripts, both modes: a tiny config of the script's model on its mesh and number of devices
_GPU_SMALL = (("CONFIG", "tiny"), ("NUM_LAYERS", "1"), ("BATCH_SIZE", "8"), ("ITERS", "1"))
for _m in ("gpt", "llama2", "moe"):
    for _g in ("A100", "H100"):
        for _n in (4, 8):
            SCRIPTS[f"benchmarks/scripts/{_m}_{_g}_{_n}GPU.sh"] = (
                Run("--max-combinations 1 --verify 0 --no-progress", r"mode: cost-model estimate[\s\S]*" + _SEARCHED,
                    (("MODE", "estimate"),) + _GPU_SMALL, "estimate"),
                Run("--rows data-parallel,cfp --profiler estimate --max-combinations 1 --verify 0",
                    rf"mode: measured on {_n} simulated CPU devices[\s\S]*\(cpu x{_n}\)[\s\S]*cfp speedup vs best",
                    (("MODE", "measured"),) + _GPU_SMALL, "measured"))


def found_scripts() -> list[str]:
    """Every script on disk under SCRIPT_DIRS, relative to the repository."""
    out = []
    for d in SCRIPT_DIRS:
        for p in (ROOT / d).rglob("*"):
            if p.suffix in (".py", ".sh") and p.is_file() and "__pycache__" not in p.parts:
                out.append(p.relative_to(ROOT).as_posix())
    return sorted(out)


def test_every_script_has_a_shrunk_run():
    found = found_scripts()
    unlisted = [s for s in found if s not in SCRIPTS]
    assert not unlisted, ("scripts without a shrunk run (add them to SCRIPTS in tests/test_scripts.py with small "
                          f"arguments and the output they must show): {unlisted}")
    stale = [s for s in SCRIPTS if s not in found]
    assert not stale, f"tests/test_scripts.py lists scripts that are gone: {stale}"
    for script, how in SCRIPTS.items():
        if isinstance(how, Covered):
            assert len(how.reason) > 20, f"{script}: say why it is not run on its own"
            stem = Path(script).stem if script.endswith(".py") else Path(script).name
            for by in how.by:
                assert isinstance(SCRIPTS.get(by), (tuple, DocRun, CiRun)), f"{script} is covered by {by}, which has no run"
                assert stem in _text(by), f"{script} is covered by {by}, which does not name it"
        elif isinstance(how, DocRun):
            assert doc_runs(script), (f"{script}: no command of tests/test_readme.py's tables (COMMANDS, INLINE) that "
                                      "runs it; give it a Run here")
        elif isinstance(how, CiRun):
            recipe = re.search(rf"^{how.target}:.*\n((?:\t.*\n)+)", _text("Makefile"), re.M)
            assert recipe and script in recipe.group(1), f"`make {how.target}` does not run {script}"
            assert re.search(rf"^make {how.target}$", _text(".ci/run"), re.M), f".ci/run does not run make {how.target}"
        elif isinstance(how, InSuite):
            assert len(how.reason) > 20, f"{script}: say what the test does with it"
            assert_tested(script, how.by)
        else:
            assert how and all(r.expect for r in how), f"{script}: every run needs the output it must show"
            assert len({r.name for r in how}) == len(how), f"{script}: its runs need distinct names"


def assert_tested(script: str, by: str) -> None:
    """`by` (tests/FILE.py::TEST[PARAM]) is a test of `make test` whose text names `script`, either whole or
    as a pattern with PARAM in it (`own_model_{name}.py` for PARAM `linen`)."""
    m = re.fullmatch(r"(tests/\w+\.py)::(\w+)(?:\[(\w+)\])?", by)
    assert m, f"{script}: {by!r} is not tests/FILE.py::TEST[PARAM]"
    path, test, param = m.groups()
    assert (ROOT / path).is_file(), f"{script} is tested by {path}, which is gone"
    text = _text(path)
    assert re.search(rf"^def {test}\(", text, re.M), f"{script} is tested by {by}, which {path} does not define"
    marks = text.split(f"def {test}(")[0].rsplit("\ndef ", 1)[-1] + "".join(re.findall(r"^pytestmark.*", text, re.M))
    assert not re.search(r"mark\.(readme|scripts)\b", marks), f"{by} is not part of `make test`"
    name = Path(script).name
    named = name in text
    if param:
        assert f'"{param}"' in text, f"{script} is tested by {by}, whose parameters have no {param!r}"
        head, _, tail = name.partition(param)
        named = named or bool(head and tail) and re.search(rf"{re.escape(head)}\{{\w+\}}{re.escape(tail)}",
                                                            text) is not None
    assert named, f"{script} is tested by {by}, which does not name it"


def _text(script: str) -> str:
    return (ROOT / script).read_text()


def doc_runs(script: str) -> list[str]:
    """The documented commands tests/test_readme.py runs (shrunk) that run `script`."""
    import test_readme
    tables = list(test_readme.COMMANDS.items()) + list(test_readme.INLINE.items())
    return [c for c, how in tables if isinstance(how, test_readme.Run) and re.search(rf"(^|[\s/]){re.escape(script)}\b",
                                                                                       c)]


RUNS = [(s, r) for s, how in SCRIPTS.items() if isinstance(how, tuple) for r in how]


def command(script: str, run: Run) -> str:
    return f"{'bash' if script.endswith('.sh') else 'python'} {script} {run.args}".strip()


@pytest.mark.scripts
@pytest.mark.parametrize("script,run", RUNS, ids=[f"{s}{'-' + r.name if r.name else ''}" for s, r in RUNS])
def test_script_runs_shrunk(script, run, tmp_path):
    env = dict(_workdir(tmp_path), **dict(run.env))
    cmd = command(script, run)
    before, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    # the timeout catches a hang, not a slow host: remat.py's shrunk run passed 900 s at load average 20 on 2 cores
    r = subprocess.run(["bash", "-c", cmd], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800)
    wall, after = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    line = f"{script}{' ' + run.name if run.name else ''}\t{wall:.1f} s wall\t{cpu:.1f} s CPU\texit {r.returncode}"
    print(line)
    if os.environ.get("CFP_SCRIPT_TIMES"):
        with open(os.environ["CFP_SCRIPT_TIMES"], "a") as f:
            f.write(line + "\n")
    out = r.stdout + r.stderr
    assert r.returncode == 0, (f"{cmd} exited {r.returncode}\nenv: {dict(run.env)}\nstdout tail:\n{r.stdout[-3000:]}\n"
                               f"stderr tail:\n{r.stderr[-3000:]}")
    assert re.search(run.expect, out), f"{cmd}: no match for {run.expect!r} in its output:\n{out[-4000:]}"
    assert "Traceback (most recent call last)" not in out, f"{cmd} printed a traceback:\n{out[-4000:]}"
    assert not re.search(r"\bnan\b", out, re.I), f"{cmd} printed a NaN:\n{out[-4000:]}"
