"""The rollout's decisions, pure: a fake clock and counts in, weights and verdicts out."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from tests.conftest import examples
from zeroserve.broker.server.rollout import Rollout, Verdict
from zeroserve.models.rolloutplan import Plan, PlanError, Thresholds, parse_plan

PLAN = Plan((5, 25, 50, 100), 10.0, Thresholds(min_requests=20, min_errors=3))


def feed(r: Rollout, version: int, n: int, errors: int = 0, compute_s: float = 0.001) -> None:
    for i in range(n):
        failed = i < errors
        r.observe(version, 1, int(failed), None if failed else compute_s)


def test_a_healthy_canary_steps_through_the_plan_then_is_promoted() -> None:
    r = Rollout(2, 1, PLAN, now=0.0)
    assert r.weights == {2: 5, 1: 95}
    now, seen = 0.0, []
    for _ in range(10):
        feed(r, 1, 100)
        feed(r, 2, 30)
        assert r.decide(now + 5.0) is None   # within the dwell: hold
        now += 10.0
        verdict = r.decide(now)
        assert verdict is not None
        seen.append(verdict)
        if verdict.action == "promote":
            break
    assert [v.weights.get(2) for v in seen] == [25, 50, 100, 100]
    assert [v.action for v in seen] == ["step", "step", "step", "promote"]
    assert r.decide(now + 100.0) is None and r.next_due() is None


def test_a_step_waits_for_enough_canary_answers() -> None:
    """No evidence, no promotion: the rollout holds (and its step ages, for the alert)."""
    r = Rollout(2, 1, PLAN, now=0.0)
    feed(r, 1, 100)
    feed(r, 2, 19)
    assert r.decide(100.0) is None
    feed(r, 2, 1)
    assert r.decide(100.0) == Verdict("step", {2: 25, 1: 75})


def test_a_step_short_of_answers_past_its_dwell_asks_no_wake_up() -> None:
    """The dwell's end, once past, stayed due while the step waited for the canary's
    answers: a poll timeout of 0 that spun the broker's loop until traffic came. The
    answer that completes them decides the step (every answer ticks)."""
    r = Rollout(2, 1, PLAN, now=0.0)
    feed(r, 1, 100)
    feed(r, 2, 19)
    assert r.decide(10.0) is None and r.next_due() is None
    feed(r, 2, 1)
    assert r.next_due() == 10.0          # enough answers: the dwell's end decides
    assert r.decide(10.5) == Verdict("step", {2: 25, 1: 75})
    assert r.next_due() is None          # the new step has no answers yet
    feed(r, 2, 20)
    assert r.next_due() == 20.5


def test_errors_roll_back_at_once_even_within_the_dwell() -> None:
    r = Rollout(3, 2, PLAN, now=0.0)
    feed(r, 2, 200, errors=1)
    feed(r, 3, 20, errors=4)
    verdict = r.decide(0.5)
    assert verdict is not None and verdict.action == "rollback"
    assert verdict.weights == {2: 100, 3: 0}
    assert "error rate 20.0%" in verdict.reason
    assert r.outcome == "rolled back" and r.decide(1.0) is None
    # what zeroserve models shows beside "rolled back": the traffic now, not the step's
    assert r.describe(1.0)["weights"] == {"2": 100, "3": 0}


def test_a_rollback_by_hand_describes_the_traffic_it_left() -> None:
    r = Rollout(3, 2, PLAN, now=0.0)
    assert r.describe(0.0)["weights"] == {"3": 5, "2": 95}
    r.end("rolled back", Verdict("rollback", {}))
    assert r.describe(0.0)["weights"] == {"2": 100, "3": 0}


def test_too_few_samples_decide_nothing() -> None:
    r = Rollout(3, 2, PLAN, now=0.0)
    feed(r, 2, 200)
    feed(r, 3, 10, errors=5)   # half failed, but only 10 answers
    assert r.decide(1.0) is None


def test_errors_as_common_as_the_stables_are_no_verdict() -> None:
    r = Rollout(3, 2, PLAN, now=0.0)
    feed(r, 2, 1000, errors=100)
    feed(r, 3, 100, errors=12)
    assert r.decide(1.0) is None


def test_a_ten_times_slower_canary_rolls_back_on_latency() -> None:
    r = Rollout(4, 2, PLAN, now=0.0)
    feed(r, 2, 200, compute_s=0.002)
    feed(r, 4, 20, compute_s=0.020)
    verdict = r.decide(1.0)
    assert verdict is not None and verdict.action == "rollback"
    assert verdict.reason.startswith("compute time p50 20.0 ms")


def test_one_stalled_batch_is_no_verdict() -> None:
    """A loaded host stalls a batch now and then: the canary's p99 is that stall, its
    median is not, and the median decides."""
    r = Rollout(4, 2, PLAN, now=0.0)
    feed(r, 2, 200, compute_s=0.002)
    feed(r, 4, 19, compute_s=0.002)
    r.observe(4, 1, 0, 0.200)
    assert r.counts[4].describe()["p99_ms"] == 200.0
    assert r.decide(1.0) is None


def test_a_stalled_stable_version_hides_no_slow_canary() -> None:
    r = Rollout(4, 2, PLAN, now=0.0)
    feed(r, 2, 195, compute_s=0.002)
    feed(r, 2, 5, compute_s=0.100)   # its p99 is 100 ms
    feed(r, 4, 20, compute_s=0.020)
    verdict = r.decide(1.0)
    assert verdict is not None and verdict.action == "rollback"


def test_a_slower_canary_under_the_floor_is_kept() -> None:
    """3x of a 0.1 ms model is 0.3 ms: below latency_floor_ms, noise, not a verdict."""
    r = Rollout(4, 2, PLAN, now=0.0)
    feed(r, 2, 200, compute_s=0.0001)
    feed(r, 4, 20, compute_s=0.0003)
    assert r.decide(1.0) is None


def test_counts_for_other_versions_are_ignored() -> None:
    r = Rollout(2, 1, PLAN, now=0.0)
    r.observe(7, 100, 100)
    assert set(r.counts) == {1, 2} and r.decide(1.0) is None


@settings(max_examples=examples(300))
@given(st.lists(st.tuples(st.sampled_from([1, 2]), st.integers(1, 20), st.booleans(),
                          st.floats(0.0, 3.0)), max_size=80))
def test_weights_always_sum_to_100_and_the_canary_never_shrinks(
        events: list[tuple[int, int, bool, float]]) -> None:
    """Whatever the answers and the time, a live rollout's weights sum to 100 and the
    canary's share only grows, until one verdict ends it."""
    r = Rollout(2, 1, Plan((5, 50, 100), 1.0, Thresholds(min_requests=5, min_errors=2)), 0.0)
    now, share, ends = 0.0, 5, 0
    for version, n, failed, dt in events:
        r.observe(version, n, n if failed else 0, 0.001)
        now += dt
        verdict = r.decide(now)
        if verdict is not None and verdict.action != "step":
            ends += 1
        if not r.outcome:
            assert sum(r.weights.values()) == 100
            assert r.weights[2] >= share
            share = r.weights[2]
    assert ends <= 1


