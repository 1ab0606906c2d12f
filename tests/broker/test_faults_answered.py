"""A real broker process (`zeroserve broker`) with its worker played by a DEALER in the
test, so the worker can send what no real one would: results with NaN or infinite
times, and a second claim to a worker id. Every malformed message that names its
requests or its control call gets an answer naming the problem; nothing over the byte
limits is decoded; and after each case the broker has the same pid, serves, holds
nothing of any answered request (its census), and has not grown."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

import msgpack
import numpy as np
import pytest
import zmq

from zeroserve.broker import protocol as p
from zeroserve.broker.client import Client, InferError
from zeroserve.models.repository import version_sha256
from tests.conftest import ZEROSERVE, linear_config, short_tmpdir, wait_for

pytestmark = pytest.mark.timeout(120)

MAX_MESSAGE = 64 << 10   # the broker's --max-message-bytes here


class Worker:
    """A worker played by the test: registers, loads what it is told, answers batches
    as each test says."""

    def __init__(self, endpoint: str, wid: str, pid: int) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, f"{wid}#{pid}".encode())
        self.sock.connect(endpoint)
        self.wid = wid
        self.sock.send_multipart(p.encode(p.WorkerReady(wid, 2, pid, "testhost")))

    def expect(self, kind: p.Kind, timeout_s: float = 10.0) -> tuple[dict[str, Any], list[Any]]:
        deadline = time.monotonic() + timeout_s
        while True:
            left = int((deadline - time.monotonic()) * 1000)
            assert left > 0 and self.sock.poll(left), f"{self.wid}: no {kind.name}"
            got, header, bufs = p.unpack(self.sock.recv_multipart())
            if got is kind:
                return header, list(bufs)
            if got is p.Kind.HEARTBEAT:
                self.sock.send_multipart(p.encode(p.WorkerHeartbeat()))

    def send_raw(self, header: dict[str, Any], bufs: list[Any]) -> None:
        self.sock.send_multipart([p.Kind.RESULT.value, msgpack.packb({"v": 1, **header}),
                                  *bufs])

    def echo(self, batch: dict[str, Any], bufs: list[Any], **fields: Any) -> None:
        """Answer a batch with zeros of the output's shape, ``fields`` overriding the
        result header."""
        replies, out = [], []
        for rid, metas, _ in batch["items"]:
            n = metas[0][2][0]
            replies.append([rid, [["output", "FP32", [n, 3]]]])
            out.append(np.zeros((n, 3), np.float32).tobytes())
        self.send_raw({"id": batch["id"], "replies": replies, "compute_ms": 1.0,
                       "phases_ms": {"infer": 1.0}, **fields}, out)

    def close(self) -> None:
        self.sock.close(linger=0)


class Broker:
    def __init__(self, repo: Path) -> None:
        self.runtime = short_tmpdir("zsrt")
        self.log_path = self.runtime / "broker.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [*ZEROSERVE, "broker", "--model-dir", str(repo), "--runtime-dir",
             str(self.runtime), "--max-message-bytes", str(MAX_MESSAGE),
             "--worker-expiry-s", "60", "--log-level", "info"],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        self.frontend = f"ipc://{self.runtime}/frontend"
        self.control = f"ipc://{self.runtime}/control"
        self.backend = f"ipc://{self.runtime}/backend"

    def call(self, verb: str, **args: Any) -> Any:
        with Client(self.control, timeout_s=10) as c:
            return c.control(verb, **args)

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()
        shutil.rmtree(self.runtime, ignore_errors=True)


@pytest.fixture(scope="module")
def rig() -> Iterator[tuple[Broker, Worker]]:
    repo = short_tmpdir("zsrepo")
    vdir = repo / "m" / "1"
    vdir.mkdir(parents=True)
    (vdir / "model.pt").write_bytes(b"weights the stand-in worker never reads")
    (repo / "m" / "config.json").write_text(json.dumps(linear_config("m")))
    broker = Broker(repo)
    wait_for(lambda: _answers(broker), 30, "the broker to answer")
    worker = Worker(broker.backend, "host/0", 4242)
    worker.expect(p.Kind.LOAD)
    worker.sock.send_multipart(p.encode(p.ModelLoaded(
        "m", 1, True, sha256=version_sha256(vdir), memory_bytes=1000, load_s=0.01)))
    wait_for(lambda: broker.call("models")["models"]["m"]["ready"] == [1], 10, "m ready")
    try:
        yield broker, worker
    finally:
        worker.close()
        broker.stop()
        shutil.rmtree(repo, ignore_errors=True)


def _answers(broker: Broker) -> bool:
    if broker.proc.poll() is not None:
        raise AssertionError(broker.log_path.read_text())
    try:
        broker.call("status")
        return True
    except InferError:
        return False


def serve_one(broker: Broker, worker: Worker, rid: str = "one", **result: Any
              ) -> tuple[p.Kind, dict[str, Any]]:
    """One request through the stand-in worker, answered with ``result``'s fields."""
    raw = Raw(broker.frontend)
    try:
        req = p.InferRequest(rid, "m", [p.from_numpy("input", np.ones((1, 4), np.float32))])
        raw.sock.send_multipart(p.encode_request(req))
        batch, bufs = worker.expect(p.Kind.BATCH)
        worker.echo(batch, bufs, **result)
        (answer,) = raw.wait([rid]).values()
        assert not raw.sock.poll(200), "a second answer"
        return answer
    finally:
        raw.close()


