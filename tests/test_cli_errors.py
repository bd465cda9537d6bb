"""CLI errors of the analysis/profile/search/enum-benchmark modes: one line on stderr, exit code 2, and output
paths checked before any capture or profiling starts (these all fail within milliseconds)."""
import json
import os

import pytest

from cfp.cli import main as cli


def _run(capsys, argv):
    code = cli.main(argv)
    err = capsys.readouterr().err
    return code, err


@pytest.fixture
def a_file(tmp_path):
    f = tmp_path / "regular"
    f.write_text("x")
    return f


@pytest.mark.parametrize("mode,flag", [("analysis", "--dump-dir"), ("profile", "--dump-dir"),
                                       ("profile", "--cache-dir"), ("search", "--plan-out"),
                                       ("search", "--cache-dir"), ("enum-benchmark", "--dump-dir")])
def test_output_path_under_a_regular_file_fails_fast(capsys, a_file, monkeypatch, mode, flag):
    # import every module first: one first imported under the patch would bind the fake for good
    import cfp.cli.analysis as analysis
    import cfp.cli.common as common
    import cfp.cli.search as search
    fake = lambda *a, **k: pytest.fail("work started before the path check")  # noqa: E731
    for module in (common, search, analysis):
        monkeypatch.setattr(module, "build_step", fake)
    target = str(a_file / "sub" / ("plan.json" if flag == "--plan-out" else "d"))
    code, err = _run(capsys, [mode, "--model", "gpt", flag, target])
    assert code == 2 and err.count("\n") == 1 and flag in err and str(a_file) in err, err


def test_plan_out_that_is_a_directory_and_cache_dir_that_is_a_file(capsys, tmp_path, a_file):
    code, err = _run(capsys, ["search", "--model", "gpt", "--plan-out", str(tmp_path)])
    assert code == 2 and "is a directory" in err and err.count("\n") == 1
    code, err = _run(capsys, ["profile", "--model", "gpt", "--cache-dir", str(a_file)])
    assert code == 2 and "is an existing file" in err and err.count("\n") == 1


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_unwritable_directory(capsys, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        code, err = _run(capsys, ["analysis", "--model", "gpt", "--dump-dir", str(ro / "out")])
    finally:
        ro.chmod(0o700)
    assert code == 2 and "no write permission" in err and err.count("\n") == 1


@pytest.mark.parametrize("exc", [FileNotFoundError(2, "No such file or directory", "/nope/x.json"),
                                 json.JSONDecodeError("Expecting value", "[", 1)])
def test_file_system_and_json_errors_are_one_line(capsys, monkeypatch, exc):
    def boom(args):
        raise exc
    monkeypatch.setattr("cfp.cli.analysis.run", boom)
    code, err = _run(capsys, ["analysis", "--model", "gpt"])
    assert code == 2 and err.count("\n") == 1 and err.startswith("cfp analysis: error:"), err
    assert "Traceback" not in err


# ----------------------------------------------------------------------------- help, version, shared checks


def _parsers(parser, path=("cfp",)):
    """Every parser of the command line: cfp, each command, each `cfp data` action."""
    import argparse
    yield " ".join(path), parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, path + (name,))


def test_every_option_has_help_that_shows_its_default():
    """Exceptions, each justified: flags (store_true/false: off unless given) and None defaults ("not given";
    their help says what happens then) need not print a default."""
    import argparse
    from cfp.cli.main import build_parser
    bad, seen = [], 0
    for where, parser in _parsers(build_parser()):
        for a in parser._actions:
            if not a.option_strings or a.help == argparse.SUPPRESS or isinstance(
                    a, (argparse._HelpAction, argparse._VersionAction)):
                continue
            seen += 1
            block = " ".join(parser._get_formatter()._format_action(a).split())  # help as printed, unwrapped
            if not a.help:
                bad.append(f"{where} {a.option_strings[0]}: no help")
            elif a.default is not None and not isinstance(a.default, bool):
                values = a.default if isinstance(a.default, (list, tuple)) else [a.default]
                if "default" not in block or not all(str(v) in block for v in values):
                    bad.append(f"{where} {a.option_strings[0]}: default {a.default!r} not shown")
    assert seen > 100 and not bad, "\n".join(bad)


def test_version_and_user_help(capsys):
    import cfp
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"cfp {cfp.__version__}"
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "docs/commands.md" in out and "Run `cfp COMMAND --help`" in out
    lines = out.splitlines()
    for name in cli.SUBCOMMANDS:       # every command listed with its one-line description (maybe wrapped)
        assert any(line.split()[:1] == [name] and len((line + " " + nxt).split()) > 2
                   for line, nxt in zip(lines, lines[1:])), name


@pytest.mark.parametrize("argv, flag", [
    (["plan", "--cluster", "examples/clusters/paper-7b-13b-a.yaml", "--model", "llama2", "--out", "FILE/sub/l.json"],
     "--out"),
    (["data", "schemes", "--model", "llama2", "--gpu", "A100-SXM-80G", "--out", "FILE/s.json"], "--out"),
    (["data", "propose", "--schemes", "none.json", "--input", "stdlib", "--gpus", "8", "--tokens-per-step", "9",
      "--out", "FILE/x/st.json"], "--out"),
    (["data", "analyze", "--input", "stdlib", "--out", "FILE/an"], "--out"),
    (["data", "train", "--model", "llama2", "--input", "stdlib", "--schemes", "FILE/s.json"], "--schemes"),
    (["launch", "--nprocs", "1", "--log-dir", "FILE/logs", "--", "true"], "--log-dir"),
])
def test_output_paths_are_checked_before_any_work(capsys, a_file, monkeypatch, argv, flag):
    """A path under an existing file fails at once, naming the flag and the path (not, after the work, a
    temporary file)."""
    import cfp.cli.data as data
    import cfp.cli.plan as plan
    import cfp.runtime.launch as launch
    started = lambda *a, **k: pytest.fail("work started before the path check")
    monkeypatch.setattr(plan, "load_cluster_file", started)
    monkeypatch.setattr(launch, "launch", started)
    for name in ("run_analyze", "run_schemes", "run_propose", "run_train"):
        monkeypatch.setattr(data, name, started)
    argv = [a.replace("FILE", str(a_file)) for a in argv]
    code, err = _run(capsys, argv)
    assert code == 2 and err.count("\n") == 1 and f"{flag}=" in err and str(a_file) in err, err
