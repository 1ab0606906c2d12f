"""Eviction's one pure function with a fake clock: every time is an argument, every
input one frozen snapshot of a worker. Unit cases for each rule, then hypothesis
properties over random snapshots (as the scheduler's ``take`` is tested)."""

from __future__ import annotations

import math
import random

from hypothesis import given, settings, strategies as st

from tests.conftest import examples
from zeroserve.broker.server.eviction import TURNS, Held, Snapshot, Wait, choose, evictable, \
    freeable, hot
from zeroserve.broker.server.thrash import Load, Tenure, ThrashGuard

MB = 1_000_000


def idle(model: str, mb: int = 10, wanted: float = 0.0, used: float = 0.0,
         until: float = -math.inf) -> Held:
    return Held(model, mb * MB, mb * MB, idle=True, wanted=wanted, last_used_s=used,
                resident_until_s=until)


def snap(*held: Held, need_mb: int = 10, free_mb: int | None = 0, now: float = 100.0,
         keep_wanted: float = 0.0, wait: Wait | None = None) -> Snapshot:
    return Snapshot("keep", need_mb * MB, None if free_mb is None else free_mb * MB, held,
                    now, keep_wanted, wait)


def test_a_load_that_fits_evicts_nothing_and_no_limit_always_fits() -> None:
    assert choose(snap(idle("a"), free_mb=10)) == ()
    assert choose(snap(idle("a"), free_mb=None, need_mb=10_000)) == ()


def test_the_least_wanted_goes_first_then_the_least_recently_used_then_by_name() -> None:
    s = snap(idle("hot", wanted=9.0, used=1.0), idle("cold", wanted=1.0, used=5.0),
             idle("old", wanted=1.0, used=2.0), idle("b"), idle("a"))
    assert [h.model for h in evictable(s)] == ["a", "b", "old", "cold", "hot"]
    assert choose(s) == ("a",)
    assert choose(snap(*s.held, need_mb=25)) == ("a", "b", "old")


def test_only_idle_models_go_and_as_few_as_free_enough() -> None:
    busy = Held("busy", 50 * MB, 50 * MB, idle=False)
    loading = Held("loading", 50 * MB, 0, idle=False)
    s = snap(busy, loading, idle("small", 5), idle("big", 30, wanted=1.0), need_mb=20)
    assert choose(s) == ("small", "big")
    assert freeable(s) == 35 * MB
    assert choose(snap(*s.held, need_mb=40)) is None, "the busy ones hold the rest"


def test_a_model_stays_its_residency_then_may_go() -> None:
    clock = 10.0
    held = (idle("fresh", until=12.0), idle("other", 5, wanted=5.0))
    assert choose(snap(*held, now=clock)) is None, "5 MB may go, 10 are needed"
    clock += 1.999
    assert choose(snap(*held, now=clock)) is None
    clock += 0.001
    assert choose(snap(*held, now=clock)) == ("fresh",)


def test_a_hot_model_yields_to_a_colder_waiting_one_only_after_its_patience() -> None:
    # 2 MB free and 20 MB held: 12 MB beside TURNS x 5 MB of the load, room for one
    # 10 MB model, the most wanted
    held = (idle("hot", wanted=50.0), idle("warm", wanted=20.0))
    free = 2
    assert free + 20 - TURNS * 5 == 12
    s = snap(*held, free_mb=free, need_mb=5, keep_wanted=1.0,
             wait=Wait(since_s=99.0, last_start_s=0.0, patience_s=5.0))
    assert hot(s) == {"hot"}
    assert [h.model for h in evictable(s)] == ["warm"]
    later = snap(*held, free_mb=free, need_mb=5, now=104.0, keep_wanted=1.0,
                 wait=Wait(since_s=99.0, last_start_s=0.0, patience_s=5.0))
    assert [h.model for h in evictable(later)] == ["warm", "hot"], "its patience is spent"
    started = snap(*held, free_mb=free, need_mb=5, now=104.0, keep_wanted=1.0,
                   wait=Wait(since_s=99.0, last_start_s=101.0, patience_s=5.0))
    assert [h.model for h in evictable(started)] == ["warm"], "a load started since"
    no_wait = snap(*held, free_mb=free, need_mb=5, keep_wanted=1.0)
    assert [h.model for h in evictable(no_wait)] == ["warm", "hot"], \
        "a new version (no load on demand waits) is not held back by the hot models"
    wanted_more = snap(*held, free_mb=free, need_mb=5, keep_wanted=60.0,
                       wait=Wait(since_s=99.0, last_start_s=0.0, patience_s=5.0))
    assert [h.model for h in evictable(wanted_more)] == ["warm", "hot"]


