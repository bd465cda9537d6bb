"""The collector across training steps (`cfp.runtime.heap`): frozen after the first step, given back after."""
import gc

from cfp.runtime import heap


def test_steady_freezes_after_the_first_step_and_unfreezes_at_the_end():
    before = gc.get_freeze_count()
    with heap.steady() as settle:
        assert gc.get_freeze_count() == before     # nothing frozen before a step ran
        settle()
        frozen = gc.get_freeze_count()
        assert frozen > before + 1000              # the interpreter's objects, not a handful
        settle()                                   # later steps freeze nothing more
        assert gc.get_freeze_count() == frozen
    assert gc.get_freeze_count() == 0


def test_steady_unfreezes_when_a_step_fails():
    try:
        with heap.steady() as settle:
            settle()
            raise RuntimeError("a step failed")
    except RuntimeError:
        pass
    assert gc.get_freeze_count() == 0
