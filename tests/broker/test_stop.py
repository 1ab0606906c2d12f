"""The broker's stop path without sockets (outboxes are lists, the clock a number):
workers signalled with it stay at work until what it accepted is answered, a worker
signalled alone drains, a draining gateway's requests stay admitted, the drain bound
503s what is left, and ``drain_all`` is the same path without the exit."""

from __future__ import annotations

from pathlib import Path

from tests.broker.rig import BrokerRig
from tests.conftest import linear_config
from zeroserve.broker import protocol as p


def stop_rig(tmp_path: Path, drain_s: float = 30.0) -> BrokerRig:
    rig = BrokerRig(tmp_path, drain_timeout_s=drain_s)
    rig.add_model("m", linear_config("m", mbs=1), ready={1})
    return rig


def worker(rig: BrokerRig, name: str) -> None:
    rig.worker(name, models=[["m", 1]])


def test_a_worker_signalled_with_the_broker_runs_its_queue_then_is_released(
        tmp_path: Path) -> None:
    r = stop_rig(tmp_path)
    worker(r, "w")
    for _ in range(4):
        r.request()
    r.tick()
    # the process group's SIGTERM: the worker's LEAVE may arrive just before ours
    r.from_worker("w", p.Leave(p.LeaveReason.SHUTDOWN, True))
    r.b.request_stop()
    r.tick(0.01)
    assert not r.b.finished(r.now) and not r.disconnects()
    r.run_batches("w")
    assert r.answers() == ["ok"] * 4
    assert r.b.finished(r.now)
    assert set(r.disconnects()) <= {"drained", "broker_stopping"} and r.disconnects()


def test_a_worker_signalled_after_the_broker_is_kept_too(tmp_path: Path) -> None:
    r = stop_rig(tmp_path)
    worker(r, "w")
    for _ in range(3):
        r.request()
    r.b.request_stop()
    r.tick()
    r.from_worker("w", p.Leave(p.LeaveReason.SHUTDOWN, True))
    r.run_batches("w")
    assert r.answers() == ["ok"] * 3 and r.b.finished(r.now)


def test_a_worker_signalled_alone_drains_and_goes_after_a_heartbeat(tmp_path: Path) -> None:
    r = stop_rig(tmp_path)
    worker(r, "w")
    worker(r, "v")
    r.from_worker("w", p.Leave(p.LeaveReason.SHUTDOWN, True))
    r.tick(0.1)
    assert r.disconnects() == []     # a broker signalled with it would have a moment
    for _ in range(3):
        r.request()
    r.tick(0.5)
    assert r.disconnects() == ["drained"]
    assert {identity for identity, _, _ in r.sent(p.Kind.BATCH)} == {b"v"}
    r.run_batches("v")
    assert r.answers() == ["ok"] * 3


def test_only_a_draining_gateway_gets_requests_into_a_stopping_broker(tmp_path: Path) -> None:
    r = stop_rig(tmp_path)
    worker(r, "w")
    r.request(b"gw")
    r.b.request_stop()
    r.tick()
    notice = p.ControlRequest("c1", "draining", {}, "")
    r.b.on_frontend(b"gw", [bytes(f) for f in p.encode(notice)])
    r.request(b"gw")      # from a keep-alive connection of the draining gateway
    r.request(b"other")   # a client that is not draining: new work, refused
    r.run_batches("w")
    assert r.answers().count("ok") == 2 and r.answers().count("error") == 1
    assert r.b.finished(r.now)


def test_past_the_drain_bound_what_is_left_gets_503_counted(tmp_path: Path) -> None:
    r = stop_rig(tmp_path, drain_s=10.0)   # shorter than the model's max_execution_ms
    worker(r, "w")
    for _ in range(3):
        r.request()
    r.b.request_stop()
    r.tick()
    r.from_worker("w", p.Leave(p.LeaveReason.SHUTDOWN, True))
    r.live("w", 9)   # alive, but its batch never ends: the bound decides
    assert not r.b.finished(r.now)
    r.from_worker("w", p.WorkerHeartbeat({}, ""))
    r.tick(1.5)
    assert r.b.finished(r.now)
    assert r.answers() == ["error"] * 3
    assert "zeroserve_shutdown_unfinished_total 3.0" in r.b.metrics.render()


def test_drain_all_is_the_stop_without_the_exit(tmp_path: Path) -> None:
    r = stop_rig(tmp_path)
    worker(r, "w")
    for _ in range(2):
        r.request()
    r.tick()
    assert r.b.shutdown.drain_all({})["open_requests"] == 2
    r.request()                       # nothing new, even from a gateway
    r.run_batches("w")
    assert r.answers() == ["error", "ok", "ok"]
    r.live("w", 40)   # past the drain bound: no exit, and nothing 503s
    assert not r.b.finished(r.now) and r.disconnects() == []
    r.b.shutdown.undrain_all({})
    r.request()
    r.run_batches("w")
    assert r.answers()[-1] == "ok"
