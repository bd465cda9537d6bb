"""Every command and code block of the docs -- README.md and every page under docs/ (`PAGES`) -- runs, shrunk
where needed, so a renamed field or option cannot break a documented path unnoticed. Nothing here depends on
which page a command is on: moving text between pages needs no change to this file.

* Every ```python block of a page runs, in order, in ONE namespace per page (a later block may use names an
  earlier one of the same page defined), exactly as written, in a fresh temporary directory, in a fresh
  interpreter without the suite's XLA_FLAGS: a page's own first block must set up the devices and the step it
  uses (a sketch with `...` placeholders is fenced as ```py, which does not run). A file a block saves
  (`.save("plan.json")`) must exist afterwards.
* Every command of a shell block (``` with no language, or sh/bash/shell) of any page is listed in `COMMANDS`:
  either `Run` (with the substitutions that shrink it: fewer layers and steps, fewer profiled combinations;
  each must apply, so a changed command fails here until the table is looked at again) or `Skip` with a
  written reason. A command in neither fails the test, and so does a table entry no page has any more. Inline
  `code` of the prose that starts like a command (`cfp ...`, `.venv/bin/...`, `benchmarks/...`, `make ...`)
  is held to the same rule by `INLINE` (command names and templates with placeholders are skips).
* Commands run with bash from a temporary directory holding links to the repository's folders (a copy of
  `cfp_test/`, whose scripts write next to themselves) and a
  `.venv/bin/` whose `cfp` and `python` are this interpreter, so `.venv/bin/cfp ...`, `python ...` and
  `cfp_test/...` lines run verbatim; outputs (plan.json, l.json, runs/...) land in the temporary directory.
  Commands of one `group` share that directory, in the tables' order (`COMMANDS`, then `INLINE`: a search's
  plan.json feeds explain), whichever pages they are on.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def doc_pages() -> list[Path]:
    """README.md, then every Markdown page under docs/ (sorted)."""
    return [README] + sorted((ROOT / "docs").rglob("*.md"))


PAGES = doc_pages()
SHELL_LANGS = {"", "sh", "bash", "shell"}


@dataclasses.dataclass(frozen=True)
class Run:
    group: str                                  # commands of a group share one directory, in the tables' order
    subs: tuple[tuple[str, str], ...] = ()      # (doc text, shrunk text); each must occur in the command
    expect: tuple[str, ...] = ()                # files the command must leave behind (relative to its directory)
    exit_code: int = 0                          # a README example of a one-line error exits 2


@dataclasses.dataclass(frozen=True)
class Skip:
    reason: str


_SMALL_SEARCH = (("--num-layers 2 --batch-size 16", "--num-layers 1 --batch-size 8"),)
_EXAMPLE = ((".py", ".py --steps 2 --profiler estimate --verify 0"),)

COMMANDS: dict[str, Run | Skip] = {
    # Quickstart
    "make demo": Skip("`bash .ci/run` runs `make demo` after the suite (.ci/run); the demo times three "
                      "plans side by side and takes about a minute"),
    "make test": Skip("this suite itself: `make test` is what `bash .ci/run` runs"),
    # Install
    "pip install -e .": Skip("installs cfp: `make test` (so CI) installs it with `pip install -e \".[test]\"`"),
    'pip install -e ".[cuda12]"': Skip("needs an NVIDIA GPU and CUDA 12 wheels; no GPU was lent to this project"),
    'pip install -e ".[cuda13]"': Skip("needs an NVIDIA GPU and CUDA 13 wheels; no GPU was lent to this project"),
    # Your own programs
    # (examples: the estimate profiler; tests/test_user_programs.py checks their training against unsharded runs)
    "PYTHONPATH=$PWD python examples/flax_nnx.py": Run("nnx", _EXAMPLE, ("nnx_plan.json",)),
    "PYTHONPATH=$PWD python examples/scanned_linen.py": Run("linen", _EXAMPLE, ("scanned_plan.json",)),
    "PYTHONPATH=$PWD python examples/equinox_gpt.py": Run("equinox", _EXAMPLE, ("equinox_plan.json",)),
    "PYTHONPATH=$PWD python examples/linen_cnn.py": Run("cnn", _EXAMPLE, ("cnn_plan.json",)),
    "PYTHONPATH=$PWD python benchmarks/user_programs.py": Run(
        "user_programs", ((".py", ".py --styles flax_nnx --rounds 3 --max-combinations 1 --verify 0"),)),
    # The CFP passes from the shell
    ".venv/bin/cfp analysis --model gpt --num-layers 4 --batch-size 64 --mesh 2x4 --dump-dir dump/": Run(
        "analysis", (("--num-layers 4 --batch-size 64", "--num-layers 2 --batch-size 16"),),
        ("dump/parallel_blocks.txt", "dump/strategy_map.txt", "dump/analysis.json")),
    "cfp_test/moe/moe_test.sh --num_layer 4 --batch_size 64 --mode analysis": Run(
        "analysis", (("--num_layer 4 --batch_size 64", "--num_layer 2 --batch_size 16"),)),
    ".venv/bin/cfp profile --model gpt --num-layers 2 --batch-size 16 --mesh 2x4": Run(
        "search", _SMALL_SEARCH + (("--mesh 2x4", "--mesh 2x4 --max-combinations 2 --iters 3 --no-progress"),)),
    ".venv/bin/cfp search --model gpt --num-layers 2 --batch-size 16 --mesh 2x4 --profiler estimate --gpu "
    "A100-PCIe-40G --memory-per-device 2GB --plan-out plan.json": Run(
        "search", _SMALL_SEARCH + (("--profiler estimate", "--profiler estimate --max-combinations 2 --verify 1 "
                                                           "--no-progress"),), ("plan.json",)),
    ".venv/bin/cfp explain plan.json --plot plan.png": Run("search", (), ("plan.png",)),
    ".venv/bin/cfp diff tests/golden/plans/gpt_8.json tests/golden/plans/gpt_8_wide_vocab.json": Run("search"),
    "cfp_test/scripts/llama2_functionality_check.sh": Run(
        "functionality", (("check.sh", "check.sh --num_layer 1 --batch_size 8"),
                          ("cfp_test/", 'PROFILE_OPTIONS="--max-combinations 2" cfp_test/'))),
    # Heterogeneous 3D-parallel training
    '.venv/bin/cfp train --model llama2 --num-layers 4 --hetero-configs "[[2,1,1],[4]]" --layer-partitions '
    '"[[2,1,1],[4]]" --global-batch-size 6 2 --chunks 3 1 --schedule 1f1b --steps 5 --verify --timeline-dir /tmp/tl':
        Run("hetero", (("--steps 5", "--steps 2"), ("/tmp/tl", "tl")), ("tl",)),
    '.venv/bin/cfp launch --nprocs 2 --devices-per-proc 4 -- .venv/bin/cfp train --model llama2 --num-layers 3 '
    '--hetero-configs "[[2,1,1],[2,1,1]]" --layer-partitions "[[1,1,1],[1,1,1]]" --devices-id '
    '"[[[0,1],[4],[2]],[[5,6],[3],[7]]]" --global-batch-size 6 2 --chunks 3 1': Run(
        "launch", (("--chunks 3 1", "--chunks 3 1 --steps 1"),)),
    ".venv/bin/python examples/hetero_train.py --steps 6": Run(
        "hetero", (("--steps 6", "--steps 1 --out hetero --layouts 1"),)),   # the one it verifies
    # Planning a layout for a mixed cluster
    ".venv/bin/cfp plan --cluster examples/clusters/paper-llama2-b.yaml --model llama2 --config 13B --dtype "
    "bfloat16 --compare": Run("plan"),
    ".venv/bin/cfp plan --cluster examples/clusters/local.yaml --model llama2 --num-layers 4 --out l.json": Run(
        "plan", (("--num-layers 4", "--num-layers 2"),), ("l.json",)),
    ".venv/bin/cfp train --layout l.json --steps 3 --verify": Run("plan", (("--steps 3", "--steps 1"),)),
    # Your own model on mixed GPUs (docs/own-model.md)
    "cfp plan --cluster examples/clusters/local.yaml --model examples/own_model_linen.py:factory --out linen.json":
        Run("own_model", (), ("linen.json",)),
    "cfp train --model examples/own_model_linen.py:factory --layout linen.json --steps 3 --verify": Run(
        "own_model", (("--steps 3", "--steps 1"),)),
    **{f"python examples/own_model_{s}.py": Skip(
        f"tests/test_own_model_examples.py (in `make test`) trains own_model_{s}.py's factory() on the example's "
        "layout and checks it against its own_step; tests/test_scripts.py lists it as tested there")
       for s in ("linen", "nnx", "equinox")},
    # Variable-length data
    ".venv/bin/cfp data analyze --input stdlib --max-seq-len 2048 --out runs/lengths": Run(
        "data", (), ("runs/lengths",)),
    # measuring every scheme's row fits on this host took over 10 min: shrunk to the cost model's estimate (the
    # measured path is tests/test_data_train.py's, in the slow tier)
    ".venv/bin/cfp data schemes --model llama2 --config tiny --out parallel_scheme_space.json": Run(
        "data", (("--config tiny", "--config tiny --gpu A100-SXM-80G"),), ("parallel_scheme_space.json",)),
    ".venv/bin/cfp data propose --schemes parallel_scheme_space.json --input stdlib --gpus 8 --tokens-per-step 8192":
        Run("data"),
    # measuring every default scheme up to 1024-token rows took over 10 min here: shrunk to one step of
    # 128-token rows of a mix of one scheme (the proposal is `cfp data propose` above and
    # tests/test_data_cli.py's)
    ".venv/bin/cfp data train --model llama2 --config tiny --input stdlib --batching-method 4 --steps 3": Run(
        "data", (("--steps 3", '--steps 1 --max-seq-len 128 --tokens-per-step 1024 '
                                '--mixes "[[(1,2,1),(1,2,1),(1,2,1),(1,2,1)]]"'),)),
    '.venv/bin/cfp data train --model llama2 --config tiny --input stdlib --batching-method 4 --steps 4 --verify '
    '--mixes "[[(1,2,2),(2,1,1),(1,2,1)], [(1,4,2)]]"': Run("data_mixes", (
        ("--steps 4", "--steps 1 --max-seq-len 128 --tokens-per-step 1024"),)),   # 409 s at 1024-token rows; 66 s
    ".venv/bin/cfp data bench-planner --gpus 1024 --model llama2 --config 32B --tokens-per-step 1600000 "
    "--max-seq-len 32768": Run("data", (("--gpus 1024", "--gpus 64"), ("--tokens-per-step 1600000",
                                                                        "--tokens-per-step 100000 --steps 1"))),
    # docs/commands.md
    ".venv/bin/cfp enum-benchmark --model gpt --num-layers 2 --mesh 2x4 --limit 4": Run(
        "enum", (("--num-layers 2", "--num-layers 1"), ("--limit 4", "--limit 2"))),
}

_OUTPUT = "a line the demo printed, quoted in prose: output, not a command"
_NAME = "names a command in prose; its runnable forms are the fenced commands, run above"
_TEMPLATE = "a template with placeholders ({}); its concrete form is a fenced command, run above"
# inline `code` in the prose that starts like a command (see `inline_commands`): the same rule, one table
INLINE: dict[str, Run | Skip] = {
    # How the package is built: the house rules' counts (tests/test_house.py asserts them)
    "python scripts/house_counts.py": Run("house"),
    "cfp explain": Skip(_NAME), "cfp diff": Skip(_NAME), "cfp plan": Skip(_NAME),
    "cfp launch": Skip(_NAME), "cfp search --plan-out": Skip(_NAME),
    "PYTHONPATH=$PWD python examples/linen_cnn.py": Skip(_NAME),
    "cfp train --stage-plans search": Skip(_NAME), "cfp plan --stage-times": Skip(_NAME),
    "cfp train --layout": Skip(_NAME), "cfp train --schedule S --timeline-dir": Skip(_NAME),
    "make demo": COMMANDS["make demo"], "make test": COMMANDS["make test"],
    "PYTHONPATH=$PWD python benchmarks/planner_scale.py": Skip(
        "plans 64, 256 and 1024 GPUs (about 6 s of CPU in all): a benchmark, whose planner "
        "tests/test_planner.py checks on small clusters"),
    "benchmarks/mutants.py --jobs 2": Skip(
        "runs the suite's tests once per mutant (96 of them, 12 min on a fast 2-core host); tests/test_scripts.py "
        "runs `benchmarks/mutants.py --list`, and CI the suite itself"),
    "PYTHONPATH=$PWD .venv/bin/python benchmarks/mutants.py": Skip(
        "injects each bug into a copy of the repository and runs its tests: about 15 minutes, a release check"),
    "make test-readme": Skip("this file's README-command tests: `bash .ci/run` runs them after `make test`"),
    "make clean": Skip("removes .venv and the compilation cache: run here it would delete the environment the "
                       "suite runs in"),
    "make test-slow": Skip("the suite's slow tier: `bash .ci/run` runs it after `make test`, not a command to shrink"),
    "make test-rest": Skip("the slow tier, this file's README-command tests and every script shrunk in one run: "
                           "`bash .ci/run` runs it after `make test`"),
    "python benchmarks/calibrate_cpu.py --repeats 9 --write": Skip(
        "rewrites the cpu catalog entry from this host's measurements; tests/test_scripts.py runs "
        "calibrate_cpu.py shrunk, without --write"),
    "PYTHONPATH=$PWD python benchmarks/planner_user_model.py --rounds 3": Skip(
        "a benchmark of minutes; tests/test_scripts.py runs planner_user_model.py shrunk"),
    "make test-scripts": Skip("tests/test_scripts.py, every script shrunk: part of `make test-rest`, which "
                              "`bash .ci/run` runs"),
    "make PY=/path/to/python3.12 test": Skip("`make test` with another interpreter: CI runs `make test`"),
    'pip install -e ".[test]"': Skip("the install `make test` (so CI) does"),
    "bash .ci/run": Skip("CI itself, which runs this suite"),
    "XLA_FLAGS=--xla_cpu_max_isa=AVX2 bash .ci/run": Skip("CI itself under an ISA cap: a release check, 10 min"),
    "XLA_FLAGS=--xla_cpu_max_isa=SSE4_2 bash .ci/run": Skip("CI itself under an ISA cap: a release check, 10 min"),
    "cfp --help": Run("cli"),
    "cfp COMMAND --help": Skip(_TEMPLATE.format("COMMAND")),
    "cfp --version": Run("cli"),
    "cfp explain plan.json": Run("search"),
    "cfp explain PLAN.json [--gpu G] [--plot FILE.png]": Skip(_TEMPLATE.format("PLAN.json, G, FILE.png")),
    "cfp diff A.json B.json": Skip(_TEMPLATE.format("A.json, B.json")),
    "benchmarks/regen_golden_plans.py [--check]": Run("golden", (("benchmarks/", "python benchmarks/"),
                                                                 (" [--check]", " --check --only gpt_8"))),
    ".venv/bin/python benchmarks/validate_costmodel.py": Run("costmodel"),
    "cfp launch --coordinator HOST0:PORT --num-processes N --first-rank R": Skip(
        _TEMPLATE.format("HOST0:PORT, N, R") + "; multi-host, one command per host"),
    "cfp train ... --stage-plans megatron|search|DIR": Skip(_TEMPLATE.format("..., megatron|search|DIR")),
    "cfp plan --stage-times <checkpoint-dir>/stage_plans": Skip(_TEMPLATE.format("<checkpoint-dir>")),
    "benchmarks/planner_optimality.py --first 200 --seeds 300": Run(
        "planner_optimality", (("benchmarks/", "python benchmarks/"), ("--seeds 300", "--seeds 2"))),
    "benchmarks/batching.py --steps 6 --tokens-per-step 8192 --max-seq-len 1024": Skip(
        "the benchmark of docs/benchmarks.md's table (5.5 min on an idle 2-core host with its fits, more compiling "
        "on a fresh cache); its CI-sized form, `benchmarks/batching.py --quick`, runs"),
    "benchmarks/batching.py --steps 12 --tokens-per-step 8192 --max-seq-len 1024": Skip(
        "the twelve-step form of the same benchmark (6 min on an idle 2-core host with its fits); its CI-sized form, "
        "`benchmarks/batching.py --quick`, runs"),
    "cfp data propose": Skip(_NAME),
    "cfp plan --recompute auto": Skip(_NAME),
    "cfp plan --model llama2 --config 7B": Skip(_NAME),
    "python benchmarks/compute_once.py --steps 6 --rounds 2": Skip(
        "every schedule with and without recomputation, 21 verified runs (18 min on a loaded 2-core host); "
        "tests/test_scripts.py runs compute_once.py shrunk"),
    "python benchmarks/compute_once.py --config small --schedules 1f1b --steps 6 --rounds 2": Skip(
        "the same benchmark at hidden 256 (5 min on a loaded 2-core host); tests/test_scripts.py runs "
        "compute_once.py shrunk"),
    "PYTHONPATH=$PWD python benchmarks/user_programs.py --styles equinox_gpt --rounds 5": Skip(
        "a benchmark of minutes (a search with its whole-step candidates timed); tests/test_readme.py runs "
        "user_programs.py shrunk through its documented command"),
    "cfp plan --model llama2 --config 7B --cluster FILE --schedule auto --recompute auto --out layout.json": Skip(
        "FILE stands for the 1024- or 4096-GPU cluster file written out beside it (seconds of CPU per plan); "
        "tests/test_scripts.py runs planner_same_plans.py and planner_scale.py, which plan those clusters' kind, shrunk"),
    "benchmarks/planner_scale.py --a100 pcie --model 7B --schedule auto": Skip(
        "plans 64 to 4096 GPUs (tens of seconds of CPU); tests/test_scripts.py runs planner_scale.py shrunk"),
    "benchmarks/planner_same_plans.py --out after.json --against before.json": Skip(
        "compares with a file another checkout wrote (every case: about a minute of CPU); tests/test_scripts.py runs "
        "it shrunk against its own first run"),
    "benchmarks/planner_scale.py --sizes 1024 4096 --a100 pcie --model 7B --schedule auto": Skip(
        "plans 1024 and 4096 GPUs (about 15 s of CPU); tests/test_scripts.py runs planner_scale.py shrunk"),
    "PYTHONPATH=$PWD python benchmarks/planner_measured.py --rounds 3": Skip(
        "trains and times eight layouts (minutes); tests/test_scripts.py runs planner_measured.py shrunk"),
    "PYTHONPATH=$PWD python benchmarks/planner_paper.py": Skip(
        "plans every paper cluster (about a minute of CPU); tests/test_scripts.py runs planner_paper.py shrunk"),
    'benchmarks/batching.py --steps 6 --tokens-per-step 8192 --max-seq-len 1024 --schemes /tmp/fits39.json '
    '--uniform "[(1,1,2),(1,1,2),(1,1,2),(1,1,2)]" --no-proposed': Skip(
        "the benchmark run of issue 39 with its own measured fits (tens of minutes on a loaded host); its CI-sized "
        "form, `benchmarks/batching.py --quick`, runs"),
    "benchmarks/compare.py --model moe --num-layers 2 --mesh 8 --iters 10 --override num_experts=16": Skip(
        "a search with every candidate timed (17 min on a loaded host); tests/test_scripts.py runs compare.py "
        "shrunk"),
    "cfp data schemes --model llama2 --max-seq-len 1024": Skip(
        "measures ten schemes' fits (2 min 36 s on an idle 2-core host); `cfp data schemes` runs above, shrunk to "
        "the cost model's estimate, and its measured path is tests/test_data_train.py's"),
    'cfp train --model llama2 --num-layers 8 --hetero-configs "[[1,1,1,1]]" --layer-partitions "[[3,2,2,1]]" '
    '--global-batch-size 16 --chunks 8 --schedule S --steps 2 --verify --timeline-dir tl': Skip(
        _TEMPLATE.format("S: gpipe, 1f1b, interleaved:2, zb-h1, zb-v") + "; tests/test_virtual_stages.py runs each "
        "schedule against one device and the generated tables through run_training"),
    "benchmarks/batching.py --quick": Run("batching", (("benchmarks/", "python benchmarks/"),)),
    "benchmarks/batching.py --work-bound 512,1024,2048,4096 --steps 8 --tokens-per-step 16384": Run(
        "batching", (("benchmarks/", "python benchmarks/"),
                     ("512,1024,2048,4096 --steps 8 --tokens-per-step 16384", "256,512 --steps 2 --tokens-per-step 1024"))),
    "cfp plan --cluster examples/clusters/local.yaml --model moe --num-layers 4 --out m.json": Run(
        "plan_moe", (), ("m.json",)),
    "cfp train --layout m.json --steps 3 --verify": Run("plan_moe", (("--steps 3", "--steps 1"),)),
    "benchmarks/calibrate_cpu.py --write": Skip(
        "rewrites the cpu catalog entry's figures (cfp/hardware/cpu_calibration.py) from this host's measurements; "
        "benchmarks/stage_time_ratios.py measures the planner's stage times against the runtime's"),
    "cfp data train --mixes": Skip(_NAME), "cfp train": Skip(_NAME), "cfp data train": Skip(_NAME),
    "cfp data bench-planner --gpus 1024 --model llama2 --config 32B --tokens-per-step 1600000 --max-seq-len 32768":
        Skip("the fenced `cfp data bench-planner` command of \"Variable-length data\", run above, shrunk"),
    "cfp data bench-planner --gpus 4096 --tokens-per-step 100000000 --max-seq-len 8192 --steps 5": Skip(
        "the fenced `cfp data bench-planner` command (its 10^5-sequence step included), run above, shrunk"),
    "benchmarks/compare.py --num-layers 2 --mesh 8 --iters 10 --override ...": Skip(
        _TEMPLATE.format("--override ...: one row's field override per run")),
    'cfp train --model llama2 --num-layers 4 --hetero-configs "[[2,2]]" --layer-partitions "[[2,2]]" '
    '--global-batch-size 4 --chunks 2 --stage-plans search --checkpoint-dir /tmp/sp': Run(
        "stage_plans", (("--num-layers 4", "--num-layers 2"), ('"[[2,2]]" --global', '"[[1,1]]" --global'),
                        ("/tmp/sp", "sp --steps 1 --stage-max-combinations 2 --stage-verify 1 --stage-iters 3 "
                                    "--stage-warmup 1"))),
    "cfp plan --cluster examples/clusters/local.yaml --model llama2 --num-layers 4 --global-batch-size 4 "
    "--stage-times /tmp/sp/stage_plans": Run("stage_plans", (("--num-layers 4", "--num-layers 2"),
                                                             ("/tmp/sp", "sp"))),
    # docs pages (docs/commands.md, docs/autoshard.md, docs/benchmarks.md)
    "cfp analysis": Skip(_NAME), "cfp profile": Skip(_NAME), "cfp search": Skip(_NAME),
    "cfp data bench-planner": Skip(_NAME), "cfp data": Skip(_NAME),
    "PYTHONPATH=$PWD python benchmarks/user_programs.py": Skip(
        "the fenced command of docs/autoshard.md's \"Your own programs\", run above, shrunk"),
    "PYTHONPATH=$PWD .venv/bin/python benchmarks/moe_wi.py": Run("moe_wi", (("moe_wi.py", "moe_wi.py --iters 2"),)),
    "cfp diff A.json B.json [--gpu G]": Skip(_TEMPLATE.format("A.json, B.json, G")),
    "cfp launch --nprocs N [--devices-per-proc D] -- COMMAND": Skip(_TEMPLATE.format("N, D, COMMAND")),
    "cfp data analyze --input stdlib|FILE.jsonl|DIR": Skip(_TEMPLATE.format("FILE.jsonl|DIR")),
    "cfp data schemes --model M": Skip(_TEMPLATE.format("M")),
    "cfp data propose --schemes FILE --input ... --gpus N --tokens-per-step T": Skip(
        _TEMPLATE.format("FILE, ..., N, T")),
    "cfp data train --model M --input ...": Skip(_TEMPLATE.format("M, ...")),
}

# shell-fenced blocks that are pictures, not commands, by their first line
NOT_COMMANDS = {
    "step_fn, example args, mesh": "the package diagram of \"How the package is built\"",
    "cfp/            the package": "the folder list of \"Repository folders\"",
}


def fenced_blocks(markdown: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block."""
    return re.findall(r"^```(\w*)\n(.*?)^```", markdown, flags=re.S | re.M)


