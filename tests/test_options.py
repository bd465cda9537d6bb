"""One home for the search and profiling options: `cfp.autoshard`, `cfp search` and the stage planner
(`cfp train --stage-plans search`) build the same `SearchOptions` record with the same defaults, and given the
same step, budget and options they choose the same plan."""
import dataclasses

import pytest

import cfp
from cfp import api
from cfp.cli.main import DefaultsHelpFormatter, build_parser
from cfp.errors import ConfigError
from cfp.profiling.options import ProfileOptions, default_cache_dir
from cfp.search.options import SearchOptions
from conftest import mlp_grad_step

GPU = "A100-SXM-80G"


def _subparser(parser, name):
    return next(a for a in parser._subparsers._group_actions if a.dest == "command").choices[name]


def test_cli_search_and_profile_build_the_record_with_its_defaults():
    from cfp.cli import search as cli
    parser = build_parser()
    args = parser.parse_args(["search", "--model", "gpt"])
    assert cli.search_options(args) == SearchOptions().replace(cache_dir=default_cache_dir())
    args = parser.parse_args(["profile", "--model", "gpt", "--no-cache"])
    assert cli._popts(args) == ProfileOptions()
    # every flag given reaches its field; a bad value is the record's one-line ConfigError
    args = parser.parse_args(["search", "--model", "gpt", "--top-k", "2", "--verify", "0", "--iters", "3",
                              "--max-combinations", "5", "--profiler", "estimate", "--gpu", GPU, "--no-progress",
                              "--memory-per-device", "2MB", "--no-shard-state", "--link-gbps", "7.5", "--no-cache",
                              "--per-block", "3", "--warmup", "1", "--timing-budget", "4"])
    assert cli.search_options(args) == SearchOptions(
        profile=ProfileOptions(kind="estimate", gpu=GPU, iters=3, warmup=1, max_combinations=5, per_block=3,
                               progress=False),
        memory_per_device=2 * 10**6, top_k=2, verify=0, link_gbps=7.5, shard_state=False, timing_budget=4)
    with pytest.raises(ConfigError, match="iters=2 must be an integer >= 3"):
        cli.search_options(parser.parse_args(["search", "--model", "gpt", "--iters", "2"]))


def test_cli_help_shows_each_records_default():
    """`cfp search --help` states every option's default, and it is the record's."""
    search = _subparser(build_parser(), "search")
    fmt = DefaultsHelpFormatter("cfp search")
    defaults = SearchOptions()
    by_dest = {a.dest: a for a in search._actions}
    fields = [(f, defaults.profile) for f in dataclasses.fields(ProfileOptions)] + \
             [(f, defaults) for f in dataclasses.fields(SearchOptions)]
    flags = [(f, rec) for f, rec in fields if "help" in f.metadata]
    assert {f.name for f, _ in flags} >= {"kind", "gpu", "iters", "warmup", "max_combinations", "top_k", "verify",
                                           "memory_per_device", "shard_state", "progress"}
    for f, rec in flags:
        action = by_dest[f.metadata.get("flag", f.name)]
        value = getattr(rec, f.name)
        text = fmt._get_help_string(action)
        if isinstance(value, bool):
            assert action.default is value and ("(default: on)" if value else "(default: off)") in text
        elif value is None:
            assert action.default is None and "default" in text or f.name == "gpu", (f.name, text)
        else:
            shown = getattr(value, "value", value)
            assert action.default == shown and f"(default: {shown})" in text, (f.name, text)


def test_stage_plans_search_builds_the_record_with_its_defaults():
    from cfp.cli import train
    from cfp.runtime.stage.plans import StagePlanMode
    args = build_parser().parse_args(["train", "--model", "llama2", "--hetero-configs", "[[2]]",
                                      "--stage-plans", "search"])
    opts = train._stage_plans(args)
    assert opts.mode is StagePlanMode.SEARCH and opts.search == SearchOptions()
    # a stage search profiles through the default cache, without a progress bar and without the whole-step user
    # layouts (its pick is among the searched choices); nothing else changes
    assert opts.search_options() == SearchOptions().replace(cache_dir=default_cache_dir(), progress=False,
                                                            layouts=False)
    args = build_parser().parse_args(["train", "--model", "llama2", "--hetero-configs", "[[2]]", "--stage-plans",
                                      "search", "--stage-memory", "3MB", "--stage-profiler", "estimate", "--gpu", GPU])
    given = SearchOptions().replace(memory_per_device="3MB", kind="estimate", gpu=GPU)
    assert train._stage_plans(args).search == given
    assert train._stage_plans(args).search_options() == given.replace(cache_dir=default_cache_dir(), progress=False,
                                                                      layouts=False)
    # every other search and profiling flag of cfp search reaches the stage search as --stage-<flag>
    args = build_parser().parse_args(["train", "--model", "llama2", "--hetero-configs", "[[2]]", "--stage-plans",
                                      "search", "--stage-iters", "3", "--stage-warmup", "1",
                                      "--stage-max-combinations", "5", "--stage-per-block", "3", "--stage-top-k",
                                      "2", "--stage-verify", "0", "--stage-link-gbps", "7.5",
                                      "--no-stage-shard-state", "--stage-timing-budget", "4"])
    assert train._stage_plans(args).search == SearchOptions(
        profile=ProfileOptions(iters=3, warmup=1, max_combinations=5, per_block=3), top_k=2, verify=0,
        link_gbps=7.5, shard_state=False, timing_budget=4)
    with pytest.raises(ConfigError, match="iters=2 must be an integer >= 3"):
        train._stage_plans(build_parser().parse_args(["train", "--model", "llama2", "--hetero-configs", "[[2]]",
                                                      "--stage-plans", "search", "--stage-iters", "2"]))


