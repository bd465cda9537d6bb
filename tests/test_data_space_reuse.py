"""`SchemeSpace.reusable_for`: which saved scheme space `cfp data train` and the batching benchmark reuse. A space
measured for shorter rows holds no scheme for a longer run's sequences (a file left by a 128-token run made a
2048-token `cfp data train` fail with "fits no scheme"); no JAX program runs."""
import pytest

from cfp.data.schemes import CostForm, Scheme, SchemeSpace

ONE = Scheme(1, 1, 1, 2e-9, 3e-6, 4e-3, 512, CostForm.ROWS)
TWO = Scheme(1, 1, 2, 2e-9, 3e-6, 4e-3, 1024, CostForm.ROWS)


def _space(max_seq_len, source="measured: cpu x8, memory budget 48.0 MiB/device", schemes=(ONE, TWO)):
    return SchemeSpace("llama2", "tiny", source, schemes, 1.3, max_seq_len)


@pytest.mark.parametrize("measured_for, run_for, reused", [
    (1024, 1024, True), (128, 2048, False), (2048, 1024, False), (1024, 2048, False)])
def test_a_measured_space_is_reused_only_for_the_row_limit_it_was_measured_for(measured_for, run_for, reused):
    assert _space(measured_for).reusable_for("llama2", "tiny", run_for) is reused


def test_another_model_or_an_estimated_space_is_not_reused():
    assert not _space(1024).reusable_for("gpt", "tiny", 1024)
    assert not _space(1024).reusable_for("llama2", "small", 1024)
    assert not _space(1024, source="estimated: cost model on A100").reusable_for("llama2", "tiny", 1024)


def test_an_older_file_without_its_row_limit_is_measured_again_and_files_round_trip():
    old = _space(None)
    assert not any(old.reusable_for("llama2", "tiny", n) for n in (512, 1024, 2048))
    for space in (old, _space(2048)):
        back = SchemeSpace.from_json(space.to_json())
        assert back == space and back.max_seq_len == space.max_seq_len
    legacy = _space(1024).to_json()
    del legacy["max_seq_len"]
    assert SchemeSpace.from_json(legacy).max_seq_len is None
