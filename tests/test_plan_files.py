"""Plan and profile-cache files are validated on load; a saved plan must fit the step it is applied to."""
import json
import logging

import pytest

import cfp
from cfp.errors import ConfigError, PlanError


@pytest.fixture(scope="module")
def saved(mlp_problem, tmp_path_factory):
    step_fn, args = mlp_problem
    sharded = cfp.autoshard(step_fn, "2x4", *args, profiler="estimate", gpu="A100-SXM-80G", max_combinations=4,
                            verify=0)
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    sharded.plan.save(str(path))
    return sharded, json.loads(path.read_text())


def _write(tmp_path, content) -> str:
    path = tmp_path / "p.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


def _edit(d, **changes):
    d = json.loads(json.dumps(d))
    for k, v in changes.items():
        if v is None:
            del d[k]
        else:
            d[k] = v
    return d


@pytest.mark.parametrize("content,field", [
    ([], "JSON object"), ("hello", "not JSON"), ({"version": 2}, "missing field 'mesh_shape'"),
])
def test_load_plan_rejects_non_plans_naming_the_file(tmp_path, content, field):
    path = _write(tmp_path, content)
    with pytest.raises(PlanError, match=field) as e:
        cfp.load_plan(path)
    assert path in str(e.value) and isinstance(e.value, ConfigError)


@pytest.mark.parametrize("changes,field", [
    ({"mesh_shape": [2, -4]}, "mesh_shape"), ({"mesh_shape": "2x4"}, "mesh_shape"),
    ({"axis_names": ["x0"]}, "axis_names"), ({"choice": [0, -1]}, "choice"),
    ({"input_specs": {"[1]": ["nope"]}}, r"input_specs\[\[1\]\]"), ({"input_specs": []}, "input_specs"),
    ({"input_specs": None}, "missing field 'input_specs'"), ({"version": 7}, "version"),
    ({"shard_state": [99]}, "shard_state"), ({"output_specs": [[3]]}, r"output_specs\[0\]"),
])
def test_load_plan_names_the_bad_field(saved, tmp_path, changes, field):
    path = _write(tmp_path, _edit(saved[1], **changes))
    with pytest.raises(PlanError, match=field) as e:
        cfp.load_plan(path)
    assert path in str(e.value)


def test_saved_plan_reapplies_and_mismatches_name_what_differs(saved, mlp_problem, tmp_path):
    sharded, d = saved
    step_fn, args = mlp_problem
    assert cfp.load_plan(_write(tmp_path, d)) == sharded.plan
    again = cfp.apply_plan(step_fn, "2x4", *args, plan=_write(tmp_path, d))
    assert again.shardings == sharded.shardings and again.plan == sharded.plan
    assert again.search is None and sharded.search is not None and sharded.profile is not None
    by_choice = cfp.apply_plan(step_fn, "2x4", *args, plan=list(sharded.plan.choice))
    assert by_choice.plan.input_specs == sharded.plan.input_specs
    fps = list(d["block_fingerprints"])
    fps[1] = "0" * len(fps[1])
    with pytest.raises(PlanError, match="block 1 differs: the plan's fingerprint is 0+, this step's is"):
        cfp.apply_plan(step_fn, "2x4", *args, plan=_write(tmp_path, _edit(d, block_fingerprints=fps)))
    specs = dict(d["input_specs"])
    first = sorted(specs)[0]
    specs[first] = [["x0", "x1"]] + specs[first][1:] if specs[first] != [["x0", "x1"]] else [None]
    with pytest.raises(PlanError, match=rf"input {__import__('re').escape(first)}: the plan stores spec"):
        cfp.apply_plan(step_fn, "2x4", *args, plan=_write(tmp_path, _edit(d, input_specs=specs)))
    with pytest.raises(PlanError, match=r"mesh \[2, 4\]|mesh \(2, 4\)"):
        cfp.apply_plan(step_fn, "8", *args, plan=_write(tmp_path, d))


@pytest.mark.parametrize("content", [[], {"version": 3, "segment": {"kind": 0}},
                                     "negative", "not json {"])
def test_corrupt_profile_cache_is_ignored_logged_and_rebuilt(mlp_problem, tmp_path, caplog, content):
    step_fn, args = mlp_problem
    cache = tmp_path / "cache"
    kw = dict(profiler="estimate", gpu="A100-SXM-80G", max_combinations=4, verify=0, cache_dir=str(cache))
    first = cfp.autoshard(step_fn, "2x4", *args, **kw)
    files = sorted(cache.glob("*.json"))
    assert files and first.profile.compiles > 0
    for f in files:
        if content == "negative":
            d = json.loads(f.read_text())
            d["segment"]["entries"][0]["time"] = -1.0
            f.write_text(json.dumps(d))
        else:
            f.write_text(content if isinstance(content, str) else json.dumps(content))
    with caplog.at_level(logging.WARNING, logger="cfp"):
        second = cfp.autoshard(step_fn, "2x4", *args, **kw)
    assert second.profile.compiles == first.profile.compiles          # profiled again, not read
    assert all(str(f) in caplog.text for f in files) and "ignoring unreadable or outdated profile cache file" in caplog.text
    assert second.plan == first.plan
    third = cfp.autoshard(step_fn, "2x4", *args, **kw)                    # the rebuilt files are valid
    assert third.profile.compiles == 0
