"""A cluster file's path where the API takes a cluster: `cfp.Cluster.load`, `cfp.find_layout` and `cfp.plan_layout`
give what the parsed file gives; an unreadable, non-YAML or wrong file and a value of no accepted form are one-line
errors naming it."""
from pathlib import Path

import pytest

import cfp
from cfp.errors import ConfigError
from cfp.models import get_config

ROOT = Path(__file__).resolve().parents[1]
MIXED = ROOT / "examples" / "clusters" / "paper-llama2-b.yaml"


def test_cluster_load_equals_the_parsed_file():
    import yaml
    cluster = cfp.Cluster.load(MIXED)
    assert cluster == cfp.parse_cluster(yaml.safe_load(MIXED.read_text()))
    assert cfp.Cluster.load(str(MIXED)) == cluster and len({m.gpu.name for m in cluster.machines}) > 1


def test_find_layout_takes_the_path():
    cfg = get_config("llama2", "tiny", num_layers=4)
    opts = cfp.PlannerOptions(global_batch_size=16)
    local = ROOT / "examples" / "clusters" / "local.yaml"
    by_path = cfp.find_layout(str(local), cfg, opts).layout
    assert by_path == cfp.find_layout(cfp.Cluster.load(local), cfg, opts).layout
    assert by_path.num_devices <= 8


def test_bad_cluster_values_are_one_line(tmp_path):
    (tmp_path / "bad.yaml").write_text("machines: [1\n")
    (tmp_path / "wrong.yaml").write_text("inter_machine_bandwidth: fast\nmachines: []\n")
    cases = [(tmp_path / "absent.yaml", "cannot read cluster file"),
             (tmp_path / "bad.yaml", "is not YAML"),
             (tmp_path / "wrong.yaml", "inter_machine_bandwidth='fast' is not a bandwidth")]
    for path, message in cases:
        with pytest.raises(ConfigError) as e:
            cfp.Cluster.load(path)
        assert message in str(e.value) and "\n" not in str(e.value)
    for value in (3, None, ["a.yaml"]):
        with pytest.raises(ConfigError, match=r"must be a cfp.Cluster, a cluster file's path or its parsed mapping"):
            cfp.plan_layout(None, value, global_batch=8)
        with pytest.raises(ConfigError, match=r"must be a cfp.Cluster, a cluster file's path or its parsed mapping"):
            cfp.find_layout(value, get_config("llama2", "tiny", num_layers=4), cfp.PlannerOptions(global_batch_size=8))
