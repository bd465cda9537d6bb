"""Validators at their boundaries, property-based (hypothesis, the deterministic profile of conftest.py).

For layouts (`cfp.layout.Layout`: construction, JSON round trip, `validate_for`; layout files), cluster files
(`cfp.planner.cluster.parse_cluster`), plan files (`cfp.search.plan`) and the passes' options dataclasses:
every valid input generated is accepted and round-trips to an equal value; every input made invalid in one
place raises `ConfigError` (plans: `PlanError`) whose one-line message names the bad value -- never an assert,
an IndexError, a KeyError or a TypeError, and never silently accepted.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cfp.errors import ConfigError, PlanError
from cfp.layout import Layout, Pipeline, Stage
from cfp.models import get_config


def named(value, message: str) -> bool:
    """Whether `message` names `value`: its repr (cut like the validators cut it), its text for a string, an
    empty container said to be empty, or for a container the element or entry at fault."""
    if isinstance(value, (list, dict, tuple)):
        if not value:
            return "empty" in message or repr(value) in message
        parts = list(value.values()) if isinstance(value, dict) else list(value)
        return repr(value)[:40] in message or any(named(v, message) for v in parts)
    if value == "" and type(value) is str:
        return "''" in message or "needs" in message
    return repr(value)[:40] in message or (isinstance(value, str) and value in message)


def rejects(fn, value, error=ConfigError) -> str:
    """`fn()` must raise `error` (nothing else) naming `value`; returns the message."""
    with pytest.raises(error) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg and named(value, msg), msg
    return msg


# ----------------------------------------------------------------------------- layouts
@st.composite
def layouts(draw, max_pipelines: int = 3, num_layers: int | None = None):
    """A valid layout: 1-3 pipelines of 1-3 stages over distinct devices, layers split any way, cp 1-2, tp 1/2/4,
    batches any multiple of their micro-batch counts, machines given or not."""
    num_layers = num_layers or draw(st.integers(1, 6))
    pool = iter(draw(st.permutations(range(80))))
    pipes = []
    for _ in range(draw(st.integers(1, max_pipelines))):
        n = draw(st.integers(1, min(3, num_layers)))
        cuts = sorted(draw(st.sets(st.integers(1, num_layers - 1), min_size=n - 1, max_size=n - 1))) \
            if n > 1 else []
        stages = []
        for a, b in zip([0, *cuts], [*cuts, num_layers]):
            cp, tp = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2, 4]))
            stages.append(Stage(tuple(next(pool) for _ in range(cp * tp)), b - a,
                                draw(st.none() | st.integers(0, 3)), cp))
        chunks = draw(st.integers(1, 4))
        pipes.append(Pipeline(tuple(stages), chunks * draw(st.integers(1, 3)), chunks))
    return Layout(tuple(pipes))


@given(layouts())
def test_valid_layouts_round_trip(layout):
    assert Layout.from_json(layout.to_json()) == layout
    assert Layout.from_json(json.loads(json.dumps(layout.to_json()))) == layout
    assert Layout(layout.pipelines) == layout and layout.checked() == layout
    if all(s.cp == 1 for p in layout.pipelines for s in p.stages):
        assert Layout.from_lists(**layout.lists()) == layout.without_machines()
    assert sorted(layout.devices) == sorted(set(layout.devices))


# one field of a valid layout document made invalid: (where, field, bad values)
BAD_STAGE = {
    "layers": [0, -1, True, 2.5, "2", None, []],
    "devices": [[], [-1], ["0"], [1.0], [True], None, "0,1"],
    "cp": [0, -1, True, "2", 2.5],
    "machine": [-1, True, "0", 1.5],
}
BAD_PIPELINE = {"batch": [0, -2, True, 3.0, "4", None], "chunks": [0, -1, True, 2.0, None],
                "stages": [[], None, {}, "stage"]}
BAD_TOP = {"version": [1, "2", None, 3, True], "pipelines": [[], None, {}, "p"]}


BAD_LAYOUT_CASES = ([("stage", f, v) for f, vs in BAD_STAGE.items() for v in vs]
                    + [("pipeline", f, v) for f, vs in BAD_PIPELINE.items() for v in vs]
                    + [("top", f, v) for f, vs in BAD_TOP.items() for v in vs]
                    + [("unknown", f, None) for f in ("tp", "layer", "devices_id")]
                    + [("shape", kind, None) for kind in ("shared", "twice", "batch")])


def _break(doc: dict, level: str, field: str, value, p: int, s: int):
    """Break `doc` (a valid layout's JSON) at pipeline `p`, stage `s` (both modulo their counts); the bad value."""
    pipe = doc["pipelines"][p % len(doc["pipelines"])]
    stage = pipe["stages"][s % len(pipe["stages"])]
    if level in ("stage", "pipeline", "top"):
        {"stage": stage, "pipeline": pipe, "top": doc}[level][field] = value
        return value
    if level == "unknown":
        stage[field] = 1
        return field
    if field == "batch":                      # a batch its micro-batch count does not divide
        pipe["chunks"] = pipe["batch"] + 1
        return pipe["chunks"]
    others = [d for q in doc["pipelines"] for t in q["stages"] if t is not stage for d in t["devices"]]
    value = others[0] if field == "shared" and others else stage["devices"][0]
    stage["devices"] = stage["devices"] + [value]     # in two stages, or twice in one
    stage.pop("cp", None)
    return value


@pytest.mark.parametrize("level, field, value", BAD_LAYOUT_CASES)
@given(layouts(), st.integers(0, 8), st.integers(0, 8))
@settings(max_examples=8)
def test_a_layout_document_broken_in_one_place_is_a_config_error_naming_it(level, field, value, layout, p, s):
    doc = layout.to_json()
    bad = _break(doc, level, field, copy.deepcopy(value), p, s)
    rejects(lambda: Layout.from_json(doc), bad)


@given(layouts(), st.integers(1, 2))
def test_pipelines_of_different_depths_are_refused(layout, extra):
    doc = layout.to_json()
    doc["pipelines"].append(copy.deepcopy(doc["pipelines"][0]))
    stage = doc["pipelines"][-1]["stages"][-1]
    stage["layers"] += extra
    shift = 1000
    for st_ in doc["pipelines"][-1]["stages"]:
        st_["devices"] = [d + shift for d in st_["devices"]]
    msg = rejects(lambda: Layout.from_json(doc), layout.num_layers)
    assert str(layout.num_layers + extra) in msg


@given(layouts(num_layers=4), st.sampled_from([1, 2, 3, 4]), st.sampled_from([2, 4, 8]), st.integers(1, 128))
def test_validate_for_accepts_exactly_the_layouts_that_fit(layout, heads_mult, heads, devices):
    """`validate_for(num_layers, num_devices, heads)` passes iff the layers match, every stage's TP degree divides
    the heads and every device id exists; otherwise its ConfigError names the offending value."""
    num_heads = heads * heads_mult // 2 or 1
    cfg = get_config("gpt", "tiny", num_layers=4, num_heads=num_heads, hidden_size=num_heads * 16)
    bad_tp = [s.tp for p in layout.pipelines for s in p.stages if num_heads % s.tp]
    bad_dev = [d for d in layout.devices if d >= devices]
    check = lambda c, n=None: layout.validate_for(c.num_layers, n, (c.num_heads, c.num_heads))
    if not bad_tp and not bad_dev:
        assert check(cfg, devices) is layout
    elif bad_tp:
        rejects(lambda: check(cfg, devices), bad_tp[0])
    else:
        rejects(lambda: check(cfg, devices), bad_dev[0])
    other = get_config("gpt", "tiny", num_layers=5, num_heads=num_heads, hidden_size=num_heads * 16)
    rejects(lambda: check(other), 5)


BAD_BUILT = {"layers": [0, -1, True, 1.5, "1", None], "cp": [0, -1, True, 1.5, "1", 3],
             "device": [-1, True, 1.5, "1", None]}


@pytest.mark.parametrize("field, bad", [(f, v) for f, vs in BAD_BUILT.items() for v in vs])
def test_stages_built_directly_are_checked_like_documents(field, bad):
    stage = {"layers": lambda: Stage((0,), bad), "cp": lambda: Stage((0, 1), 1, None, bad),
             "device": lambda: Stage((0, bad), 1)}[field]()
    rejects(lambda: Layout((Pipeline((stage,), 1, 1),)), bad)


@given(layouts(num_layers=2), st.sampled_from(["1f1b", "gpipe"]))
def test_layout_files_round_trip(layout, schedule):
    from cfp.planner.layout_file import LayoutFile, parse_layout_file
    from cfp.schedules.registry import ScheduleName
    lf = LayoutFile("gpt", "tiny", {"num_layers": 2}, ScheduleName(schedule), layout, {"step_time": 1.0}, {})
    back = parse_layout_file(json.loads(json.dumps(lf.to_dict())))
    assert back == lf


BAD_LAYOUT_FILE = {"format": ["cfp-layout/3", None, 2], "model": ["gpt5", 3, None], "config": ["huge", 7],
                   "schedule": ["zigzag", 1], "overrides": [{"num_layers": 0}, {"bogus": 1}, [1], "x"],
                   "estimate": [[1], "x"], "cluster": [[1], 3]}


@pytest.mark.parametrize("field, value", [(f, v) for f, vs in BAD_LAYOUT_FILE.items() for v in vs])
@given(layouts(num_layers=2))
@settings(max_examples=5)
def test_a_layout_file_broken_in_one_place_is_a_config_error(field, value, layout):
    from cfp.planner.layout_file import LayoutFile, parse_layout_file
    from cfp.schedules.registry import ScheduleName
    doc = LayoutFile("gpt", "tiny", {"num_layers": 2}, ScheduleName.GPIPE, layout, {}, {}).to_dict()
    doc[field] = value = copy.deepcopy(value)
    if field == "overrides" and isinstance(value, dict):
        value = next(iter(value.values())) if "num_layers" in value else "bogus"
    if field == "format":
        with pytest.raises(ConfigError):
            parse_layout_file(doc)
        return
    rejects(lambda: parse_layout_file(doc), value)


# ----------------------------------------------------------------------------- cluster files
UNITS = ["", "k", "M", "G", "T", "Ki", "Mi", "Gi"]


def _size(draw, suffix: str, lo: float = 1e-2, hi: float = 1e4) -> str:
    number = draw(st.floats(lo, hi, allow_nan=False, allow_infinity=False))
    text = draw(st.sampled_from([f"{number:g}", f"{number:.3f}", f"{int(number) + 1}", f"{number:.2e}"]))
    return f"{text}{draw(st.sampled_from(['', ' ']))}{draw(st.sampled_from(UNITS))}{suffix}"


@st.composite
def cluster_documents(draw):
    from cfp.hardware.gpus import GPUS
    machines = []
    for _ in range(draw(st.integers(1, 3))):
        m = {"gpu": draw(st.sampled_from(sorted(GPUS))), "count": draw(st.integers(1, 16)),
             "intra_bandwidth": _size(draw, draw(st.sampled_from(["B/s", "b/s", "Bps"])))}
        if draw(st.booleans()):
            m["memory"] = _size(draw, "B", 1.0)
        if draw(st.booleans()):
            m["repeat"] = draw(st.integers(1, 3))
        machines.append(m)
    return {"inter_machine_bandwidth": _size(draw, "B/s"), "machines": machines}


@given(cluster_documents())
def test_valid_clusters_parse_and_round_trip(doc):
    from cfp.planner.cluster import parse_cluster
    cl = parse_cluster(doc)
    assert len(cl.machines) == sum(m.get("repeat", 1) for m in doc["machines"])
    assert cl.num_devices == sum(m["count"] * m.get("repeat", 1) for m in doc["machines"])
    assert all(math.isfinite(x) and x > 0 for m in cl.machines for x in (m.intra_bandwidth, m.memory))
    back = parse_cluster(cl.to_dict())
    assert back.num_devices == cl.num_devices and [m.gpu for m in back.machines] == [m.gpu for m in cl.machines]
    for a, b in zip(back.machines, cl.machines):
        assert a.intra_bandwidth == pytest.approx(b.intra_bandwidth, rel=1e-12)
        assert a.memory == pytest.approx(b.memory, rel=1e-12)
    assert back.inter_bandwidth == pytest.approx(cl.inter_bandwidth, rel=1e-12)


BAD_MACHINE = {
    "gpu": ["TPU-v9", 5, None, ""],
    "count": [0, -1, True, "8", 2.5, None],
    "intra_bandwidth": ["25GB", "-1GB/s", "0GB/s", "1e400GB/s", 25, "fast", None, "25XB/s"],
    "memory": ["0GB", "-8GB", "1e999GB", "80", 80, "eighty GB"],
    "repeat": [0, -2, True, "2", 1.5],
}


BAD_CLUSTER_CASES = ([("machine", f, v) for f, vs in BAD_MACHINE.items() for v in vs]
                     + [("inter", "inter_machine_bandwidth", v) for v in BAD_MACHINE["intra_bandwidth"]]
                     + [("unknown", "top", None), ("unknown", "machine", None)]
                     + [("top", "machines", v) for v in ([], None, {}, "a100")])


@pytest.mark.parametrize("where, field, value", BAD_CLUSTER_CASES)
@given(cluster_documents(), st.integers(0, 5))
@settings(max_examples=8)
def test_a_cluster_broken_in_one_place_is_a_config_error_naming_it(where, field, value, doc, m):
    from cfp.planner.cluster import parse_cluster
    value = copy.deepcopy(value)
    if where == "machine":
        doc["machines"][m % len(doc["machines"])][field] = value
    elif where == "inter":
        doc["inter_machine_bandwidth"] = value
    elif where == "unknown":
        (doc if field == "top" else doc["machines"][m % len(doc["machines"])])[value := "bandwith"] = "1GB/s"
    else:
        doc["machines"] = value
    rejects(lambda: parse_cluster(doc), value)


# ----------------------------------------------------------------------------- plan files
@st.composite
def plans(draw):
    from cfp.search.plan import Plan
    shape = tuple(draw(st.lists(st.sampled_from([1, 2, 4, 8]), min_size=1, max_size=2)))
    names = tuple(draw(st.lists(st.text("abcxyz0123", min_size=1, max_size=3), min_size=len(shape),
                                max_size=len(shape), unique=True)))
    blocks = draw(st.integers(1, 5))
    counts = tuple(draw(st.lists(st.integers(1, 6), min_size=blocks, max_size=blocks)))
    choice = tuple(draw(st.integers(0, n - 1)) for n in counts)
    entry = st.none() | st.sampled_from(names) | st.lists(st.sampled_from(names), min_size=1, max_size=len(names),
                                                          unique=True)
    spec = st.lists(entry, max_size=3).filter(lambda es: _distinct_axes(es))
    inputs = draw(st.dictionaries(st.sampled_from(["[0]['w']", "[0]['b']", "[1]", "[2]['mu']['w']"]), spec))
    shard = tuple(sorted(draw(st.sets(st.integers(0, blocks - 1)))))
    return Plan(shape, names, choice, tuple(f"S{b}" for b in range(blocks)), tuple(f"fp{b}" for b in range(blocks)),
                inputs, tuple(draw(st.lists(spec, max_size=3))), {"time": draw(st.floats(0, 10))}, shard,
                num_strategies=counts)


def _distinct_axes(entries) -> bool:
    axes = [a for e in entries for a in ([] if e is None else [e] if isinstance(e, str) else e)]
    return len(axes) == len(set(axes))


@given(plans())
def test_valid_plans_round_trip(plan):
    from cfp.search.plan import Plan
    assert Plan.from_json(plan.to_json()) == plan


BAD_PLAN = {
    "version": [0, 5, "3", None, 2.5],
    "mesh_shape": [[], [0], [-2], ["2"], [True], None, 8],
    "axis_names": [["x0", "x0"], [1, 2], "x0"],
    "choice": [[-1], ["0"], [True], None, 3],
    "strategies": [None, [1], "S0"],
    "block_fingerprints": [None, [None]],
    "input_specs": [[], None, {"[0]": "x0"}, {"[0]": ["nope"]}, {"[0]": [["x0", "x0"]]}, {"[0]": [1]}],
    "output_specs": [None, {}, [["nope"]], ["x0"]],
    "metrics": [[], None, "fast"],
    "shard_state": [[99], [-1], ["0"], None, 0],
    "num_strategies": [[0], ["2"], 3, [None]],
    "estimates": [[1], "x"],
    "profile": [[[]], 2],
}


@pytest.mark.parametrize("field, value", [(f, v) for f, vs in BAD_PLAN.items() for v in vs])
@given(plans())
@settings(max_examples=8)
def test_a_plan_broken_in_one_place_is_a_plan_error_naming_it(field, value, plan):
    from cfp.search.plan import Plan
    doc = json.loads(plan.to_json())
    value = copy.deepcopy(value)
    if field == "axis_names" and value == ["x0", "x0"] and len(doc["mesh_shape"]) == 1:
        value = ["x0", "x1", "x2"]
    if field in ("input_specs", "output_specs") and value not in (None, [], {}) and not isinstance(value, str):
        value = json.loads(json.dumps(value).replace('"x0"', json.dumps(doc["axis_names"][0])))
    doc[field] = value
    msg = rejects(lambda: Plan.from_json(json.dumps(doc)), value, PlanError)
    assert field in msg


@given(plans(), st.integers(0, 4))
def test_a_choice_outside_its_strategies_is_refused(plan, extra):
    from cfp.search.plan import Plan
    doc = json.loads(plan.to_json())
    b = extra % len(doc["choice"])
    doc["choice"][b] = doc["num_strategies"][b] + extra
    rejects(lambda: Plan.from_json(json.dumps(doc)), doc["choice"][b], PlanError)


def test_plan_files_that_are_not_plans_are_plan_errors(tmp_path):
    from cfp.search.plan import load_plan
    for name, content in (("empty.json", b""), ("list.json", b"[1, 2]"), ("latin1.json", b"\xff\xfe{"),
                          ("truncated.json", b'{"version": 3, "mesh_shape": [8]')):
        path = tmp_path / name
        path.write_bytes(content)
        rejects(lambda: load_plan(str(path)), str(path), PlanError)
    rejects(lambda: load_plan(str(tmp_path / "missing.json")), str(tmp_path / "missing.json"), PlanError)


# ----------------------------------------------------------------------------- options dataclasses
BAD_NUMBERS = [0, -1, True, False, 1.5, "3", None, math.nan, math.inf, -math.inf]


def _option_cases():
    from cfp.planner.options import PlannerOptions
    from cfp.planner.step_features import StepFeatures
    from cfp.profiling.options import ProfileOptions
    from cfp.search.options import SearchOptions
    # (options class, required kwargs, field, valid values, invalid values)
    return [
        (SearchOptions, {}, "top_k", [1, 4], BAD_NUMBERS),
        (SearchOptions, {}, "verify", [0, 2], [-1, True, 1.5, "2", None, math.nan]),
        (SearchOptions, {}, "profile", [ProfileOptions(), ProfileOptions(iters=9)], [None, {"iters": 3}, 3]),
        (SearchOptions, {}, "timing_budget", [0.5, 10, 60.0], [0, -1, True, "10", None, math.nan, math.inf]),
        (SearchOptions, {}, "link_gbps", [None, 1.0, 25], [0, -3.0, True, "25", math.nan, math.inf]),
        (SearchOptions, {}, "memory_per_device", [None, "2GB", 10**9, "1.5GiB"],
         [0, -1, True, "lots", "0GB", "2 parsecs", math.nan, math.inf, []]),
        (SearchOptions, {}, "shard_state", [True, False], [1, 0, "yes", None]),
        (SearchOptions, {}, "donate", [True, False], [1, "no", None]),
        (SearchOptions, {}, "layouts", [True, False], [1, "no", None]),
        (SearchOptions, {}, "budget_fraction", [None, 0.85, 1, 2.0], [0, -0.5, True, "0.85", math.nan, math.inf]),
        (ProfileOptions, {}, "iters", [3, 10], [2, 0, True, 3.0, None, math.inf]),
        (ProfileOptions, {}, "warmup", [0, 2], [-1, True, 1.0, 0.5, None]),
        (ProfileOptions, {}, "max_combinations", [1, 12], BAD_NUMBERS),
        (ProfileOptions, {}, "per_block", [1, 3], BAD_NUMBERS),
        (ProfileOptions, {}, "pool_limit", [1, 8192], BAD_NUMBERS),
        (ProfileOptions, {"gpu": "A100-SXM-80G"}, "kind", ["measure", "estimate"], ["timing", 3, None]),
        (ProfileOptions, {"kind": "estimate"}, "gpu", ["A100-SXM-80G", "h100 sxm"], ["TPU-v9", "", 7]),
        (ProfileOptions, {}, "overlap_compile", [True, False], [1, "yes", None]),
        (ProfileOptions, {}, "progress", [True, False], [1, "no", None]),
        (PlannerOptions, {}, "global_batch_size", [1, 64], BAD_NUMBERS),
        (PlannerOptions, {"global_batch_size": 8}, "recompute", ["auto", "none", "selective", "full"],
         ["sometimes", None, 3, ""]),
        (PlannerOptions, {"global_batch_size": 8}, "micro_batch_sizes", [(1,), (1, 2, 4), [8, 2]],
         [(), (0,), (1, -2), 4, None, "12", (1.5,), (True,)]),
        (PlannerOptions, {"global_batch_size": 8}, "max_pipelines", [None, 1, 16], BAD_NUMBERS[:-4]),
        (PlannerOptions, {"global_batch_size": 8}, "refine_evaluations", [1, 3000], BAD_NUMBERS),
        (PlannerOptions, {"global_batch_size": 8}, "schedule", ["1f1b", "gpipe"], ["zigzag", None, 1]),
        (PlannerOptions, {"global_batch_size": 8}, "refine", [True, False], [1, "no", None]),
        (PlannerOptions, {"global_batch_size": 8}, "phase2_metis", [True, False], [0, "yes", None]),
        (StepFeatures, {}, "recompute", ["full", "none"], ["some", None, 1]),
        (StepFeatures, {}, "grad_sync", ["gather", "all-reduce", "sharded"], ["ring", None, 2]),
        (StepFeatures, {}, "grad_bytes", [2, 4], [3, 0, True, "4", None]),
        (StepFeatures, {}, "overlap_grad_sync", [True, False], [1, "yes", None]),
        (StepFeatures, {}, "fused_attention", [True, False, None], [1, "yes", 0]),
    ]


CASES = _option_cases()


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{c[0].__name__}.{c[2]}" for c in CASES])
def test_options_accept_valid_values_and_name_invalid_ones(case):
    cls, required, field, valid, invalid = CASES[case]
    for good in valid:
        opts = cls(**required, **{field: good})
        assert dataclasses.replace(opts) == opts          # validation is idempotent: a valid record stays valid
    for bad in invalid:
        rejects(lambda: cls(**required, **{field: bad}), bad)


def test_every_options_field_has_a_case():
    """A field added to an options class without boundary cases here fails."""
    from cfp.planner.options import PlannerOptions
    from cfp.planner.step_features import StepFeatures
    from cfp.profiling.options import ProfileOptions
    from cfp.search.options import SearchOptions
    covered = {(c[0], c[2]) for c in CASES}
    skip = {(ProfileOptions, "cache_dir"), (PlannerOptions, "stage_times")}
    for cls in (SearchOptions, ProfileOptions, PlannerOptions, StepFeatures):
        missing = {(cls, f.name) for f in dataclasses.fields(cls)} - covered - skip
        assert not missing, sorted(name for _, name in missing)
