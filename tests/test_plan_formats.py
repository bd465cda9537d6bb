"""One plan format: `cfp search --plan-out` and `cfp.autoshard` (which made the golden plans) save the same `Plan`
for the same search, and each is loaded, applied, explained and diffed the same way."""
import importlib.util
from pathlib import Path

import cfp
from cfp.cli.main import main

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("regen", ROOT / "benchmarks" / "regen_golden_plans.py")
regen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(regen)

SAME_FIELDS = ("mesh_shape", "axis_names", "choice", "strategies", "block_fingerprints", "input_specs",
               "output_specs", "shard_state", "version", "estimates", "profile", "num_strategies")


def test_cli_and_api_save_the_same_plan(tmp_path, capsys):
    s = regen.SETTINGS
    out = tmp_path / "cli.json"
    assert main(["search", "--model", "gpt", "--config", s["config"], "--num-layers", str(s["num_layers"]),
                 "--batch-size", str(s["batch_size"]), "--mesh", "8", "--profiler", "estimate", "--gpu", s["gpu"],
                 "--max-combinations", str(s["max_combinations"]), "--verify", "0", "--no-cache", "--no-progress",
                 "--plan-out", str(out)]) == 0
    golden = str(regen.path_for("gpt", "8"))
    cli, api = cfp.load_plan(str(out)), cfp.load_plan(golden)
    for field in SAME_FIELDS:
        assert getattr(cli, field) == getattr(api, field), field
    for key in ("model", "model_config", "batch_size", "time", "dp_time", "profiler", "estimates_gpu"):
        assert cli.metrics[key] == api.metrics[key], key
    ts, args = regen.golden_args("gpt")
    assert cfp.apply_plan(ts.step, "8", *args, plan=str(out)).shardings.choice == api.choice
    capsys.readouterr()
    assert main(["diff", str(out), golden]) == 0
    assert "0 of 9 blocks differ" in capsys.readouterr().out
    assert main(["explain", str(out)]) == 0
    text = capsys.readouterr().out
    assert "head/lm_head" in text and f"estimates ({s['gpu']})" in text
