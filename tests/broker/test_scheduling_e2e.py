"""Deadlines, shedding, execution timeouts and cancellation through real processes.

The ``spin`` models run for a time the test chooses: the largest input value is the
number of loop iterations (a few microseconds each), so a request can occupy the
only worker while the next ones queue in the broker.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import numpy as np
import pytest

from zeroserve.broker.client import AsyncClient, Client, InferError
from zeroserve.broker.protocol import ErrorCode
from tests.conftest import Server, http, linear_config, short_tmpdir, wait_for

pytestmark = pytest.mark.timeout(180)

LONG = 3_000_000  # about ten seconds of spinning: "forever" for these tests


def spin_module():
    import torch

    class Spin(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            n = int(x.max().item())
            acc = torch.zeros(1)
            for _ in range(n):
                acc = acc + 1.0
            return x[:, :1] * 0.0 + acc
    return Spin()


def write_spin(repo, name, **dynamic_batching):
    import torch
    vdir = repo / name / "1"
    vdir.mkdir(parents=True)
    torch.jit.save(torch.jit.script(spin_module()), str(vdir / "model.pt"))
    cfg = linear_config(name, n_out=1, dynamic_batching=dynamic_batching)
    (repo / name / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def server():
    repo = short_tmpdir("zsrepo")
    write_spin(repo, "deadline")
    write_spin(repo, "shed", max_queue_size=3)
    write_spin(repo, "hang", max_execution_ms=500)
    write_spin(repo, "cancel")
    srv = Server(repo, extra=["--credits", "1"]).wait_ready()
    with Client(srv.control) as c:
        wait_for(lambda: all(m["ready"] for m in c.control("models")["models"].values()),
                 30, "every model loaded")
    yield srv
    srv.stop()


def x(n, rows=1):
    return np.full((rows, 4), float(n), np.float32)


def body(n, **params):
    return json.dumps({"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32",
                                   "data": [float(n)] * 4}], "parameters": params}).encode()


def occupy(srv, model, n=LONG):
    """Start a request that keeps the only worker busy; returns its thread."""
    def run():
        with Client(srv.frontend, timeout_s=60) as c:
            try:
                c.infer(model, {"input": x(n)})
            except InferError:
                pass
    t = threading.Thread(target=run, daemon=True)
    t.start()
    with Client(srv.control) as c:
        wait_for(lambda: c.control("status")["inflight_batches"] == 1, 10, "worker busy")
    return t


def test_deadline_expiring_in_queue_answers_504_on_time(server):
    occupy(server, "deadline", n=600_000)  # about two seconds
    start = time.monotonic()
    code, _, got = http("POST", server.url + "/v2/models/deadline/infer",
                        body(1, timeout=300_000))  # 300 ms, in µs as Triton
    elapsed = time.monotonic() - start
    assert code == 504, got
    assert "deadline exceeded while queued" in json.loads(got)["error"]
    assert 0.25 <= elapsed < 1.2, f"504 came after {elapsed:.3f}s for a 300 ms deadline"
    with Client(server.control) as c:
        wait_for(lambda: c.control("status")["inflight_batches"] == 0, 30, "spin to finish")


def test_deadline_that_cannot_be_met_is_refused_at_once(server):
    # the broker now knows a 'deadline' batch takes about two seconds
    with Client(server.control) as c:
        wait_for(lambda: c.control("status")["inflight_batches"] == 0, 30, "idle worker")
    occupy(server, "deadline", n=600_000)
    start = time.monotonic()
    code, _, got = http("POST", server.url + "/v2/models/deadline/infer",
                        body(1, timeout=300_000))
    elapsed = time.monotonic() - start
    assert code == 504 and "cannot be met" in json.loads(got)["error"], got
    assert elapsed < 0.25, f"refusal took {elapsed:.3f}s"
    with Client(server.control) as c:
        wait_for(lambda: c.control("status")["inflight_batches"] == 0, 30, "spin to finish")


def test_full_queue_sheds_low_priority_newest_first(server):
    occupy(server, "shed", n=300_000)
    results: dict[str, tuple[int, dict, bytes]] = {}

    def send(tag, priority):
        results[tag] = http("POST", server.url + "/v2/models/shed/infer",
                            body(1, priority=priority))

    threads = []
    with Client(server.control) as c:
        for i in range(3):
            t = threading.Thread(target=send, args=(f"low{i}", 2))
            t.start()
            threads.append(t)
            wait_for(lambda: c.control("status")["queues"]["shed"] == i + 1, 10, "queued")
        for i in range(2):
            t = threading.Thread(target=send, args=(f"high{i}", 1))
            t.start()
            threads.append(t)
            wait_for(lambda: f"low{2 - i}" in results, 10, f"low{2 - i} to be shed")
    for t in threads:
        t.join(60)
    for tag in ("low1", "low2"):
        code, headers, got = results[tag]
        assert code == 429 and "is full" in json.loads(got)["error"], (tag, got)
        assert int(headers["retry-after"]) >= 1
    for tag in ("low0", "high0", "high1"):
        assert results[tag][0] == 200, (tag, results[tag])


def test_batch_past_max_execution_fails_and_the_worker_is_restarted(server):
    with Client(server.control) as c:
        wait_for(lambda: c.control("status")["inflight_batches"] == 0, 30, "idle worker")
        before = c.control("status")["workers"][0]["pid"]
    start = time.monotonic()
    with Client(server.frontend, timeout_s=30) as c:
        with pytest.raises(InferError) as info:
            c.infer("hang", {"input": x(LONG)})
    elapsed = time.monotonic() - start
    assert info.value.code is ErrorCode.DEADLINE
    assert "max_execution_ms" in info.value.message
    assert elapsed < 3.0, f"hung batch failed after {elapsed:.2f}s for a 500 ms bound"
    with Client(server.control) as c:
        wait_for(lambda: [w["pid"] for w in c.control("status")["workers"]
                          if "hang/1" in w["models"]] not in ([], [before]), 30,
                 "a new worker serving 'hang'")
    with Client(server.frontend) as c:
        assert c.infer("hang", {"input": x(1)}).outputs["output"][0, 0] == 1.0


def test_cancelled_request_leaves_the_queue(server):
    with Client(server.control) as c:
        wait_for(lambda: c.control("status")["inflight_batches"] == 0, 30, "idle worker")
    occupy(server, "cancel", n=2_000_000)

    async def go():
        async with AsyncClient(server.frontend) as ac:
            assert await ac.wait_connected(5)
            task = asyncio.create_task(ac.infer("cancel", {"input": x(1)}))
            ctl = Client(server.control)
            try:
                await asyncio.to_thread(wait_for, lambda: ctl.control("status")["queues"]
                                        ["cancel"] == 1, 10, "queued")
                task.cancel()
                await asyncio.to_thread(wait_for, lambda: ctl.control("status")["queues"]
                                        ["cancel"] == 0, 10, "the queue to empty")
                metrics = ctl.control("metrics")["broker"]
            finally:
                ctl.close()
            with pytest.raises(asyncio.CancelledError):
                await task
            return metrics
    metrics = asyncio.run(go())
    assert 'zeroserve_requests_rejected_total{model="cancel",reason="cancelled"} 1.0' in metrics


def test_http_client_that_disconnects_takes_its_queued_request_along(server):
    import socket

    with Client(server.control) as c:
        wait_for(lambda: c.control("status")["inflight_batches"] == 0, 30, "idle worker")
    occupy(server, "cancel", n=2_000_000)
    payload = body(1)
    request = (f"POST /v2/models/cancel/infer HTTP/1.1\r\nHost: x\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
               ).encode() + payload
    with Client(server.control) as c:
        before = c.control("metrics")["broker"]
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.sendall(request)
        wait_for(lambda: c.control("status")["queues"]["cancel"] == 1, 10, "queued")
        sock.close()  # the client gives up
        wait_for(lambda: c.control("status")["queues"]["cancel"] == 0, 10,
                 "the queue to empty")
        after = c.control("metrics")["broker"]
    line = 'zeroserve_requests_rejected_total{model="cancel",reason="cancelled"}'
    count = lambda text: float(text.split(line)[1].split()[0]) if line in text else 0.0  # noqa
    assert count(after) == count(before) + 1
