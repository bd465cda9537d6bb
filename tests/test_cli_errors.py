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
    import cfp.cli.common as common
    monkeypatch.setattr(common, "build_step", lambda *a, **k: pytest.fail("work started before the path check"))
    monkeypatch.setattr("cfp.cli.search.build_step", common.build_step)
    monkeypatch.setattr("cfp.cli.analysis.build_step", common.build_step)
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