def python_blocks(markdown: str) -> list[str]:
    return [body for lang, body in fenced_blocks(markdown) if lang == "python"]


def shell_commands(body: str) -> list[str]:
    """A shell block's commands: continuation lines joined, comments and blank lines dropped, spaces
    normalised (the README aligns its comments)."""
    joined = re.sub(r"\\\n\s*", " ", body)
    out = []
    for line in joined.splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        if line and not line.startswith("#"):
            out.append(" ".join(line.split()))
    return out


def readme_commands(markdown: str) -> list[str]:
    cmds = []
    for lang, body in fenced_blocks(markdown):
        if lang not in SHELL_LANGS:
            continue
        first = body.strip().splitlines()[0] if body.strip() else ""
        if any(first.startswith(k) for k in NOT_COMMANDS):
            continue
        cmds += shell_commands(body)
    return cmds


INLINE_STARTS = (".venv/bin/", "cfp ", "python ", "PYTHONPATH=", "bash ", "make ", "XLA_FLAGS=", "benchmarks/", "pip ")


def inline_commands(markdown: str) -> list[str]:
    """Inline `code` of the prose (fenced blocks removed) that starts like a command and has an argument."""
    prose = re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M)
    out = []
    for span in re.findall(r"(?<!`)`([^`]+)`(?!`)", prose):
        span = " ".join(span.split())
        if span.startswith(INLINE_STARTS) and " " in span and span not in out:
            out.append(span)
    return out


