"""Search pass: DP against brute force on synthetic tables, memory budgets, option parsing, plan files."""
import random

import pytest

from cfp.errors import ConfigError, InfeasibleError
from cfp.search.dp import dp_search
from references import dp_brute_force
from cfp.search.options import SearchOptions, parse_bytes
from cfp.search.plan import Plan, load_plan


def _table(rng, n_pos, n_cand):
    cost = [[rng.uniform(1, 10) for _ in range(n_cand)] for _ in range(n_pos)]
    mem = [[rng.randint(1, 100) for _ in range(n_cand)] for _ in range(n_pos)]
    trans = [[[rng.uniform(0, 3) for _ in range(n_cand)] for _ in range(n_cand)] for _ in range(n_pos - 1)]
    return cost, mem, trans


@pytest.mark.parametrize("seed", range(12))
def test_dp_equals_brute_force(seed):
    rng = random.Random(seed)
    cost, mem, trans = _table(rng, rng.randint(1, 5), rng.randint(1, 4))
    lo = sum(min(m) for m in mem)
    hi = sum(max(m) for m in mem)
    for budget in (None, lo, (lo + hi) // 2, hi):
        ref = dp_brute_force(cost, mem, trans, budget)
        best = dp_search(cost, mem, trans, budget)[0]
        assert best.time == pytest.approx(ref.time)
        if budget is not None:
            assert best.memory <= budget
        # the DP's plan really costs what it says
        t = sum(cost[i][j] for i, j in enumerate(best.picks))
        t += sum(trans[i][best.picks[i]][best.picks[i + 1]] for i in range(len(best.picks) - 1))
        assert t == pytest.approx(best.time)
        assert sum(mem[i][j] for i, j in enumerate(best.picks)) == best.memory


def test_budget_changes_choice_and_is_respected():
    cost = [[1.0, 5.0], [1.0, 5.0]]
    mem = [[100, 10], [100, 10]]
    trans = [[[0.0, 0.0], [0.0, 0.0]]]
    assert dp_search(cost, mem, trans, None)[0].picks == (0, 0)
    p = dp_search(cost, mem, trans, 110)[0]
    assert p.memory <= 110 and p.time == 6.0
    assert dp_search(cost, mem, trans, 20)[0].picks == (1, 1)


def test_infeasible_budget_names_smallest():
    with pytest.raises(InfeasibleError, match="needs 20 B"):
        dp_search([[1.0, 2.0]] * 2, [[100, 10]] * 2, [[[0, 0], [0, 0]]], 19)


def test_n_best_sorted():
    rng = random.Random(3)
    cost, mem, trans = _table(rng, 3, 3)
    plans = dp_search(cost, mem, trans, None, n_best=3)
    assert [p.time for p in plans] == sorted(p.time for p in plans)


@pytest.mark.parametrize("text,value", [("2GB", 2 * 10**9), ("512MB", 512 * 10**6), ("1.5GiB", int(1.5 * 2**30)),
                                        ("100", 100), (4096, 4096), ("64 kib", 65536)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("bad", ["2 parsecs", "-1GB", "", "GB", 0, True])
def test_parse_bytes_rejects(bad):
    with pytest.raises(ConfigError, match="memory size"):
        parse_bytes(bad)


def test_search_options_validate():
    assert SearchOptions(memory_per_device="1MB").memory_per_device == 10**6
    with pytest.raises(ConfigError, match="iters=2"):
        SearchOptions().replace(iters=2)
    with pytest.raises(ConfigError, match="unknown search option.*itres"):
        SearchOptions().replace(itres=5)
    with pytest.raises(ConfigError, match="top_k=0"):
        SearchOptions(top_k=0)
    with pytest.raises(ConfigError, match="lots"):
        SearchOptions(memory_per_device="lots")


def test_plan_roundtrip(tmp_path):
    plan = Plan((2, 4), ("x0", "x1"), (1, 0), ("SR = SR x RR @ {0}", "RR = RR x RR @ {}"), ("a", "b"),
                {"[0]['w']": [None, "x1"], "[1]": [["x0", "x1"]]}, ([],), {"time": 1.0}, shard_state=(1,))
    path = plan.save(str(tmp_path / "p" / "plan.json"))
    back = load_plan(path)
    assert back == plan
    # a version-1 file (before state sharding) loads with no sharded state
    import json
    old = json.loads(plan.to_json())
    del old["shard_state"]
    old["version"] = 1
    (tmp_path / "v1.json").write_text(json.dumps(old))
    assert load_plan(str(tmp_path / "v1.json")).shard_state == ()
    from jax.sharding import PartitionSpec
    assert back.partition_specs()["[1]"] == PartitionSpec(("x0", "x1"))


def test_load_plan_errors(tmp_path):
    with pytest.raises(ConfigError, match="nope.json"):
        load_plan(str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ConfigError, match="bad.json|version"):
        load_plan(str(bad))


@pytest.mark.parametrize("argv,needle", [
    (["search", "--model", "gpt", "--memory-per-device", "2parsecs"], "'2parsecs'"),
    (["search", "--model", "gpt", "--profiler", "estimate", "--gpu", "GTX480"], "'GTX480'"),
    (["profile", "--model", "gpt", "--profiler", "estimate"], "needs a gpu"),
    (["enum-benchmark", "--model", "gpt", "--gpu", "GTX480"], "'GTX480'"),
])
def test_cli_bad_inputs_exit_2(argv, needle, capsys):
    """Bad options fail fast (before any capture or compile) with a one-line error and exit code 2."""
    from cfp.cli.main import main
    assert main(argv + ["--no-progress"] if argv[0] != "enum-benchmark" else argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err
