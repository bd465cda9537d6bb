"""benchmarks/compare.py --override: typed config field overrides, bad ones rejected by name."""
import importlib.util
from pathlib import Path

import pytest

from cfp.errors import ConfigError
from cfp.models import get_config

_spec = importlib.util.spec_from_file_location(
    "compare", Path(__file__).resolve().parents[1] / "benchmarks" / "compare.py")
compare = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compare)


def test_overrides_are_typed_and_reach_the_config():
    o = compare.parse_overrides("vocab_size=16384, capacity_factor=1.5,dtype=bfloat16")
    assert o == {"vocab_size": 16384, "capacity_factor": 1.5, "dtype": "bfloat16"}
    assert get_config("llama2", "tiny", vocab_size=o["vocab_size"]).vocab_size == 16384
    assert compare.parse_overrides("") == {}


@pytest.mark.parametrize("bad", ["vocab_size", "=3", "a=1,b"])
def test_malformed_override_is_a_config_error(bad):
    with pytest.raises(ConfigError, match="is not FIELD=VALUE"):
        compare.parse_overrides(bad)


def test_unknown_field_is_named():
    with pytest.raises(ConfigError, match="vocab"):
        get_config("gpt", "tiny", **compare.parse_overrides("vocab=3"))
