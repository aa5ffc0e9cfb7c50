"""IdleCollector: the collection due next runs between requests; startup objects are frozen while serving."""

import gc

import pytest

from kvtier.server import collector as C


@pytest.fixture
def thresholds():
    saved = gc.get_threshold()
    gc.collect()
    yield
    gc.set_threshold(*saved)
    gc.unfreeze()


def allocate(n: int) -> list:
    return [[] for _ in range(n)]  # containers: each counts in the young generation


def test_nothing_is_collected_before_half_the_young_threshold(thresholds):
    gc.set_threshold(1000, 10, 10)
    collector = C.IdleCollector()
    gc.collect()
    keep = allocate(100)
    assert collector.between_requests() is None
    keep += allocate(600)
    assert collector.between_requests(lambda: True) is None  # a request waits: not now
    assert collector.between_requests() == 0
    assert gc.get_count()[0] < 100


def test_the_middle_and_the_full_generation_in_their_turn(thresholds):
    gc.set_threshold(1000, 2, 2)
    now = [100.0]
    collector = C.IdleCollector(clock=lambda: now[0])  # the test's time: the machine's speed changes nothing
    gc.collect()
    keep = []

    def rounds(n):
        out = []
        for _ in range(n):
            keep.extend(allocate(600))
            out.append(collector.between_requests())
        return out

    # every second collection takes the middle generation; every second of those is due to be full, but a
    # full one runs at most once a second
    assert rounds(8) == [0, 1, 0, 2, 0, 1, 0, 1]
    now[0] += C.FULL_MIN_INTERVAL_SECONDS - 0.01
    assert rounds(2) == [0, 1]
    now[0] += 0.01
    assert rounds(2) == [0, 2]


def test_a_disabled_collector_is_left_alone(thresholds):
    gc.set_threshold(1000, 10, 10)
    collector = C.IdleCollector()
    gc.disable()
    try:
        keep = allocate(900)
        assert collector.between_requests() is None
        assert gc.get_count()[0] >= 900
    finally:
        gc.enable()
    del keep


def test_start_freezes_and_stop_unfreezes(thresholds):
    collector = C.IdleCollector()
    collector.start()
    assert gc.get_freeze_count() > 0
    collector.stop()
    assert gc.get_freeze_count() == 0