@pytest.mark.parametrize("raw, message", [
    ({"steps": [50, 25, 100]}, "ascend"),
    ({"steps": [5, 25, 50]}, "end at 100"),
    ({"steps": [0, 100]}, "1..100"),
    ({"steps": []}, "1..100"),
    ({"dwell_s": -1}, "dwell_s"),
    ({"min_requests": 0}, "min_requests"),
    ({"stepz": [100]}, "unknown field 'stepz'"),
    ("fast", "must be an object"),
])
def test_a_bad_plan_says_what_is_wrong(raw: object, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        parse_plan(raw)


def test_a_plan_round_trips_through_its_json() -> None:
    plan = parse_plan({"steps": [10, 100], "dwell_s": 0.3, "min_requests": 8,
                       "max_error_rate": 0.1})
    assert parse_plan(plan.to_json()) == plan
    assert plan.thresholds.min_requests == 8 and plan.steps == (10, 100)


def test_a_single_step_plan_watches_a_plain_swap() -> None:
    """steps [100]: the new version takes everything at once, the old one stays loaded
    for the dwell; errors in that window roll it back (against an error-free old
    version: it answers nothing), a quiet window promotes it."""
    plan = Plan((100,), 30.0, Thresholds(min_requests=20, min_errors=3))
    r = Rollout(2, 1, plan, now=0.0)
    assert r.weights == {2: 100, 1: 0}
    feed(r, 2, 20, errors=3)
    verdict = r.decide(1.0)
    assert verdict is not None and verdict.action == "rollback"
    quiet = Rollout(2, 1, plan, now=0.0)
    feed(quiet, 2, 100)
    assert quiet.decide(10.0) is None
    assert quiet.decide(30.0) == Verdict("promote", {2: 100})
