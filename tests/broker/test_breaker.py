"""Breakers: a model's own failures open its breaker, probes close it, on a fake clock."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hypothesis import given, strategies as st

from tests.broker.rig import BrokerRig
from tests.conftest import linear_config
from zeroserve.broker import protocol as p
from zeroserve.broker.server.swap import Swap
from zeroserve.models.repository import RepoModel
from zeroserve.broker.server.autoscale import HOLD, Controller, Sample, ScalePolicy
from zeroserve.broker.server.breaker import CLOSED, HALF_OPEN, OPEN, BreakerOptions, \
    Breakers

OPTS = BreakerOptions(error_rate=0.5, min_failures=5, window_s=2.0, open_s=5.0,
                      max_open_s=20.0, probes=3)


def test_a_failing_model_opens_then_probes_then_closes() -> None:
    b = Breakers(OPTS)
    b.answered("m", 10, now=0.0)
    assert not b.failed("m", 4, 0.5, "boom")           # 4 of 14: under both bounds
    assert b.failed("m", 8, 1.0, "boom")               # 12 of 22 failed in the window
    assert b.state("m", 1.0) == OPEN and b.describe("m", 1.0)["breaker"]["trips"] == 1
    assert b.admit("m", 1.0) == 5.0 and b.admit("m", 5.9) is not None
    assert b.describe("m", 2.0)["breaker"]["probe_in_s"] == 4.0
    # half-open: three probes through, the fourth waits for their answers
    assert [b.admit("m", 6.0) for _ in range(3)] == [None, None, None]
    assert b.state("m", 6.0) == HALF_OPEN and b.admit("m", 6.0) is not None
    b.answered("m", 3, 6.5)
    assert b.state("m", 6.6) == CLOSED and b.admit("m", 6.6) is None


def test_a_failed_probe_opens_it_again_for_twice_as_long_up_to_the_bound() -> None:
    b = Breakers(OPTS)
    b.failed("m", 3, 0.0, "boom")
    b.failed("m", 3, 0.0, "boom")
    waits = []
    now = 0.0
    for _ in range(4):
        now += b.admit("m", now) or 0.0
        assert b.admit("m", now) is None                # a probe
        assert b.failed("m", 1, now, "boom")
        waits.append(b.admit("m", now))
    assert waits == [10.0, 20.0, 20.0, 20.0]


def test_failures_outside_the_window_and_healthy_traffic_do_not_open_it() -> None:
    b = Breakers(OPTS)
    for t in range(10):     # 2 failures among 22 answers a second: under both bounds
        b.answered("m", 20, float(t))
        assert not b.failed("m", 2, t + 0.5, "one bad input")
    assert b.state("m", 10.0) == CLOSED and b.describe("m", 10.0) == {}


def test_one_failed_batch_is_one_bad_input_not_the_model_failing() -> None:
    b = Breakers(OPTS)
    assert not b.failed("m", 64, 0.0, "ValueError: this input")   # a batch fails whole
    assert b.failed("m", 1, 0.1, "ValueError: this input")        # a second batch fails


def test_a_new_build_closes_it_and_no_breaker_when_disabled() -> None:
    b = Breakers(OPTS)
    b.failed("m", 3, 0.0, "boom")
    b.failed("m", 3, 0.0, "boom")
    b.reset("m")
    assert b.state("m", 0.1) == CLOSED and b.admit("m", 0.1) is None
    off = Breakers(BreakerOptions(error_rate=0.0))
    assert not off.failed("m", 100, 0.0, "boom") and off.admit("m", 0.0) is None


def test_unanswered_probes_do_not_keep_it_half_open_for_ever() -> None:
    b = Breakers(OPTS)
    b.failed("m", 3, 0.0, "boom")
    b.failed("m", 3, 0.0, "boom")
    for _ in range(3):
        assert b.admit("m", 5.0) is None   # refused further on, they never answer
    assert b.admit("m", 6.0) is not None
    assert b.admit("m", 10.1) is None      # past another open_s: probes again


@given(st.lists(st.tuples(st.integers(0, 20), st.integers(0, 20)), max_size=40))
def test_it_opens_only_past_both_bounds(batches: list[tuple[int, int]]) -> None:
    b = Breakers(OPTS)
    answered = failed = failed_batches = 0
    for i, (ok, bad) in enumerate(batches):
        now = i * 0.01    # all inside one window
        b.answered("m", ok, now)
        answered += ok
        opened = b.failed("m", bad, now, "boom") if bad else False
        failed += bad
        failed_batches += bad > 0
        if opened:
            assert failed >= 5 and failed_batches >= 2 \
                and failed >= 0.5 * (answered + failed)
            return
    assert b.state("m", 1.0) == CLOSED


def test_the_replica_controller_holds_while_the_breaker_is_open() -> None:
    c = Controller()
    c.set_policy("m", ScalePolicy(min_replicas=1, max_replicas=4, window_s=1.0), 0.0)
    for t in range(20):   # a queue far over its SLO, every replica busy
        c.observe("m", t * 0.1, Sample(1.0, 50, 1, 1))
    assert c.decide("m", 2.0, 1, 0, lambda: None).action == "up"
    c.observe("m", 2.1, Sample(1.0, 50, 1, 1, breaker_open=True))
    held = c.decide("m", 2.2, 1, 0, lambda: None)
    assert (held.action, held.reason) == (HOLD, "breaker_open")


# -- in the broker, without sockets (BrokerRig) ------------------------------------------

def _rig(tmp_path: Path, policy: dict[str, Any], versions: tuple[int, ...],
         **config: Any) -> BrokerRig:
    rig = BrokerRig(tmp_path, breaker=BreakerOptions(watch_s=30.0))
    rig.add_model("m", linear_config("m", version_policy=policy, **config),
                  versions=versions, factory="nn.Linear(4, 3)")
    rig.worker("w1", credits=64)
    for v in versions:
        rig.loaded("w1", "m", v)
    return rig


def test_a_swap_with_the_previous_version_loaded_is_watched_and_the_watch_just_ends(
        tmp_path: Path) -> None:
    rig = _rig(tmp_path / "repo", {"latest": 2}, (1, 2))
    rig.b.releases.committed("m", {2})     # what a swap's commit says
    watch = rig.b.releases.describe("m")["rollout"]
    assert watch["watch"] is True and watch["weights"] == {"2": 100, "1": 0}
    assert watch["plan"]["steps"] == [100] and watch["plan"]["dwell_s"] == 30.0
    assert rig.b.releases.next_due() == 30.0   # its window is a timer, traffic or none
    rig.tick(29.0)
    assert "m" in rig.b.releases.rollouts
    rig.tick(2.0)      # no traffic came: it ends with its window all the same
    ended = rig.b.releases.describe("m")["rollout"]
    assert ended["outcome"] == "watched" and ended["watch"] is True
    model = rig.b.catalog.models["m"]
    assert model.versions == (1, 2) and model.weights is None and not model.failed


def test_a_newer_build_during_a_watch_takes_the_traffic_and_the_watch(
        tmp_path: Path) -> None:
    rig = _rig(tmp_path / "repo", {"all": True}, (1, 2, 3))
    model = rig.b.catalog.models["m"]
    rig.b.catalog.commit(RepoModel(model.config, model.path, (1, 2)), {1: "a", 2: "b"},
                         {1, 2})
    rig.b.releases.committed("m", {2})
    assert rig.b.catalog.models["m"].default_version == 2
    rig.b.catalog.commit(RepoModel(model.config, model.path, (1, 2, 3)),
                         {1: "a", 2: "b", 3: "c"}, {1, 2, 3})
    rig.b.releases.committed("m", {3})
    watch = rig.b.releases.describe("m")["rollout"]
    assert (watch["canary"], watch["stable"], watch["outcome"]) == (3, 2, "")
    assert rig.b.catalog.models["m"].default_version == 3


def test_no_watch_without_a_previous_version_or_with_a_split(tmp_path: Path) -> None:
    rig = _rig(tmp_path / "a", {"latest": 1}, (2,))
    rig.b.releases.committed("m", {2})
    assert not rig.b.releases.rollouts
    rig = _rig(tmp_path / "b", {"latest": 2}, (1, 2), traffic={"1": 50, "2": 50})
    rig.b.releases.committed("m", {2})
    assert not rig.b.releases.rollouts


def _fail_two_batches(rig: BrokerRig) -> None:
    """Two batches of three requests, each failed whole by the model: the breaker opens."""
    for _ in range(2):
        for _ in range(3):
            rig.request()
        rig.tick()
        for _, _, batch in rig.sent(p.Kind.BATCH)[-1:]:
            rig.from_worker("w1", p.BatchResult(batch.batch_id, [], 1.0,
                                                error="RuntimeError: the model broke"))


def test_a_failing_model_is_answered_at_once_until_a_new_build(tmp_path: Path) -> None:
    rig = _rig(tmp_path / "repo", {"latest": 1}, (1,))
    _fail_two_batches(rig)
    assert rig.b.breakers.state("m", rig.now) == OPEN
    sent = len(rig.sent(p.Kind.BATCH))
    rig.request()
    rig.tick()
    assert len(rig.sent(p.Kind.BATCH)) == sent     # never queued
    _, frames = rig.to_clients[-1]
    err = p.decode_error(p.unpack(frames)[1])
    assert err.code is p.ErrorCode.UNAVAILABLE and err.retry_after_s == 5.0
    assert "circuit breaker is open" in err.message
    # a new build of version 1 swapped in (its LOAD answered): closed at its commit
    model = rig.b.catalog.models["m"]
    rig.b.lifecycle.swaps.start(Swap(RepoModel(model.config, model.path, model.versions),
                                     {1: "b" * 64}, {1}, rig.now))
    assert rig.b.breakers.state("m", rig.now) == OPEN
    rig.from_worker("w1", p.ModelLoaded("m", 1, True, sha256="b" * 64))
    assert rig.b.breakers.state("m", rig.now) == CLOSED


def test_zeroserve_models_names_an_open_breaker() -> None:
    from zeroserve.broker.admin import human

    b = Breakers(OPTS)
    b.failed("m", 3, 0.0, "RuntimeError: the model broke")
    b.failed("m", 3, 0.0, "RuntimeError: the model broke")
    doc = {"models": {"m": {"versions": [1], "ready": [1], "workers": ["w"],
                            **b.describe("m", 1.0)}}, "errors": {}}
    assert "m: circuit breaker open: 6 of 6 requests failed in 2 s: RuntimeError: the " \
           "model broke" in human("models", doc)


def test_an_open_breaker_shows_half_open_once_its_open_time_has_passed(
        tmp_path: Path) -> None:
    """No request needed: ``zeroserve models``, the metric and the status line say
    half-open (a probe would go through) once the open time is over, on the clock; the
    breaker moved there only when a request came, and an idle model showed "open"."""
    from zeroserve.broker.admin import human

    rig = _rig(tmp_path / "repo", {"latest": 1}, (1,))
    _fail_two_batches(rig)
    b, registry = rig.b.breakers, rig.b.metrics.registry

    def shown() -> tuple[str, float | None, str]:
        doc = {"models": {"m": {"versions": [1], "ready": [1], "workers": ["w1"],
                                **b.describe("m", rig.now)}}, "errors": {}}
        return (doc["models"]["m"]["breaker"]["state"],
                registry.get_sample_value("zeroserve_circuit_breaker_state", {"model": "m"}),
                human("models", doc))
    state, level, text = shown()
    assert (state, level) == (OPEN, 2.0) and "m: circuit breaker open: 6 of 6" in text
    assert b.describe("m", rig.now)["breaker"]["probe_in_s"] == 5.0
    rig.tick(4.9)
    assert shown()[:2] == (OPEN, 2.0)
    rig.tick(0.2)          # past open_s, and no request came
    state, level, text = shown()
    assert (state, level) == (HALF_OPEN, 1.0) and "m: circuit breaker half-open" in text
    assert "probe_in_s" not in b.describe("m", rig.now)["breaker"] and b.failing("m")
    rig.request()          # the first probe goes through, and the stored state agrees
    rig.tick()
    assert b.state("m", rig.now) == HALF_OPEN and shown()[1] == 1.0


def test_an_open_breaker_routes_to_another_healthy_version_it_holds(tmp_path: Path) -> None:
    rig = _rig(tmp_path / "repo", {"latest": 2}, (1, 2))
    for _ in range(2):     # version 2 (the default) fails two batches whole
        for _ in range(3):
            rig.request()
        rig.tick()
        (_, _, batch), = rig.sent(p.Kind.BATCH)[-1:]
        assert batch.version == 2
        rig.from_worker("w1", p.BatchResult(batch.batch_id, [], 1.0,
                                            error="RuntimeError: the model broke"))
    assert rig.b.breakers.state("m", rig.now) == OPEN
    assert rig.b.breakers.describe("m", rig.now)["breaker"]["version"] == 2
    for _ in range(3):
        rig.request()
    rig.tick()
    (_, _, batch), = rig.sent(p.Kind.BATCH)[-1:]
    assert batch.version == 1 and len(batch.items) == 3    # routed, not refused
    rig.run_batches("w1")
    assert rig.answers()[-3:] == ["ok"] * 3
    # a request naming the failing version is refused; one naming the healthy one runs
    b = rig.b.breakers
    assert b.route("m", 2, [1, 2]) is None and b.route("m", 1, [1, 2]) == 1
    assert b.route("m", None, [2]) is None        # nothing else held: 503 as before
    # past open_s the probes go to version 2 again: the fix is seen there
    sent = len(rig.sent(p.Kind.BATCH))
    rig.live("w1", 6)
    rig.request()
    rig.tick()
    (_, _, probe), = rig.sent(p.Kind.BATCH)[sent:]
    assert probe.version == 2