def test_the_record_answers_placement_and_forgets_what_was_evicted() -> None:
    tenure = Tenure(ThrashGuard(min_residency_s=1.0, max_load_share=0.0))
    tenure.demand.asked("a", 0.0)
    tenure.assigned["a"] = {b"w"}
    tenure.guard.resident("w", "a", 0.0, load_s=0.0)
    assert tenure.wanted_level("a", 0.0) == 1.0 and tenure.resident_until("w", "a") == 1.0
    assert tenure.wait("b") is None
    tenure.wanted["b"] = 3.0
    assert tenure.wait("b") == Wait(3.0, -math.inf, tenure.patience_s("b"))
    tenure.loads["b"] = Load(b"w", 4.0, since_s=2.0)
    assert tenure.waiting_since("b") == 2.0, "a load keeps its requests' first wait"
    tenure.record_eviction(b"w", "w", "a", "evicted from worker w")
    assert tenure.assigned["a"] == set() and tenure.resident_until("w", "a") == -math.inf
    assert tenure.evicted["a"] == "evicted from worker w"


# -- properties -------------------------------------------------------------

helds = st.lists(st.builds(
    Held, model=st.sampled_from("abcdefghij"), bytes=st.integers(0, 50),
    loaded_bytes=st.integers(0, 50), idle=st.booleans(),
    wanted=st.sampled_from([0.0, 1.0, 2.5, 10.0]), last_used_s=st.integers(0, 20).map(float),
    resident_until_s=st.sampled_from([-math.inf, 5.0, 10.0, 15.0])),
    max_size=10, unique_by=lambda h: h.model)
snapshots = st.builds(
    Snapshot, keep=st.just("keep"), need_bytes=st.integers(0, 120),
    free_bytes=st.one_of(st.none(), st.integers(-40, 120)), held=helds.map(tuple),
    now_s=st.integers(0, 20).map(float), keep_wanted=st.sampled_from([0.0, 1.0, 10.0]),
    wait=st.one_of(st.none(), st.builds(Wait, since_s=st.integers(0, 20).map(float),
                                        last_start_s=st.integers(0, 20).map(float),
                                        patience_s=st.sampled_from([0.0, 3.0, 30.0]))))


def _order(h: Held) -> tuple[float, float, str]:
    return (h.wanted, h.last_used_s, h.model)


@settings(max_examples=examples(500))
@given(snapshots, st.randoms(use_true_random=False))
def test_properties(s: Snapshot, rnd: random.Random) -> None:
    """Never a busy model, nor one under its residency floor, nor a hot one before the
    load's patience; frees enough or evicts nothing; as few as enough; the least wanted
    (then the least recently used) first; the same answer whatever the held order."""
    got = choose(s)
    by_name = {h.model: h for h in s.held}
    if s.free_bytes is None or s.need_bytes <= s.free_bytes:
        assert got == ()
        return
    short = s.need_bytes - s.free_bytes
    may = evictable(s)
    if got is None:
        assert sum(h.loaded_bytes for h in may) < short, "refused though enough may go"
        return
    victims = [by_name[m] for m in got]
    assert sum(h.loaded_bytes for h in victims) >= short, "evicted too little"
    assert sum(h.loaded_bytes for h in victims[:-1]) < short, "evicted more than needed"
    hot_models = hot(s)
    for h in victims:
        assert h.idle, f"evicted {h.model}, which is busy"
        assert s.now_s >= h.resident_until_s, f"evicted {h.model} within its residency"
        if s.wait is not None and h.model in hot_models and h.wanted > s.keep_wanted:
            assert s.now_s - max(s.wait.since_s, s.wait.last_start_s) >= s.wait.patience_s, \
                f"evicted hot {h.model} before the patience"
    kept = [h for h in may if h.model not in got]
    assert all(_order(v) <= _order(k) for v in victims for k in kept), \
        "a more wanted (or more recently used) model went before a less wanted one"
    shuffled = list(s.held)
    rnd.shuffle(shuffled)
    assert choose(Snapshot(s.keep, s.need_bytes, s.free_bytes, tuple(shuffled), s.now_s,
                           s.keep_wanted, s.wait)) == got, "the answer hung on the order"


@settings(max_examples=examples(200))
@given(snapshots, st.integers(0, 30))
def test_more_time_never_refuses_what_fitted(s: Snapshot, later_s: int) -> None:
    """Residencies and patience only end: a load that fits now fits later too."""
    if choose(s) is not None:
        wait = None if s.wait is None else Wait(s.wait.since_s, s.wait.last_start_s,
                                                s.wait.patience_s)
        later = Snapshot(s.keep, s.need_bytes, s.free_bytes, s.held, s.now_s + later_s,
                         s.keep_wanted, wait)
        assert choose(later) is not None
