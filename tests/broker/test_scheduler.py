"""The scheduler with a fake clock: every time is an argument."""

import math

from hypothesis import given, settings, strategies as st

from tests.conftest import examples
from zeroserve.broker.server.scheduler import DEADLINE, DELAY, FULL, IDLE, Entry, Policy, Scheduler


def make(policy=None):
    policy = policy or Policy(max_batch_size=8)
    s = Scheduler()
    s.set_policy("m", policy)
    return s


def entry(key, t=0.0, prio=1, deadline=math.inf, samples=1, version=None):
    return Entry(key=key, model="m", priority=prio, arrival_s=t, deadline_s=deadline,
                 samples=samples, version=version)


def keys(decision):
    return [e.key for e in decision.entries]


def test_idle_worker_takes_a_lone_request_at_once():
    s = make()
    s.add(entry("a"))
    d = s.take("m", now=0.0)
    assert keys(d) == ["a"] and d.reason == IDLE
    assert s.take("m", now=0.0) is None


def test_strict_priority_then_earliest_deadline():
    s = make()
    s.add(entry("low", prio=2, deadline=1.0))
    s.add(entry("high-late", prio=1, deadline=9.0))
    s.add(entry("high-soon", prio=1, deadline=2.0))
    assert keys(s.take("m", 0.0)) == ["high-soon", "high-late", "low"]


def test_batch_counts_samples_and_stops_at_max_batch_size():
    s = make(Policy(max_batch_size=4))
    s.add(entry("a", samples=3))
    s.add(entry("b", samples=2))
    d = s.take("m", 0.0)
    assert keys(d) == ["a"] and d.reason == IDLE
    d = s.take("m", 0.0)
    assert keys(d) == ["b"]


def test_full_batch_is_reported_full():
    s = make(Policy(max_batch_size=2))
    s.add(entry("a"))
    s.add(entry("b"))
    assert s.take("m", 0.0).reason == FULL


def test_latency_model_bounds_the_batch_by_the_tightest_deadline():
    s = make(Policy(max_batch_size=64))
    for i in range(10):
        s.add(entry(i, deadline=0.005))
    # 1 ms per sample: only 5 fit before the deadline
    d = s.take("m", 0.0, predict=lambda b: 0.001 * b)
    assert len(d.entries) == 5


def test_request_that_cannot_finish_in_time_is_doomed_not_run():
    s = make(Policy(max_batch_size=8))
    s.add(entry("tight", deadline=0.010))
    s.add(entry("loose", deadline=1.0))
    # the worker is busy until t=0.008 and a batch of one takes 5 ms
    d = s.take("m", 0.0, predict=lambda b: 0.005, start_s=0.008)
    assert keys(d) == ["loose"] and [e.key for e in d.doomed] == ["tight"]
    assert s.depth("m") == 0


def test_expiry_removes_requests_at_their_deadline():
    s = make()
    s.add(entry("a", deadline=1.0))
    s.add(entry("b", deadline=2.0))
    assert s.next_deadline() == 1.0
    assert [e.key for e in s.expire(1.0)] == ["a"]
    assert s.next_deadline() == 2.0
    assert keys(s.take("m", 1.5)) == ["b"]


def test_cancel_takes_the_request_out():
    s = make()
    s.add(entry("a"))
    assert s.cancel("a").key == "a"
    assert s.take("m", 0.0) is None
    assert s.cancel("a") is None


def test_full_queue_sheds_lowest_priority_newest_first():
    s = make(Policy(max_batch_size=8, max_queue_size=3))
    s.add(entry("low-old", prio=2))
    s.add(entry("low-new", prio=2))
    s.add(entry("high", prio=1))
    shed = s.add(entry("high-2", prio=1))
    assert [e.key for e in shed] == ["low-new"]
    shed = s.add(entry("low-3", prio=2))  # nothing lower to shed: the newcomer goes
    assert [e.key for e in shed] == ["low-3"]
    assert s.depth("m") == 3


def test_aging_bound_promotes_an_old_low_priority_request():
    s = make(Policy(max_batch_size=1, aging_s=1.0))
    s.add(entry("old-low", t=0.0, prio=2))
    s.add(entry("new-high", t=0.9, prio=1))
    assert keys(s.take("m", 0.95)) == ["new-high"]
    s.add(entry("newer-high", t=1.0, prio=1))
    assert keys(s.take("m", 1.0)) == ["old-low"]


def test_queue_delay_waits_for_a_fuller_batch_then_goes():
    s = make(Policy(max_batch_size=4, max_queue_delay_s=0.005))
    s.add(entry("a", t=0.0))
    assert s.take("m", 0.001) is None
    assert s.next_due("m", 0.001) == 0.005
    s.add(entry("b", t=0.002))
    d = s.take("m", 0.005)
    assert keys(d) == ["a", "b"] and d.reason == DELAY


def test_queue_delay_never_waits_past_a_deadline():
    s = make(Policy(max_batch_size=4, max_queue_delay_s=0.010))
    s.add(entry("a", t=0.0, deadline=0.004))
    due = s.next_due("m", 0.0, predict=lambda b: 0.002)
    assert due == 0.002
    d = s.take("m", 0.002, predict=lambda b: 0.002)
    assert keys(d) == ["a"] and d.reason == DEADLINE


