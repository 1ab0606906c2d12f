"""Load on demand's pure decisions with a fake clock: the learned load time, the minimum
residency, and the loads-per-minute bound."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from tests.conftest import examples
from zeroserve.broker.server.thrash import DEFAULT_LOAD_S, WINDOW_S, LoadTimes, ThrashGuard


def test_a_load_time_is_learned_per_model_with_a_default_before_the_first() -> None:
    times = LoadTimes()
    assert times.predict("a") == DEFAULT_LOAD_S
    times.observe("a", 0.2)
    assert times.predict("a") == 0.2
    times.observe("a", 1.2)
    assert abs(times.predict("a") - 0.5) < 1e-9   # moves by 0.3 of the difference
    times.observe("b", 0.1)
    times.observe("c", 0.3)
    assert times.predict("never-loaded") == 0.3   # the median of the models seen
    times.forget("a")
    assert times.predict("a") == 0.2


def test_a_model_is_not_evicted_before_its_minimum_residency() -> None:
    guard = ThrashGuard(min_residency_s=5.0, max_loads_per_minute=0)
    assert guard.may_evict("w", "a", 0.0), "a model it never loaded may go at any time"
    guard.resident("w", "a", 10.0)
    assert not guard.may_evict("w", "a", 14.9)
    assert guard.may_evict("w", "a", 15.0)
    assert guard.may_evict("other", "a", 11.0), "residency is per worker"
    guard.gone("w")
    assert guard.may_evict("w", "a", 11.0)


def test_loads_per_minute_are_bounded_and_the_wait_is_to_the_oldest_start() -> None:
    guard = ThrashGuard(min_residency_s=0.0, max_loads_per_minute=3)
    for t in (0.0, 10.0, 20.0):
        assert guard.load_wait_s(t) == 0.0
        guard.started(t)
    assert guard.load_wait_s(30.0) == 30.0   # the start at 0 leaves the window at 60
    assert guard.loads_in_window(30.0) == 3
    assert guard.load_wait_s(60.0) == 0.0
    assert ThrashGuard(0.0, 0).load_wait_s(0.0) == 0.0, "0: no bound"


@settings(max_examples=examples(200), deadline=None)
@given(bound=st.integers(1, 5),
       gaps=st.lists(st.floats(0.0, 30.0, allow_nan=False), min_size=1, max_size=60))
def test_no_window_of_a_minute_holds_more_starts_than_the_bound(bound: int,
                                                               gaps: list[float]) -> None:
    """Whoever starts a load only when the guard says it may never exceeds the bound."""
    guard, now, starts = ThrashGuard(0.0, bound), 0.0, []
    for gap in gaps:
        now += gap
        wait = guard.load_wait_s(now)
        assert wait >= 0.0
        if wait == 0.0:
            guard.started(now)
            starts.append(now)
        else:
            assert guard.load_wait_s(now + wait + 1e-6) == 0.0, "its wait is enough"
    for s in starts:
        assert sum(1 for t in starts if s <= t < s + WINDOW_S) <= bound
