"""LoadRetries: backoff with jitter, bounded, one worker at a time per content."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, strategies as st

from tests.broker.rig import BrokerRig
from tests.conftest import linear_config
from zeroserve.broker import protocol as p
from zeroserve.broker.server.loadretry import LoadRetries, RetryPolicy

LOAD = p.LoadModel("m", 1, "/repo/m/1", {}, "a" * 64)


def retries(attempts: int = 4, draw: float = 0.0) -> LoadRetries:
    return LoadRetries(RetryPolicy(attempts, base_s=1.0, max_s=5.0), draw=lambda: draw)


@given(st.integers(1, 30), st.floats(0.0, 0.999))
def test_the_wait_doubles_up_to_its_bound_and_never_falls_below_half(failures: int,
                                                                     draw: float) -> None:
    policy = RetryPolicy(10, base_s=1.0, max_s=5.0)
    ceiling = min(5.0, 2.0 ** (failures - 1))
    assert ceiling / 2 <= policy.delay_s(failures, draw) <= ceiling


def test_a_transient_failure_is_retried_after_its_wait_and_a_lasting_one_is_not() -> None:
    r = retries()
    assert r.failed("w0", LOAD, "MemoryError", True, now=10.0) is not None
    assert r.take_due(10.4) == []          # the first wait is 0.5..1 s
    assert r.next_due() == 10.5
    assert r.take_due(10.5) == [("w0", LOAD)]
    assert r.describe("m", 10.5)["load_retries"]["1"]["running_on"] == "w0"
    assert r.failed("w0", LOAD, "RuntimeError: not a zip", False, now=11.0) is None
    assert not r and r.describe("m", 11.0) == {}


def test_the_attempts_are_bounded_and_counted_per_content_not_per_worker() -> None:
    r = retries(attempts=3)
    assert r.failed("w0", LOAD, "MemoryError", True, now=0.0)
    [(first, _)] = r.take_due(100.0)
    assert r.failed(first, LOAD, "MemoryError", True, now=100.0)   # attempt 2 of 3
    r.worker_left(first)          # a worker killed during a retry does not reset the count
    assert r.describe("m", 100.0)["load_retries"]["1"]["attempts"] == 2
    assert r.take_due(200.0) == []     # its parked load went with it
    assert r.park("w0", LOAD)          # back again: waits for its turn
    [(again, _)] = r.take_due(200.0)
    assert r.failed(again, LOAD, "MemoryError", True, now=200.0) is None   # the third
    assert not r


def test_one_worker_at_a_time_and_the_first_success_releases_the_others() -> None:
    r = retries()
    assert r.failed("w0", LOAD, "MemoryError", True, now=0.0)
    # the swap's loads on the other workers were sent at once: the same attempt
    assert r.failed("w1", LOAD, "MemoryError", True, now=0.01)
    assert r.failed("w2", LOAD, "MemoryError", True, now=0.02)
    assert r.describe("m", 0.0)["load_retries"]["1"]["attempts"] == 1
    assert r.take_due(50.0) == [("w0", LOAD)]
    assert r.take_due(60.0) == []      # w0's retry runs: nobody else meanwhile
    assert not r.park("w0", LOAD)      # the retry itself is sent
    assert sorted(w for w, _ in r.succeeded("m", 1, LOAD.sha256)) == ["w1", "w2"]
    assert not r and not r.park("w3", LOAD)


def test_a_failure_that_gives_up_names_the_loads_parked_behind_it() -> None:
    r = retries(attempts=2)
    r.failed("w0", LOAD, "MemoryError", True, now=0.0)
    r.park("w1", LOAD)
    [(w, _)] = r.take_due(5.0)
    assert r.failed(w, LOAD, "MemoryError", True, now=5.0) is None
    assert r.given_up() == ["w1"] and r.given_up() == []


def test_a_retry_no_longer_wanted_gives_the_turn_to_the_next() -> None:
    r = retries()
    r.failed("w0", LOAD, "OSError", True, now=0.0)
    r.park("w1", LOAD)
    [(w, load)] = r.take_due(5.0)
    r.skip(w, load)
    assert r.take_due(5.0) == [("w1", LOAD)]
    r.skip("w1", LOAD)
    assert not r
    other = p.LoadModel("n", 1, "/repo/n/1", {}, "b" * 64)
    r.failed("w0", other, "OSError", True, now=0.0)
    r.forget("n")
    assert not r


def test_zeroserve_models_says_how_far_the_retries_are() -> None:
    from zeroserve.broker.admin import human

    r = retries()
    r.failed("w0", LOAD, "m/1: MemoryError: no room", True, now=0.0)
    doc = {"models": {"m": {"versions": [1], "ready": [], "workers": [],
                            **r.describe("m", 0.25)}}, "errors": {}}
    assert "m/1: load attempt 1 of 4 failed (m/1: MemoryError: no room); tried again in " \
           "0.2 s" in human("models", doc)


# -- in the broker, without sockets (BrokerRig) ------------------------------------------

def test_a_swap_versions_failure_after_the_swap_failed_is_not_retried(tmp_path: Path) -> None:
    """A swap loads on every worker at once; one failed for good (the swap with it), then
    the other's MemoryError came: it was taken for a sync load of a version the catalog
    does not serve, and said "tried again in 0.6 s" of a retry that never ran."""
    rig = BrokerRig(tmp_path / "repo")
    rig.add_model("m", linear_config("m"), factory="nn.Linear(4, 3)")
    worker = rig.worker("w1")
    rig.loaded("w1", "m", 1)
    rig.from_worker("w1", p.ModelLoaded("m", 2, False, error="m/2: MemoryError: no room",
                                        transient=True))
    assert not rig.b.lifecycle.retries
    assert "load_retries" not in rig.b.lifecycle.describe("m")
    assert list(worker.load_errors.values()) == ["m/2: MemoryError: no room"]   # as it is