def all_commands(markdown: str) -> list[tuple[str, Run | Skip | None]]:
    """(command, how the suite runs it or None) of every fenced and inline command of a page, in page order
    within each kind."""
    return ([(c, COMMANDS.get(c)) for c in readme_commands(markdown)]
            + [(c, INLINE.get(c)) for c in inline_commands(markdown)])


def shrunk(cmd: str, run: Run) -> str:
    for old, new in run.subs:
        assert old in cmd, f"substitution {old!r} no longer applies to doc command {cmd!r}"
        cmd = cmd.replace(old, new, 1)
    return cmd


def test_blocks_and_commands_are_found():
    md = "x\n```python\na = 1\n```\n```\nls -l \\\n   dir  # list\n\n# c\nmake  x\n```\n```python\nb = a\n```\n"
    assert python_blocks(md) == ["a = 1\n", "b = a\n"]
    assert readme_commands(md) == ["ls -l dir", "make x"]


def _rel(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def test_doc_pages_are_readme_and_docs():
    assert PAGES[0] == README and all(_rel(p).startswith("docs/") and p.suffix == ".md" for p in PAGES[1:])


def test_every_readme_command_is_run_or_skipped_with_a_reason():
    texts = {_rel(p): p.read_text() for p in PAGES}
    unknown = [f"{page}: {c}" for page, md in texts.items() for c, how in all_commands(md) if how is None]
    assert not unknown, ("doc commands neither run nor skipped (add them to COMMANDS or INLINE in "
                         f"tests/test_readme.py, shrunk, or with a reason): {unknown}")
    fenced = {c for md in texts.values() for c in readme_commands(md)}
    inline = {c for md in texts.values() for c in inline_commands(md)}
    stale = [c for c in COMMANDS if c not in fenced] + [c for c in INLINE if c not in inline]
    assert not stale, f"tests/test_readme.py lists commands no page ({', '.join(texts)}) has any more: {stale}"
    for c, how in list(COMMANDS.items()) + list(INLINE.items()):
        if isinstance(how, Skip):
            assert len(how.reason) > 20, f"skip of {c!r} needs a written reason"
        else:
            shrunk(c, how)


def _workdir(tmp: Path) -> dict:
    """Links to the repository's folders, `.venv/bin/{cfp,python}` = this interpreter; the environment."""
    for entry in ROOT.iterdir():
        if entry.name == "cfp_test":        # its scripts write dumps next to themselves: a copy, not a link
            shutil.copytree(entry, tmp / entry.name, ignore=shutil.ignore_patterns("debug_*"))
        elif entry.name not in (".git", ".venv", "runs", "dump") and not entry.name.startswith("."):
            (tmp / entry.name).symlink_to(entry)
    (tmp / ".ci").symlink_to(ROOT / ".ci")
    venv = tmp / ".venv" / "bin"
    venv.mkdir(parents=True)
    # wrappers, not links: a link to a virtual environment's python outside it loses the environment
    for name, args in (("python", ""), ("cfp", " -m cfp.cli.main")):
        (venv / name).write_text(f'#!/usr/bin/env bash\nexec {shlex.quote(sys.executable)}{args} "$@"\n')
        (venv / name).chmod(0o755)
    cfp = venv / "cfp"
    env = dict(os.environ, PATH=f"{venv}:{os.environ['PATH']}", PYTHONPATH=str(ROOT), CFP=str(cfp),
               XDG_CACHE_HOME=str(tmp / "cache"), MPLBACKEND="Agg")
    return env


GROUPS = sorted({how.group for how in list(COMMANDS.values()) + list(INLINE.values()) if isinstance(how, Run)})


@pytest.mark.readme
@pytest.mark.parametrize("group", GROUPS)
def test_readme_commands_run(group, tmp_path):
    env = _workdir(tmp_path)
    cmds = [(c, how) for c, how in list(COMMANDS.items()) + list(INLINE.items())
            if isinstance(how, Run) and how.group == group]
    assert cmds, f"group {group} has no command"
    for c, run in cmds:
        cmd = shrunk(c, run)
        if cmd.startswith("cfp "):          # prose names the installed `cfp`: the .venv's, as `make` installs it
            cmd = ".venv/bin/" + cmd
        r = subprocess.run(["bash", "-c", cmd], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == run.exit_code, (
            f"doc command exited {r.returncode}, not {run.exit_code}: {c}\nran: {cmd}\n"
            f"stdout tail:\n{r.stdout[-3000:]}\nstderr tail:\n{r.stderr[-3000:]}")
        if run.exit_code:
            assert len(r.stderr.strip().splitlines()) == 1, f"{cmd!r}: not one line:\n{r.stderr}"
        for path in run.expect:
            assert (tmp_path / path).exists(), f"{cmd!r} left no {path}"


PYTHON_RUNNER = """
import sys
blocks = {blocks!r}
ns = {{"__name__": "__main__"}}
for i, block in enumerate(blocks):
    try:
        exec(compile(block, f"<{page} python block {{i}}>", "exec"), ns)
    except BaseException as e:
        print(f"{page} python block {{i}} ({{block.splitlines()[0]!r}}) raised {{type(e).__name__}}: {{e}}",
              file=sys.stderr)
        raise
"""


def saved_files(blocks: list[str]) -> list[str]:
    """The files the blocks save by a literal name (`.save("plan.json")`)."""
    return [name for b in blocks for name in re.findall(r"""\.save\(\s*["']([^"']+)["']""", b)]


def test_saved_files_are_found():
    assert saved_files(['x.save("plan.json")  # the Plan', "p.save( 'a/b.json')", "save(x)"]) == ["plan.json", "a/b.json"]


def _runs_elsewhere(page: Path) -> bool:
    """A page whose python blocks another page opens with, verbatim and in order (the README's quickstart block
    is docs/autoshard.md's first): that page's run runs them."""
    mine = python_blocks(page.read_text())
    return any(other != page and python_blocks(other.read_text())[:len(mine)] == mine for other in PAGES)


PYTHON_PAGES = [p for p in PAGES if python_blocks(p.read_text()) and not _runs_elsewhere(p)]


def test_some_page_has_python_blocks():
    assert PYTHON_PAGES, "no page of the docs has a python block (the quickstart's autoshard example)"


def test_the_readme_python_block_runs_as_the_start_of_docs_autoshard():
    """The README's block is not run on its own: it must stay the opening of docs/autoshard.md's, which runs."""
    assert python_blocks(README.read_text()) and _runs_elsewhere(README)
    assert README not in PYTHON_PAGES and ROOT / "docs" / "autoshard.md" in PYTHON_PAGES


@pytest.mark.readme
@pytest.mark.parametrize("page", PYTHON_PAGES, ids=[_rel(p) for p in PYTHON_PAGES])
def test_readme_python_blocks_run_as_written(page, tmp_path):
    """As a newcomer runs them: a fresh interpreter per page, no XLA_FLAGS from the suite, nothing predefined."""
    blocks = python_blocks(page.read_text())
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(ROOT)
    r = subprocess.run([sys.executable, "-c", PYTHON_RUNNER.format(blocks=blocks, page=_rel(page))], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{_rel(page)}\nstdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-4000:]}"
    for name in saved_files(blocks):
        assert (tmp_path / name).exists(), f"{_rel(page)}'s python blocks saved no {name}"
