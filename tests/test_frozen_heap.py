"""``util.frozen_heap``: what is alive is left out of the garbage collector for the block, and only the outermost
block gives it back (a caller's own ``gc.freeze`` stays)."""

from __future__ import annotations

import gc

import pytest

from slabconv.util import frozen_heap, stage_memory


@pytest.fixture(autouse=True)
def _nothing_frozen():
    gc.unfreeze()
    yield
    gc.unfreeze()


class Cycle:
    def __init__(self) -> None:
        self.me = self


def test_the_block_freezes_and_the_outermost_unfreezes():
    with frozen_heap():
        assert gc.get_freeze_count() > 0
        with frozen_heap(), stage_memory():
            pass
        assert gc.get_freeze_count() > 0  # an inner block leaves the outer one's objects frozen
    assert gc.get_freeze_count() == 0


def test_a_callers_own_freeze_stays():
    gc.freeze()
    before = gc.get_freeze_count()
    with frozen_heap():
        pass
    assert gc.get_freeze_count() >= before > 0


def test_garbage_made_inside_the_block_is_collected_and_a_decorated_function_unfreezes():
    import weakref

    @frozen_heap()
    def work() -> weakref.ref:
        cycle = Cycle()
        ref = weakref.ref(cycle)
        del cycle
        gc.collect()  # made after the freeze: a collection inside the block frees it
        return ref

    assert work()() is None
    assert gc.get_freeze_count() == 0