@pytest.fixture
def healthy(rig: tuple[Broker, Worker]) -> Iterator[tuple[Broker, Worker]]:
    """After the case: same pid, still serving, nothing of any request left, not grown."""
    broker, worker = rig
    pid, rss = broker.proc.pid, broker.rss_bytes()
    yield rig
    assert broker.proc.poll() is None and broker.proc.pid == pid
    kind, _ = serve_one(broker, worker)
    assert kind is p.Kind.REPLY
    census = broker.call("census")
    assert not any(census.values()), census
    # apart from the census: the response cache keeps answers for good, within its bound
    cache = broker.call("response_cache")
    assert cache["bytes"] <= cache["bound_bytes"], cache
    assert broker.rss_bytes() < rss + (40 << 20), (rss, broker.rss_bytes())


class Raw:
    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def ask(self, frames: list[Any], ids: list[str], timeout_s: float = 5.0
            ) -> dict[str, tuple[p.Kind, dict[str, Any]]]:
        self.sock.send_multipart(frames)
        return self.wait(ids, timeout_s)

    def wait(self, ids: list[str], timeout_s: float = 10.0
             ) -> dict[str, tuple[p.Kind, dict[str, Any]]]:
        got: dict[str, tuple[p.Kind, dict[str, Any]]] = {}
        deadline = time.monotonic() + timeout_s
        while set(got) != set(ids):
            left = int((deadline - time.monotonic()) * 1000)
            assert left > 0 and self.sock.poll(left), f"unanswered: {set(ids) - set(got)}"
            kind, header, _ = p.unpack(self.sock.recv_multipart())
            assert header.get("id") not in got, f"two answers to {header.get('id')}"
            got[header["id"]] = (kind, header)
        return got

    def close(self) -> None:
        self.sock.close(linger=0)


@pytest.mark.parametrize("field, value", [
    ("compute_ms", float("nan")), ("compute_ms", float("inf")), ("compute_ms", -1.0),
    ("phases_ms", {"infer": float("nan")}), ("phases_ms", {"input": float("-inf")})])
def test_a_result_with_a_time_that_is_not_finite_still_answers(healthy: Any, field: str,
                                                              value: Any) -> None:
    """Its batch used to be lost (neither answered nor retried), and the NaN poisoned
    the latency model so that admission never refused on a deadline again."""
    broker, worker = healthy
    kind, header = serve_one(broker, worker, **{field: value})
    assert kind is p.Kind.ERROR and header["code"] == "internal", header
    assert field in header["message"] and "finite" in header["message"]


def test_huge_headers_are_refused_at_the_door_and_answered(healthy: Any) -> None:
    """200,000 keys cost the loop 102 ms to decode, and the broker's memory for good."""
    broker, _ = healthy
    raw = Raw(broker.frontend)
    keys = {f"k{i}": i for i in range(200_000)}
    big = msgpack.packb({"id": "big", "v": 1, **keys})
    many = msgpack.packb({"id": "many", "v": 1, "model": "m", "tensors": [1] * 70_000})
    t0 = time.monotonic()
    got = raw.ask([p.Kind.REQUEST.value, big], ["big"])
    got.update(raw.ask([p.Kind.REQUEST.value, many], ["many"]))
    assert time.monotonic() - t0 < 2.0
    assert got["big"][1]["code"] == "too_large" and "header of" in got["big"][1]["message"]
    assert got["many"][1]["code"] == "too_large"
    raw.close()
    ctl = Raw(broker.control)
    (kind, reply), = ctl.ask([p.Kind.CONTROL.value, msgpack.packb(
        {"id": "ctl", "v": 1, "verb": "status", "args": {f"a{i}": i for i in range(70_000)}})],
        ["ctl"]).values()
    assert kind is p.Kind.CONTROL_REPLY and not reply["ok"] and reply["code"] == "too_large"
    assert "more than" in reply["error"]
    ctl.close()


