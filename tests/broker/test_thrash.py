"""Load on demand's pure decisions with a fake clock: the learned load time, the minimum
residency scaled by the load time, the bound on the share of a minute spent loading, and
each model's demand (which idle model goes first)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from tests.conftest import examples
from zeroserve.broker.server.thrash import (DEFAULT_LOAD_S, RESIDENCY_FACTOR, WINDOW_S,
                                            Demand, LoadTimes, ThrashGuard)


def test_a_load_time_is_learned_per_model_with_a_default_before_the_first() -> None:
    times = LoadTimes()
    assert times.predict("a") == DEFAULT_LOAD_S
    times.observe("a", 0.2)
    assert times.predict("a") == 0.2
    times.observe("a", 1.2)
    assert abs(times.predict("a") - 0.5) < 1e-9   # moves by 0.3 of the difference
    assert times.latest("a") == 1.2 and times.latest("new") == times.predict("new")
    times.observe("b", 0.1)
    times.observe("c", 0.3)
    assert times.predict("never-loaded") == 0.3   # the median of the models seen
    times.forget("a")
    assert times.predict("a") == 0.2


def test_a_model_stays_the_factor_times_its_load_time_and_at_least_the_floor() -> None:
    guard = ThrashGuard(min_residency_s=5.0, max_load_share=0.0)
    assert guard.may_evict("w", "a", 0.0), "a model it never loaded may go at any time"
    guard.resident("w", "a", 10.0, load_s=0.01)   # 0.2 s scaled: the 5 s floor wins
    assert not guard.may_evict("w", "a", 14.9)
    assert guard.may_evict("w", "a", 15.0)
    assert guard.may_evict("other", "a", 11.0), "residency is per worker"
    guard.gone("w")
    assert guard.may_evict("w", "a", 11.0)
    guard = ThrashGuard(min_residency_s=0.01, max_load_share=0.0)
    guard.resident("w", "cheap", 0.0, load_s=0.01)
    guard.resident("w", "dear", 0.0, load_s=1.0)
    assert guard.evictable_at("w", "cheap") == RESIDENCY_FACTOR * 0.01 == 0.05
    assert guard.evictable_at("w", "dear") == RESIDENCY_FACTOR * 1.0 == 5.0
    guard.gone("w", "cheap")
    assert guard.may_evict("w", "cheap", 0.0) and not guard.may_evict("w", "dear", 4.9)
    assert ThrashGuard(0.1, 0.0, residency_factor=0.0).residency_s(5.0) == 0.1, "floor alone"


def test_the_seconds_spent_loading_in_a_minute_are_bounded_to_a_share_of_it() -> None:
    guard = ThrashGuard(min_residency_s=0.0, max_load_share=0.5)   # 30 s a minute
    assert guard.budget_s == 30.0
    for t in (0.0, 10.0, 20.0):
        assert guard.load_wait_s(t, 10.0) == 0.0
        guard.started(t, 10.0)
    assert guard.load_s_in_window(25.0) == 30.0 and guard.loads_in_window(25.0) == 3
    assert guard.load_wait_s(25.0, 10.0) == 35.0, "until the start at 0 leaves at 60"
    assert guard.load_wait_s(25.0, 15.0) == 45.0, "a dearer load: two must leave"
    assert guard.load_wait_s(60.0, 10.0) == 0.0
    cheap = ThrashGuard(0.0, 0.5)
    for i in range(2000):   # 2000 loads of 10 ms: 20 s, within the 30 s
        assert cheap.load_wait_s(i * 0.01, 0.01) == 0.0
        cheap.started(i * 0.01, 0.01)
    assert cheap.loads_in_window(20.0) == 2000
    assert ThrashGuard(0.0, 0.0).load_wait_s(0.0, 1e9) == 0.0, "0: no bound"
    lone = ThrashGuard(0.0, 0.5)
    assert lone.load_wait_s(0.0, 100.0) == 0.0, "dearer than the share: alone it may start"
    lone.started(0.0, 100.0)
    assert lone.load_wait_s(1.0, 0.001) == 59.0


@settings(max_examples=examples(200), deadline=None)
@given(share=st.floats(0.01, 1.0),
       steps=st.lists(st.tuples(st.floats(0.0, 30.0, allow_nan=False),
                                st.floats(0.001, 20.0, allow_nan=False)),
                      min_size=1, max_size=60))
def test_no_window_of_a_minute_holds_more_loading_than_the_share(
        share: float, steps: list[tuple[float, float]]) -> None:
    """Whoever starts a load only when the guard says it may never puts more predicted
    loading in a minute than the share allows (but for a lone load dearer than it), and
    waiting what it says is always enough."""
    guard, now, starts = ThrashGuard(0.0, share), 0.0, []
    for gap, cost in steps:
        now += gap
        wait = guard.load_wait_s(now, cost)
        assert wait >= 0.0
        if wait == 0.0:
            guard.started(now, cost)
            starts.append((now, cost))
        else:
            assert guard.load_wait_s(now + wait + 1e-6, cost) == 0.0, "its wait is enough"
            assert guard.load_wait_s(now + wait - 1e-3, cost) > 0.0, "and not too long"
    for s, _ in starts:
        window = [c for t, c in starts if s <= t < s + WINDOW_S]
        assert len(window) == 1 or sum(window) <= share * WINDOW_S + 1e-9, window


def test_demand_counts_requests_halving_each_half_life_and_orders_models_by_it() -> None:
    demand = Demand(half_life_s=10.0)
    for i in range(100):          # 10 a second for 10 s
        demand.asked("hot", i * 0.1)
    demand.asked("cold", 9.9)
    assert demand.count("hot", 10.0) > 40 * demand.count("cold", 10.0)
    assert demand.count("cold", 19.9) == pytest.approx(0.5), "halved in one half-life"
    assert demand.count("hot", 30.0) == pytest.approx(demand.count("hot", 10.0) / 4)
    steady = Demand(half_life_s=10.0)
    for i in range(2000):         # 10 a second, long enough to be steady
        steady.asked("m", i * 0.1)
    assert steady.rate("m", 200.0) == pytest.approx(10.0, rel=0.05)
    assert demand.count("never", 5.0) == 0.0
    demand.forget("hot")
    assert demand.names() == {"cold"} and len(demand) == 1


def test_the_next_residency_to_end_is_known_for_the_broker_to_wake() -> None:
    guard = ThrashGuard(0.5, 0.0)
    assert guard.next_evictable(0.0) is None
    guard.resident("w", "a", 0.0, 0.0)
    guard.resident("w", "b", 1.0, 0.0)
    assert guard.next_evictable(0.0) == 0.5
    assert guard.next_evictable(0.6) == 1.5
    assert guard.next_evictable(2.0) is None
