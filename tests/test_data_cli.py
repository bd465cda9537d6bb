"""`cfp data` at the command line: analyze writes PNG+JSON; bad input is one line and exit code 2."""
import json
import subprocess
import sys

import pytest

from cfp.cli.main import main


def test_analyze_jsonl_writes_png_and_json(tmp_path, capsys):
    src = tmp_path / "d.jsonl"
    src.write_text("\n".join(json.dumps({"text": "x" * n}) for n in (5, 17, 300, 9, 2000)) + "\n")
    out = tmp_path / "an"
    assert main(["data", "analyze", "--input", str(src), "--max-seq-len", "1000", "--out", str(out)]) == 0
    rep = json.loads((out / "lengths.json").read_text())
    assert rep["num_sequences"] == 5 and rep["max_seq_len"] == 1000      # 2000 truncated to 1000
    assert rep["total_tokens"] == 4 + 16 + 299 + 8 + 1000
    assert abs(rep["padding_waste_pad_to_max"] - (1 - rep["total_tokens"] / 5000)) < 1e-12
    assert (out / "lengths.png").stat().st_size > 1000
    assert "padding waste" in capsys.readouterr().out


def test_bad_input_is_one_line_exit_2(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "no text field"}\n')
    r = subprocess.run([sys.executable, "-m", "cfp.cli.main", "data", "analyze", "--input", str(bad)],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "has no string field 'text'" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = subprocess.run([sys.executable, "-m", "cfp.cli.main", "data", "schemes", "--model", "llama2",
                        "--config", "7B", "--gpu", "TPU9", "--out", str(tmp_path / "s.json")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "unknown gpu 'TPU9'" in r.stderr


def test_schemes_cost_model_and_propose(tmp_path, capsys):
    space = tmp_path / "space.json"
    assert main(["data", "schemes", "--model", "llama2", "--config", "7B", "--gpu", "A100-SXM-80G",
                 "--max-devices", "16", "--out", str(space)]) == 0
    data = json.loads(space.read_text())
    assert data["source"].startswith("estimated") and all(
        s["cp"] * s["tp"] * s["pp"] <= 16 for s in data["schemes"])
    txt = tmp_path / "docs"
    txt.mkdir()
    for i, n in enumerate((100, 3000, 20000, 500, 70)):
        (txt / f"{i}.txt").write_text("y" * n)
    strat = tmp_path / "st.json"
    assert main(["data", "propose", "--schemes", str(space), "--input", str(txt), "--gpus", "16",
                 "--tokens-per-step", "100000", "--out", str(strat)]) == 0
    st = json.loads(strat.read_text())
    assert st["devices"] <= 16 and st["groups"][-1]["max_len"] == 19999
    assert "proposal time:" in capsys.readouterr().out


def test_propose_names_gpus_and_the_values_that_would_do(tmp_path, capsys):
    """Too few --gpus for the longest sequence is blamed on --gpus, with the smallest count that holds it and
    the --max-seq-len that fits the GPUs given."""
    space = tmp_path / "space.json"
    assert main(["data", "schemes", "--model", "llama2", "--config", "7B", "--gpu", "A100-SXM-80G",
                 "--max-devices", "16", "--out", str(space)]) == 0
    schemes = json.loads(space.read_text())["schemes"]
    txt = tmp_path / "docs"
    txt.mkdir()
    (txt / "long.txt").write_text("y" * 9000)
    longest = 8999
    holding = min((s["cp"] * s["tp"] * s["pp"] for s in schemes if s["max_len"] >= longest))
    gpus = holding - 1
    cap = max(s["max_len"] for s in schemes if s["cp"] * s["tp"] * s["pp"] <= gpus)
    capsys.readouterr()
    argv = ["data", "propose", "--schemes", str(space), "--input", str(txt), "--tokens-per-step", "100000",
            "--out", str(tmp_path / "st.json")]
    assert main(argv + ["--gpus", str(gpus)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--gpus {gpus} is too few for the longest sequence ({longest} tokens)" in err
    assert f"give --gpus {holding} or more, or --max-seq-len {cap} or less" in err, err
    assert main(argv + ["--gpus", str(holding)]) == 0                  # the values it names do work
    assert main(argv + ["--gpus", str(gpus), "--max-seq-len", str(cap)]) == 0
    smallest = min(s["cp"] * s["tp"] * s["pp"] for s in schemes)
    assert smallest > 1 and main(argv + ["--gpus", str(smallest - 1)]) == 2
    assert f"--gpus {smallest - 1} is too few: the smallest scheme in {str(space)!r} needs {smallest} GPUs; " \
           f"give --gpus {smallest} or more" in capsys.readouterr().err


def test_mixes_notation_parses_and_bad_values_are_named():
    from cfp.data.train import parse_mixes
    from cfp.errors import ConfigError
    assert parse_mixes("[[(1,2,2),(2,1,1),(1,2,1)], [(1,4,2)]]") == [[(1, 2, 2), (2, 1, 1), (1, 2, 1)],
                                                                            [(1, 4, 2)]]
    assert parse_mixes("[(1,4,2)]") == parse_mixes("(1,4,2)") == [[(1, 4, 2)]]
    for bad, named in (("[[(1,2)]]", "(1, 2)"), ("[[(0,1,1)]]", "(0, 1, 1)"), ("[]", "non-empty"),
                       ("[[(1,2,2)], 7]", "mix 1 7"), ("(1,2", "Hydraulis' notation")):
        with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace(")", r"\)")):
            parse_mixes(bad)


@pytest.mark.slow   # ~1-3 min (it measures three schemes); the engine's parts are tested in test_data_train.py
def test_data_train_runs_hydraulis_mixes_and_verifies(tmp_path, capsys):
    """`cfp data train --mixes` in Hydraulis' notation (a pp=2 pipeline beside a CP one, and a one-device
    mix): the schemes are measured here, every step runs a candidate the log names, and --verify's
    replay passes."""
    import re

    import numpy as np
    docs = tmp_path / "docs"
    docs.mkdir()
    rng = np.random.default_rng(0)
    for i, n in enumerate((30, 60, 90, 120, 45, 70, 20, 100, 80, 50, 110, 35)):
        (docs / f"{i}.txt").write_text("".join(chr(c) for c in rng.integers(97, 123, n)))
    argv = ["data", "train", "--model", "llama2", "--input", str(docs), "--max-seq-len", "128", "--steps", "2",
            "--tokens-per-step", "200", "--mixes", "[[(1,2,2),(2,1,1)], [(1,1,1)]]", "--schemes",
            str(tmp_path / "s.json"), "--verbose", "--verify"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    # every micro-batch carries segment ids: the header names the packed kernel the rows of 4 blocks run
    assert "attention: packed-blocks (packed causal rows of 128 tokens" in out, out
    assert "measured cp1tp2pp2" in out and "measured cp2tp1pp1" in out and "measured cp1tp1pp1" in out
    assert len(re.findall(r"step \d: mix [01] \[", out)) == 2
    assert re.search(r"verify: max relative error \S+ over 2 steps \(ok tolerance", out), out
    # where the time went: a line per step and one for the run (parts in %), one per pipeline with --verbose
    parts = (r"host assign\+dispatch (\d+)% \| real tokens (\d+)% \| padding (\d+)% \| cross-sequence attn (\d+)% "
             r"\| per-micro-batch (\d+)% \| bubble (\d+)% \| idle \(slowest pipeline\) (\d+)% "
             r"\| grad sync\+update (\d+)% ")
    lines = re.findall(r"time: " + parts + r"of (\S+) s \(measured", out)
    assert len(lines) == 3 and all(abs(sum(map(int, x[:8])) - 100) <= 4 for x in lines), lines
    assert len(re.findall(r"pipeline \d: host \S+  real \S+ .* span measured \S+ s, estimated", out)) >= 2
    assert re.search(r"padding: \S+% of the token slots computed", out)
    busy = re.search(r"cores busy: (\S+) of the (\d+) this process may use \(measured", out)
    assert busy and 0 < float(busy[1]) <= int(busy[2]) + 0.01, out
    bad = argv[:-6] + ["--mixes", "[[(1,2)]]", "--schemes", str(tmp_path / "s.json")]
    assert main(bad) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "(1, 2)" in err


def test_data_train_verify_of_moe_is_refused_before_any_work(tmp_path, capsys):
    """MoE + --verify: one line naming why (capacity-limited routing depends on the packing), exit 2, and nothing
    measured or trained first (the scheme file is never written)."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("abcdefgh" * 8)
    schemes = tmp_path / "s.json"
    code = main(["data", "train", "--model", "moe", "--input", str(docs), "--max-seq-len", "64", "--steps", "1",
                 "--schemes", str(schemes), "--verify"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "needs a dense model" in err and "moe's experts keep at most" in err and "packed together" in err
    assert not schemes.exists()
