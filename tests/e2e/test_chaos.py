"""Chaos under load, with real processes: 2 workers, HTTP and direct clients at
concurrency 32; a worker SIGKILLed several times, one SIGSTOPped past the heartbeat
expiry, and a batch that hangs past max_execution_ms. The broker's pid never changes,
every request gets exactly one answer, and at least 99% succeed (another worker can
always serve)."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import threading
import time
import urllib.request
from collections import Counter
from typing import Any, Iterator

import numpy as np
import pytest

from zeroserve.broker.client import Client, ErrorCode, InferError
from tests.conftest import Server, linear_config, short_tmpdir, wait_for, write_model

pytestmark = pytest.mark.timeout(300)

SLEEPY = '''
import time
import torch


class Model:
    def load(self, version_dir, device):
        pass

    def predict(self, inputs):
        x = inputs["input"]
        if float(x[0, 0]) == 999.0:   # the poison input: hangs its worker
            time.sleep(30)  # noqa: sleep-ok (the model under test hangs)
        return {"output": x[:, :3] * 2.0}
'''


@pytest.fixture
def server() -> Iterator[Server]:
    repo = short_tmpdir("zsrepo")
    write_model(repo, "linear", 1, "nn.Linear(4, 3)", linear_config("linear", mbs=32))
    (repo / "sleepy" / "1").mkdir(parents=True)
    (repo / "sleepy" / "1" / "model.py").write_text(SLEEPY)
    (repo / "sleepy" / "config.json").write_text(json.dumps(
        {**linear_config("sleepy"), "platform": "python",
         "dynamic_batching": {"max_execution_ms": 1000}}))
    srv = Server(repo, workers=2).wait_ready()
    wait_for(lambda: len(workers(srv)) == 2, 60, "both workers")
    yield srv
    srv.stop()


def workers(srv: Server) -> list[dict[str, Any]]:
    with Client(srv.control, timeout_s=5) as c:
        return [w for w in c.control("status")["workers"] if len(w["models"]) == 2]


def shed_by_gateway(srv: Server) -> int:
    """Requests the gateways answered 503 themselves (their event loop lagging on a loaded
    host): those never reach the broker, so its count leaves them out."""
    with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return int(sum(float(v) for v in re.findall(
        r'zeroserve_gateway_shed_total{[^}]*} ([0-9.e+]+)', text)))


def answered_by_broker(srv: Server, model: str) -> int:
    with Client(srv.control, timeout_s=5) as c:
        text = c.control("metrics")["broker"]
    return int(sum(float(v) for v in re.findall(
        rf'zeroserve_inference_requests_total{{model="{model}",status="[a-z_]+"}} ([0-9.e+]+)',
        text)))


class Traffic:
    """16 direct clients and 16 HTTP keep-alive connections, each one request at a time."""

    X = np.ones((1, 4), np.float32)
    BODY = json.dumps({"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32",
                                   "data": [1.0] * 4}]}).encode()

    def __init__(self, srv: Server) -> None:
        self.srv = srv
        self.outcomes: Counter[str] = Counter()
        self.sent = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._direct) for _ in range(16)] + \
            [threading.Thread(target=self._http) for _ in range(16)]

    def _record(self, what: str) -> None:
        with self._lock:
            self.outcomes[what] += 1

    def _direct(self) -> None:
        with Client(self.srv.frontend, timeout_s=30) as c:
            while not self._stop.is_set():
                with self._lock:
                    self.sent += 1
                try:
                    c.infer("linear", {"input": self.X})
                    self._record("ok")
                except InferError as exc:
                    self._record("timeout" if "no answer" in exc.message else exc.code.value)

    def _http(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.srv.port, timeout=30)
        while not self._stop.is_set():
            with self._lock:
                self.sent += 1
            try:
                conn.request("POST", "/v2/models/linear/infer", self.BODY,
                             {"Content-Type": "application/json"})
                resp = conn.getresponse()
                resp.read()
                self._record("ok" if resp.status == 200 else f"http {resp.status}")
            except OSError:
                self._record("timeout")
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", self.srv.port, timeout=30)
        conn.close()

    def total(self) -> int:
        with self._lock:
            return sum(self.outcomes.values())

    def more(self, n: int, what: str) -> None:
        target = self.total() + n
        wait_for(lambda: self.total() >= target, 60, what)

    def __enter__(self) -> "Traffic":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)
        assert not any(t.is_alive() for t in self._threads), "a request hung"


def worker_pids(srv: Server) -> list[int]:
    return srv.pids("worker")


def test_chaos_keeps_one_answer_per_request_and_the_broker_up(server: Server) -> None:
    srv = server
    broker = srv.pids("broker")
    assert len(broker) == 1
    with Traffic(srv) as load:
        load.more(200, "traffic to flow")
        for round_ in range(4):                       # SIGKILL, alternating victims
            pids = worker_pids(srv)
            victim = pids[round_ % len(pids)]
            os.kill(victim, signal.SIGKILL)
            load.more(100, "traffic after a SIGKILL")
            # the broker's view, not pgrep's: a killed worker leaves the process table
            # before the broker has noticed, and killing the other one then leaves none
            wait_for(lambda: sorted(w["pid"] != victim for w in workers(srv)) == [True, True],
                     60, "the killed worker back")
        stopped = worker_pids(srv)[0]                 # SIGSTOP past the heartbeat expiry
        os.kill(stopped, signal.SIGSTOP)
        try:
            wait_for(lambda: len(workers(srv)) == 1, 20, "the stopped worker dropped")
            load.more(100, "traffic while one worker is stopped")
        finally:
            os.kill(stopped, signal.SIGCONT)
        wait_for(lambda: len(workers(srv)) == 2, 60, "the stopped worker back")
        start = time.monotonic()                      # a batch that hangs
        with Client(srv.frontend, timeout_s=30) as c, pytest.raises(InferError) as err:
            c.infer("sleepy", {"input": np.full((1, 4), 999.0, np.float32)})
        assert err.value.code is ErrorCode.DEADLINE and "max_execution_ms" in err.value.message
        assert time.monotonic() - start < 5
        load.more(100, "traffic after the hang")
        wait_for(lambda: len(workers(srv)) == 2, 60, "the hung worker replaced")
        load.more(50, "traffic at the end")
    assert srv.pids("broker") == broker, "the broker restarted"
    got = load.outcomes
    print(f"chaos outcomes: {dict(got)} of {load.sent} sent")
    assert got["timeout"] == 0, got
    assert got["ok"] >= 0.99 * load.total(), got
    assert load.total() == load.sent
    # exactly one answer each: the broker answered as many as were sent less those the
    # gateways shed at their door (each a 503 the load counted), no more
    shed = shed_by_gateway(srv)
    assert shed <= got["http 503"], (shed, got)
    wait_for(lambda: answered_by_broker(srv, "linear") + shed == load.sent, 10,
             f"the broker's count ({answered_by_broker(srv, 'linear')}) and the gateways' "
             f"sheds ({shed}) to match {load.sent}")
    with Client(srv.frontend, timeout_s=10) as c:   # the hung model serves again
        answer = c.infer("sleepy", {"input": np.ones((1, 4), np.float32)})
        assert answer.outputs["output"][0, 0] == 2.0
    # once every request is answered, nothing of any remains in the broker
    with Client(srv.control, timeout_s=10) as c:
        census = c.control("census")
    assert census and not any(census.values()), census
