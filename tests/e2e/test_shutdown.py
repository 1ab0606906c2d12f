"""Graceful shutdown: SIGTERM to the broker answers every queued request (completed, or
503) and exits; SIGTERM to the gateway turns readiness false at once and lets in-flight
HTTP requests finish."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request
from typing import Any

import pytest

from tests.conftest import Server, http, short_tmpdir, wait_for
from tests.e2e.load import cli, spin_input, worker, worker_ids, write_spin_model
from zeroserve.broker.client import Client, InferError

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def srv():
    repo = short_tmpdir("zsrepo")
    write_spin_model(repo)
    server = Server(repo, workers=1).wait_ready()
    yield server
    server.stop()


def serving(srv: Server) -> bool:
    try:
        ids = worker_ids(srv.control)
        w = worker(srv.control, ids[0]) if ids else None
    except InferError:
        return False
    return bool(w and w["state"] == "ready" and w["models"] == ["spin/1"])


def queue_depth(srv: Server) -> int:
    with Client(srv.control, timeout_s=5) as c:
        return int(c.control("status")["queues"].get("spin", 0))


def send_all(srv: Server, n: int, rounds: int) -> tuple[list[str], list[threading.Thread]]:
    outcomes: list[str] = []

    def one() -> None:
        with Client(srv.frontend, timeout_s=60) as c:
            try:
                c.infer("spin", {"input": spin_input(rounds)})
                outcomes.append("ok")
            except InferError as exc:
                outcomes.append(exc.code.value)

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    return outcomes, threads


def join(threads: list[threading.Thread], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a request hung"


def test_sigterm_to_the_broker_answers_every_queued_request(srv: Server) -> None:
    wait_for(lambda: serving(srv), 30, "the worker")
    outcomes, threads = send_all(srv, 10, rounds=150)
    wait_for(lambda: queue_depth(srv) >= 5, 20, "a queue")
    broker = srv.pids("broker")[0]
    os.kill(broker, signal.SIGTERM)
    join(threads, 40)
    # the worker keeps working while the broker stops: queued work completes
    assert len(outcomes) == 10 and set(outcomes) <= {"ok", "unavailable"}, outcomes
    assert outcomes.count("ok") >= 2
    wait_for(lambda: broker not in srv.pids("broker"), 20, "the broker to exit")
    assert "broker stopped" in srv.log()


def test_sigterm_to_the_broker_fails_at_once_what_no_worker_can_take(srv: Server) -> None:
    wait_for(lambda: serving(srv), 30, "the worker (the broker restarted)")
    (only,) = worker_ids(srv.control)
    assert cli("drain", only, "--control", srv.control).returncode == 0
    outcomes, threads = send_all(srv, 6, rounds=1)
    wait_for(lambda: queue_depth(srv) == 6, 20, "the requests to queue")
    start = time.monotonic()
    os.kill(srv.pids("broker")[0], signal.SIGTERM)
    try:
        join(threads, 20)
    except AssertionError:
        raise AssertionError(f"outcomes {outcomes}; log:\n{srv.log()[-4000:]}") from None
    # not after the 30 s drain bound: nothing could ever take them
    assert time.monotonic() - start < 10
    assert outcomes == ["unavailable"] * 6


def test_sigterm_to_the_gateway_finishes_in_flight_requests(srv: Server) -> None:
    wait_for(lambda: serving(srv), 30, "the worker (the broker restarted)")
    wait_for(lambda: http("GET", srv.url + "/v2/health/ready", timeout=2)[0] == 200, 30,
             "the gateway to be ready again")
    body = json.dumps({"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32",
                                   "data": spin_input(800).ravel().tolist()}]}).encode()
    result: dict[str, Any] = {}

    def slow_request() -> None:
        result["status"], _, result["body"] = http("POST", srv.url + "/v2/models/spin/infer",
                                                   body, timeout=60)

    t = threading.Thread(target=slow_request)
    t.start()

    def inflight() -> bool:
        with Client(srv.control, timeout_s=5) as c:
            return bool(c.control("status")["inflight_batches"])

    wait_for(inflight, 20, "the request to run")
    gateway = srv.pids("gateway")[0]
    os.kill(gateway, signal.SIGTERM)
    ready_answers = []
    while Server.alive(gateway) and len(ready_answers) < 200:
        try:
            with urllib.request.urlopen(srv.url + "/v2/health/ready", timeout=2) as r:
                ready_answers.append(r.status)
        except OSError as exc:  # 503, or refused: the listener is closed
            ready_answers.append(getattr(exc, "code", "refused"))
    assert 200 not in ready_answers, ready_answers
    t.join(60)
    assert result["status"] == 200, result
    wait_for(lambda: not Server.alive(gateway), 20, "the gateway to exit")
