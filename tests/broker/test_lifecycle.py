"""The broker's two-phase swap with real sockets, real files and real inotify, and
workers played by DEALER sockets in the test, so each can answer LOAD as it likes
(a wrong sha256, a failure)."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import zmq

from zeroserve.broker import protocol as p
from zeroserve.broker.client import Client
from zeroserve.broker.server.broker import Broker
from zeroserve.broker.server.lifecycle import LifecycleOptions
from zeroserve.models.repository import version_sha256
from tests.broker.running import broker_in_thread
from tests.conftest import linear_config, short_tmpdir

pytestmark = pytest.mark.timeout(60)


OPEN: list[zmq.Socket[Any]] = []  # closed by the fixture, so none outlives its test


class FakeWorker:
    def __init__(self, ctx: zmq.Context[Any], endpoint: str, wid: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        OPEN.append(self.sock)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, wid.encode())
        self.sock.connect(endpoint)
        self.sock.send_multipart(p.encode(p.WorkerReady(wid, 1)))

    def expect(self, kind: p.Kind, timeout_s: float = 10.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            left = int((deadline - time.monotonic()) * 1000)
            assert left > 0 and self.sock.poll(left), f"no {kind.name} within {timeout_s}s"
            got, header, _ = p.unpack(self.sock.recv_multipart())
            if got is kind:
                return header

    def loaded(self, header: dict[str, Any], ok: bool = True, sha: str | None = None,
               error: str = "") -> None:
        self.sock.send_multipart(p.encode(p.ModelLoaded(
            header["model"], header["version"], ok, error,
            sha if sha is not None else header.get("sha256", ""), 1000, 0.01)))


def write_version(repo: Path, version: int, publish: bool = True) -> None:
    tmp = repo / "m" / (f".tmp-{version}" if publish else str(version))
    tmp.mkdir(parents=True)
    (tmp / "model.pt").write_bytes(f"weights of version {version}".encode())
    if publish:
        os.rename(tmp, repo / "m" / str(version))


@pytest.fixture
def broker() -> Iterator[tuple[Broker, Path, zmq.Context[Any]]]:
    repo = short_tmpdir("zsrepo")
    write_version(repo, 1, publish=False)
    (repo / "m" / "config.json").write_text(json.dumps(linear_config("m")))
    with broker_in_thread(repo, LifecycleOptions(debounce_s=0.05)) as (b, ctx):
        yield b, repo, ctx
        while OPEN:
            OPEN.pop().close(linger=0)
    shutil.rmtree(repo, ignore_errors=True)


def control(b: Broker, verb: str) -> Any:
    with Client(b.endpoints.control, timeout_s=5) as c:
        return c.control(verb)


def test_a_sha256_mismatch_keeps_the_worker_out_of_the_swap(broker) -> None:
    b, repo, ctx = broker
    w0 = FakeWorker(ctx, b.endpoints.backend, "host/0")
    w1 = FakeWorker(ctx, b.endpoints.backend, "host/1")
    for w in (w0, w1):
        w.loaded(w.expect(p.Kind.LOAD), sha=version_sha256(repo / "m" / "1"))
    write_version(repo, 2)
    h0, h1 = w0.expect(p.Kind.LOAD), w1.expect(p.Kind.LOAD)
    assert h0["version"] == h1["version"] == 2
    assert h0["sha256"] == version_sha256(repo / "m" / "2")
    assert control(b, "models")["models"]["m"]["ready"] == [1], "flipped before all were ready"
    w1.loaded(h1, sha="0" * 64)
    assert w1.expect(p.Kind.UNLOAD)["version"] == 2      # kept out of the swap
    assert control(b, "models")["models"]["m"]["ready"] == [1], "flipped before w0 was ready"
    w0.loaded(h0)
    assert w0.expect(p.Kind.UNLOAD)["version"] == 1      # the old version retired
    m = control(b, "models")["models"]["m"]
    assert m["ready"] == [2] and m["workers"] == ["host/0"]
    st = {w["id"]: w for w in control(b, "status")["workers"]}
    assert "differs from the repository's" in st["host/1"]["load_errors"]["m/2"]
    assert 'zeroserve_model_swaps_total{model="m"} 1.0' in control(b, "metrics")["broker"]
    assert 'zeroserve_model_swap_failures_total{model="m"} 0.0' in \
        control(b, "metrics")["broker"]


def test_a_failed_load_flips_nothing_and_shows_everywhere(broker) -> None:
    b, repo, ctx = broker
    w0 = FakeWorker(ctx, b.endpoints.backend, "host/0")
    w0.loaded(w0.expect(p.Kind.LOAD), sha=version_sha256(repo / "m" / "1"))
    write_version(repo, 2)
    w0.loaded(w0.expect(p.Kind.LOAD), ok=False, error="bad archive")
    deadline = time.monotonic() + 5
    while "last_failure" not in control(b, "models")["models"]["m"]:
        assert time.monotonic() < deadline, "the failure never showed"
    doc = control(b, "models")
    assert doc["models"]["m"]["ready"] == [1]
    assert "bad archive" in doc["models"]["m"]["last_failure"]["error"]
    assert "bad archive" in doc["errors"]["m"]
    metrics = control(b, "metrics")["broker"]
    assert 'zeroserve_model_load_failure_total{model="m"} 1.0' in metrics
    assert "zeroserve_model_swaps_total{" not in metrics
    # what ZeroserveSwapFailed reads: 0 from the first commit, 1 now
    assert 'zeroserve_model_swap_failures_total{model="m"} 1.0' in metrics
