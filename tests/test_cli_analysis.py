"""`cfp analysis`: the report, the dump files, and one-line errors with exit code 2 for bad input."""
import json

import pytest

from cfp.cli.main import main


def test_analysis_report_and_dump(tmp_path, capsys):
    rc = main(["analysis", "--model", "gpt", "--num-layers", "2", "--batch-size", "8", "--mesh", "2x4",
               "--dump-dir", str(tmp_path), "--max-ops", "2"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "Parallel Block 0:" in out and "Plan: " in out
    assert "ParallelBlocks sequence: (8, 16) mapped to  (0, 8)" in out
    assert out.strip().splitlines()[-1].startswith("global analysis time: ")
    for name in ("parallel_blocks.txt", "strategy_map.txt", "analysis.json"):
        assert (tmp_path / name).stat().st_size > 0
    data = json.loads((tmp_path / "analysis.json").read_text())
    assert data["mesh"]["shape"] == [2, 4] and len(data["blocks"]) == 17
    smap = (tmp_path / "strategy_map.txt").read_text()
    assert "Strategy SS" in smap or "Strategy SRS" in smap


@pytest.mark.parametrize("argv,needle", [
    (["--model", "foo"], "invalid choice: 'foo'"),
    (["--model", "gpt", "--config", "huge"], "unknown gpt config 'huge'; valid choices: tiny"),
    (["--model", "gpt", "--mesh", "3"], "mesh '3' needs 3 devices"),
    (["--model", "gpt", "--mesh", "2x2x2"], "mesh '2x2x2' is not of the form"),
    (["--model", "gpt", "--batch-size", "6"], "batch size 6 cannot be split over mesh 8"),
    (["--model", "gpt", "--num-layers", "0"], "0 must be a positive integer"),
])
def test_bad_input_is_one_line_and_exit_2(argv, needle, capsys):
    try:
        rc = main(["analysis", *argv])
    except SystemExit as e:  # argparse errors exit directly
        rc = e.code
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1, err
    assert needle in err and err.startswith("cfp analysis: error:")