def test_queue_delay_sends_at_once_when_full():
    s = make(Policy(max_batch_size=2, max_queue_delay_s=1.0))
    s.add(entry("a"))
    s.add(entry("b"))
    assert s.take("m", 0.0).reason == FULL


def test_preferred_batch_sizes_cap_the_batch():
    s = make(Policy(max_batch_size=8, preferred_batch_sizes=(2, 4)))
    for i in range(5):
        s.add(entry(i))
    assert len(s.take("m", 0.0).entries) == 4


def test_pinned_versions_never_mix_in_a_batch():
    s = make()
    s.add(entry("v1", version=1))
    s.add(entry("v2", version=2))
    s.add(entry("any"))
    resolve = lambda e: e.version if e.version is not None else 2  # noqa: E731
    assert keys(s.take("m", 0.0, resolve=resolve)) == ["v1"]
    d = s.take("m", 0.0, resolve=resolve)
    assert keys(d) == ["v2", "any"] and {e.version for e in d.entries} == {2}


# -- properties -------------------------------------------------------------

ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 3), st.floats(0.0005, 0.05),
              st.integers(1, 4)),
    st.tuples(st.just("advance"), st.floats(0.0, 0.02)),
    st.tuples(st.just("take"), st.integers(1, 3)),
    st.tuples(st.just("cancel"), st.integers(0, 50)),
), max_size=120)


@settings(max_examples=examples(300))
@given(ops, st.integers(1, 16), st.sampled_from([0.0, 0.003]), st.integers(2, 20),
       st.floats(0.0, 0.002))
def test_properties(ops, mbs, delay, qsize, per_sample):
    """Each request answered exactly once; none run after its deadline; no batch over
    max_batch_size; a higher priority never waits behind a lower one beyond aging."""
    aging = 0.01
    s = make(Policy(max_batch_size=mbs, max_queue_delay_s=delay, max_queue_size=qsize,
                    aging_s=aging))
    predict = lambda b: per_sample * b  # noqa: E731
    now, n = 0.0, 0
    outcome: dict[int, str] = {}
    live: dict[int, Entry] = {}

    def answer(key, how):
        assert key not in outcome, f"request {key} answered twice"
        outcome[key] = how
        live.pop(key, None)

    for op in ops:
        if op[0] == "add":
            _, prio, timeout, samples = op
            e = entry(n, t=now, prio=prio, deadline=now + timeout, samples=min(samples, mbs))
            live[n] = e
            n += 1
            for shed in s.add(e):
                answer(shed.key, "shed")
        elif op[0] == "advance":
            now += op[1]
        elif op[0] == "cancel":
            e = s.cancel(op[1])
            if e is not None:
                answer(e.key, "cancelled")
        else:
            for _ in range(op[1]):
                d = s.take("m", now, predict=predict)
                if d is None:
                    break
                for e in d.doomed:
                    assert now + predict(e.samples) > e.deadline_s, "shed a request that fit"
                    answer(e.key, "doomed")
                assert sum(e.samples for e in d.entries) <= mbs
                for e in d.entries:
                    assert now < e.deadline_s, "ran after its deadline"
                    # nothing left behind outranks a batched entry unless that one aged
                    for other in live.values():
                        if other.state == 0 and other.priority < e.priority:
                            assert e.arrival_s + aging <= now, "priority inversion"
                for e in d.entries:
                    answer(e.key, "ran")
        for e in s.expire(now):
            assert e.deadline_s <= now
            answer(e.key, "expired")
    now += 1.0
    for e in s.expire(now):
        answer(e.key, "expired")
    for e in s.drop_model("m"):
        answer(e.key, "dropped")
    assert set(outcome) == set(range(n)), "some request was never answered"


def test_drop_model_returns_what_was_queued_and_forgets_the_model():
    s = make()
    for k in ("a", "b"):
        s.add(entry(k))
    assert sorted(e.key for e in s.drop_model("m")) == ["a", "b"]
    assert s.models_waiting() == [] and s.drop_model("m") == []


def test_wait_estimate_counts_a_partial_batch_at_its_own_size():
    s = make(Policy(max_batch_size=16))
    for i in range(18):
        s.add(entry(i))
    # one full batch of 16 and a batch of 2: 1 ms + 1 ms per sample each
    assert abs(s.estimate_wait("m", 1, lambda b: 0.001 + 0.001 * b, workers=1)
               - (0.017 + 0.003)) < 1e-9


def test_a_free_worker_serves_the_best_priority_then_the_longest_wait_across_models():
    """Not the order the queues were made in: the first model's steady traffic would take
    every credit a result frees, and a model asked for now and then would wait behind it."""
    s = Scheduler()
    for name in ("busy", "rare", "urgent"):
        s.set_policy(name, Policy(max_batch_size=8))
    s.add(Entry(key="b1", model="busy", priority=2, arrival_s=5.0))
    s.add(Entry(key="r1", model="rare", priority=2, arrival_s=1.0))
    assert s.models_waiting() == ["rare", "busy"], "the longest wait first"
    s.add(Entry(key="u1", model="urgent", priority=1, arrival_s=9.0))
    assert s.models_waiting() == ["urgent", "rare", "busy"], "priority before wait"
    s.take("rare", 10.0)
    s.add(Entry(key="r2", model="rare", priority=2, arrival_s=11.0))
    assert s.models_waiting() == ["urgent", "busy", "rare"], "its wait starts again"