class _Searched(Exception):
    pass


def test_autoshard_builds_the_record_with_its_defaults(monkeypatch, mlp_problem):
    """autoshard's keywords default to the record's fields: nothing given, the search gets `SearchOptions()`."""
    seen = []

    def search(program, analysis, table, args, sopts, **kw):
        seen.append(sopts)
        raise _Searched

    monkeypatch.setattr(api, "profile", lambda program, analysis, popts, log: seen.append(popts))
    monkeypatch.setattr(api, "search", search)
    args = mlp_problem[1]
    with pytest.raises(_Searched):
        cfp.autoshard(mlp_grad_step, "2x4", *args)
    assert seen == [ProfileOptions(progress=False), SearchOptions().replace(progress=False)]
    seen.clear()
    given = SearchOptions().replace(top_k=2, iters=3, kind="estimate", gpu=GPU)
    with pytest.raises(_Searched):
        cfp.autoshard(mlp_grad_step, "2x4", *args, options=given, verify=0, memory_limit="1MB")
    assert seen[1] == given.replace(verify=0, memory_per_device=10**6, progress=False)
    with pytest.raises(ConfigError, match="must be a SearchOptions"):
        cfp.autoshard(mlp_grad_step, "2x4", *args, options={"top_k": 2})


def test_cfp_search_and_autoshard_choose_the_same_plan(tmp_path, capsys):
    """The same model step, budget and flags: `cfp search`'s plan file and `cfp.autoshard` on the record the
    CLI built from those flags hold the same choice (the estimate profiler: deterministic)."""
    from cfp.cli import search as cli
    from cfp.cli.common import build_step
    from cfp.cli.main import main
    argv = ["search", "--model", "gpt", "--num-layers", "1", "--batch-size", "8", "--mesh", "2x4", "--profiler",
            "estimate", "--gpu", GPU, "--max-combinations", "3", "--top-k", "2", "--verify", "0", "--no-progress",
            "--memory-per-device", "3MB", "--cache-dir", str(tmp_path / "cache")]
    assert main(argv + ["--plan-out", str(tmp_path / "plan.json")]) == 0
    from_cli = cfp.load_plan(str(tmp_path / "plan.json"))
    args = build_parser().parse_args(argv)
    step, example_args, mesh = build_step(args)
    from_api = cfp.autoshard(step, mesh, *example_args, options=cli.search_options(args)).plan
    assert (from_api.choice, from_api.shard_state) == (from_cli.choice, from_cli.shard_state)
    # the budget binds (data parallel needs 3.4 MB per device here): the plan is not data parallel
    assert from_cli.shard_state or any(from_cli.choice), "the budget did not change the plan; lower it"


def test_stage_planner_and_autoshard_choose_the_same_plan(tmp_path):
    """A one-stage layout: the stage planner's search (`--stage-plans search`) and `cfp.autoshard` on that
    stage's training step, with one `SearchOptions`, pick the same per-block choice and state sharding."""
    from cfp.layout import Layout
    from cfp.models import get_config
    from cfp.runtime.stage.cases import example_args, stage_cases
    from cfp.runtime.stage.plans import StagePlanOptions
    from cfp.runtime.stage.replay import stage_step
    from cfp.runtime.stage.plan_search import search_stage_plans
    from programs import zoo_batch, zoo_cache
    opts = SearchOptions().replace(kind="estimate", gpu=GPU, cache_dir=str(tmp_path), max_combinations=2, top_k=1,
                                   verify=0, memory_per_device="380KB")
    layout = Layout.from_lists([[2]], [[1]], [2], [1])
    cfg = get_config("llama2", "tiny", num_layers=1, seq_len=8, vocab_size=64, hidden_size=32, ffn_size=64)
    cache, batch = zoo_cache("llama2", cfg), zoo_batch("llama2", cfg)
    (plan,) = search_stage_plans(layout, cache, StagePlanOptions("search", search=opts), batch,
                                 log=lambda *_: None).plans
    (case,) = stage_cases(layout, cache, batch)
    step = cfp.autoshard(stage_step(case.prog), case.prog.mesh, *example_args(case, cache), options=opts)
    assert (step.plan.choice, step.plan.shard_state) == (plan.sharding.choice, plan.sharding.shard_state)
    # the budget binds (data parallel needs 429 KB per device here): the plan is not data parallel
    assert plan.sharding.shard_state or any(plan.sharding.choice), "the budget did not change the plan; lower it"
