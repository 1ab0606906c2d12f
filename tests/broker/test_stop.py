"""The broker's stop path without sockets (outboxes are lists, the clock a number):
workers signalled with it stay at work until what it accepted is answered, a worker
signalled alone drains, a draining gateway's requests stay admitted, the drain bound
503s what is left, and ``drain_all`` is the same path without the exit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from tests.conftest import linear_config
from zeroserve.broker import protocol as p
from zeroserve.broker.server.broker import Broker
from zeroserve.broker.server.catalog import CatalogModel
from zeroserve.models.repository import parse_config


class Rig:
    def __init__(self, tmp_path: Path, drain_s: float = 30.0) -> None:
        self.now = 0.0
        self.to_workers: list[tuple[bytes, list[Any]]] = []
        self.to_clients: list[tuple[bytes, list[Any]]] = []
        self.b = Broker(tmp_path, to_client=self._out(self.to_clients),
                        to_worker=self._out(self.to_workers), to_controller=self._out([]),
                        clock=lambda: self.now, drain_timeout_s=drain_s, latency_model=False)
        cfg = parse_config(linear_config("m", mbs=1), "test")
        model = CatalogModel(cfg, tmp_path / "m", (1,), {1})
        self.b.catalog.models["m"] = model
        self.b.scheduler.set_policy("m", model.policy())
        self.rids = 0

    @staticmethod
    def _out(box: list[tuple[bytes, list[Any]]]) -> Any:
        def send(identity: bytes, frames: list[Any]) -> bool:
            box.append((identity, [bytes(f) for f in frames]))
            return True
        return send

    def worker(self, name: str) -> None:
        self.b.pool.register(name.encode(), p.WorkerReady(name, credits=1, models=[["m", 1]]),
                             self.now)

    def request(self, client: bytes = b"gw") -> None:
        self.rids += 1
        req = p.InferRequest(str(self.rids), "m",
                             [p.from_numpy("input", np.ones((1, 4), np.float32))])
        self.b.on_frontend(client, [bytes(f) for f in p.encode_request(req)])

    def from_worker(self, name: str, msg: Any) -> None:
        frames = p.encode_result(msg) if isinstance(msg, p.BatchResult) else p.encode(msg)
        self.b.on_backend(name.encode(), [bytes(f) for f in frames])

    def tick(self, dt: float = 0.0) -> None:
        self.now += dt
        self.b.tick(self.now)

    def sent(self, kind: p.Kind) -> list[tuple[bytes, dict[str, Any], Any]]:
        out = []
        for identity, frames in self.to_workers:
            k, header, bufs = p.unpack(frames)
            if k is kind:
                out.append((identity, header, p.decode_batch(header, bufs)
                            if k is p.Kind.BATCH else p.decode(p.Disconnect, header)))
        return out

    def run_batches(self, name: str) -> None:
        """Answer each batch the worker got, one at a time, until none comes."""
        answered: set[int] = set()
        while True:
            todo = [b for _, _, b in self.sent(p.Kind.BATCH) if b.batch_id not in answered]
            if not todo:
                return
            for batch in todo:
                answered.add(batch.batch_id)
                self.from_worker(name, p.BatchResult(batch.batch_id, [
                    p.InferReply(i.request_id, batch.model, batch.version, i.tensors)
                    for i in batch.items], 1.0))
                self.tick(0.1)

    def live(self, name: str, seconds: int) -> None:
        """Time passes, the worker heartbeating."""
        for _ in range(seconds):
            self.from_worker(name, p.WorkerHeartbeat({}, ""))
            self.tick(1.0)

    def answers(self) -> list[str]:
        kinds = [p.unpack(frames)[0] for _, frames in self.to_clients]
        return ["ok" if k is p.Kind.REPLY else "error" for k in kinds
                if k in (p.Kind.REPLY, p.Kind.ERROR)]

    def disconnects(self) -> list[str]:
        return [msg.reason.value for _, _, msg in self.sent(p.Kind.DISCONNECT)]


def test_a_worker_signalled_with_the_broker_runs_its_queue_then_is_released(
        tmp_path: Path) -> None:
    r = Rig(tmp_path)
    r.worker("w")
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
    r = Rig(tmp_path)
    r.worker("w")
    for _ in range(3):
        r.request()
    r.b.request_stop()
    r.tick()
    r.from_worker("w", p.Leave(p.LeaveReason.SHUTDOWN, True))
    r.run_batches("w")
    assert r.answers() == ["ok"] * 3 and r.b.finished(r.now)


def test_a_worker_signalled_alone_drains_and_goes_after_a_heartbeat(tmp_path: Path) -> None:
    r = Rig(tmp_path)
    r.worker("w")
    r.worker("v")
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
    r = Rig(tmp_path)
    r.worker("w")
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
    r = Rig(tmp_path, drain_s=10.0)   # shorter than the model's max_execution_ms
    r.worker("w")
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
    r = Rig(tmp_path)
    r.worker("w")
    for _ in range(2):
        r.request()
    r.tick()
    assert r.b._drain_all({})["open_requests"] == 2
    r.request()                       # nothing new, even from a gateway
    r.run_batches("w")
    assert r.answers() == ["error", "ok", "ok"]
    r.live("w", 40)   # past the drain bound: no exit, and nothing 503s
    assert not r.b.finished(r.now) and r.disconnects() == []
    r.b._undrain_all({})
    r.request()
    r.run_batches("w")
    assert r.answers()[-1] == "ok"