def test_tensors_over_the_message_limit_are_answered_too_large(healthy: Any) -> None:
    broker, _ = healthy
    n = MAX_MESSAGE // 16 + 1
    req = p.InferRequest("fat", "m", [p.from_numpy("input", np.ones((n, 4), np.float32))])
    raw = Raw(broker.frontend)
    (kind, err), = raw.ask(p.encode_request(req), ["fat"]).values()
    raw.close()
    assert kind is p.Kind.ERROR and err["code"] == "too_large"
    assert f"over the limit of {MAX_MESSAGE}" in err["message"]


def _bundle(ids: list[str], **change: Any) -> list[Any]:
    frames = p.encode_requests([p.InferRequest(rid, "m", [
        p.from_numpy("input", np.ones((1, 4), np.float32))]) for rid in ids])
    header = msgpack.unpackb(frames[1])
    header.update(change)
    return [frames[0], msgpack.packb(header), *[bytes(f) for f in frames[2:]]]


@pytest.mark.parametrize("case, needle", [
    ("version", "needs protocol version 2"), ("parts", "more than 256"),
    ("frames", "tensors but carry"), ("not_a_map", "must be a map")])
def test_a_malformed_bundle_answers_every_request_it_names(healthy: Any, case: str,
                                                           needle: str) -> None:
    broker, _ = healthy
    ids = [f"{case}{i}" for i in range(300 if case == "parts" else 3)]
    frames = _bundle(ids)
    if case == "version":
        frames = _bundle(ids, v=1)
    elif case == "frames":
        frames = frames[:-1]
    elif case == "not_a_map":
        header = msgpack.unpackb(frames[1])
        header["requests"].append(7)
        frames[1] = msgpack.packb(header)
    raw = Raw(broker.frontend)
    got = raw.ask(frames, ids)
    raw.close()
    assert all(k is p.Kind.ERROR and needle in h["message"] for k, h in got.values()), got


@pytest.mark.parametrize("socket_name", ["frontend", "control"])
@pytest.mark.parametrize("fields", [{"verb": 3}, {"verb": "status", "args": [1]},
                                    {"verb": "status", "token": 5}, {"v": 9}])
def test_a_malformed_control_call_with_an_id_is_answered(healthy: Any, socket_name: str,
                                                         fields: dict[str, Any]) -> None:
    broker, _ = healthy
    raw = Raw(getattr(broker, socket_name))
    header = {"v": 1, "id": "call", "verb": "status", **fields}
    (kind, reply), = raw.ask([p.Kind.CONTROL.value, msgpack.packb(header)], ["call"]).values()
    raw.close()
    assert kind is p.Kind.CONTROL_REPLY and not reply["ok"] and reply["code"] == "bad_input"


def test_an_unknown_kind_that_names_itself_is_answered(healthy: Any) -> None:
    broker, _ = healthy
    raw = Raw(broker.frontend)
    (kind, err), = raw.ask([b"\xee", msgpack.packb({"v": 1, "id": "odd"})], ["odd"]).values()
    raw.close()
    assert kind is p.Kind.ERROR and "unknown message kind" in err["message"]


def test_a_second_process_claiming_a_live_worker_id_is_refused(healthy: Any) -> None:
    """It used to take the identity over, and back, every few seconds."""
    broker, worker = healthy
    twin = Worker(broker.backend, "host/0", 5151)
    header, _ = twin.expect(p.Kind.DISCONNECT)
    twin.close()
    assert header["reason"] == "duplicate_id"
    assert "pid 4242" in header["detail"] and "pid 5151" in header["detail"]
    workers = broker.call("status")["workers"]
    assert [(w["id"], w["pid"]) for w in workers] == [("host/0", 4242)], workers


def test_a_second_ready_from_the_same_process_changes_nothing(healthy: Any) -> None:
    """A worker that heard "unknown worker" twice registered twice, and the broker
    re-queued what it had just sent it: a request could run twice."""
    broker, worker = healthy
    raw = Raw(broker.frontend)
    req = p.InferRequest("twice", "m", [p.from_numpy("input", np.ones((1, 4), np.float32))])
    raw.sock.send_multipart(p.encode_request(req))
    batch, bufs = worker.expect(p.Kind.BATCH)
    worker.sock.send_multipart(p.encode(p.WorkerReady("host/0", 2, 4242, "testhost")))
    worker.echo(batch, bufs)
    (kind, _), = raw.wait(["twice"]).values()
    assert kind is p.Kind.REPLY
    assert not raw.sock.poll(300), "a second answer"
    raw.close()
    deadline = time.monotonic() + 0.5
    while worker.sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
        kind, _, _ = p.unpack(worker.sock.recv_multipart())
        assert kind is p.Kind.HEARTBEAT, f"{kind.name} after a second READY"
