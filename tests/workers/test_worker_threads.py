"""The worker's threads, with real processes: its compute thread reads the broker's
socket while idle and runs each batch it reads; a batch that runs long has the main
thread read meanwhile, so the broker is heard (its heartbeats, its orders) and the
batches it sends behind the long one still run; a LOAD read meanwhile goes to the loader,
which answers the broker itself."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from tests.conftest import Server, linear_config, short_tmpdir, wait_for, write_model
from zeroserve.broker.client import Client, InferError

pytestmark = pytest.mark.timeout(120)

# longer than the worker's broker expiry (3 s at serve's --heartbeat-s 0.5): a worker
# that stopped reading for the whole batch would count the broker as gone and reconnect
LONG_S = 4.0

SLOW = f'''
import time


class Model:
    def load(self, version_dir, device):
        pass

    def predict(self, inputs):
        x = inputs["input"]
        if bool((x[:, 0] == 7.0).any()):
            time.sleep({LONG_S})  # noqa: sleep-ok (the model under test runs long)
        return {{"output": x[:, :3] * 2.0}}
'''


@pytest.fixture
def server() -> Iterator[Server]:
    repo = short_tmpdir("zsrepo")
    (repo / "slow" / "1").mkdir(parents=True)
    (repo / "slow" / "1" / "model.py").write_text(SLOW)
    (repo / "slow" / "config.json").write_text(json.dumps(
        {**linear_config("slow"), "platform": "python"}))
    write_model(repo, "lazy", 1, "nn.Linear(4, 3)", linear_config("lazy", load_on_demand=True))
    srv = Server(Path(repo)).wait_ready()
    yield srv
    srv.stop()


def inflight(server: Server) -> int:
    with Client(server.control, timeout_s=5) as c:
        return int(c.control("status")["inflight_batches"])


def test_a_batch_longer_than_the_broker_expiry_keeps_the_worker_connected(
        server: Server) -> None:
    worker = server.pids("worker")
    answers: dict[str, object] = {}

    def call(name: str, first: float) -> None:
        with Client(server.frontend, timeout_s=30) as c:
            try:
                answers[name] = c.infer("slow", {"input": np.full((1, 4), first, np.float32)})
            except InferError as exc:
                answers[name] = exc

    with Client(server.frontend, timeout_s=30) as c:   # warm: a prediction for the model
        for _ in range(3):
            c.infer("slow", {"input": np.ones((1, 4), np.float32)})
    start = time.monotonic()
    threads = [threading.Thread(target=call, args=("long", 7.0))]
    threads[0].start()
    # the short ones only once the long batch runs: each thread connects on its own, and
    # a short one that overtook it would run first and take it into its batch
    wait_for(lambda: inflight(server) == 1, 30, "the long batch to be running")
    for i in range(20):   # short ones behind it, sent while it runs
        threads.append(threading.Thread(target=call, args=(f"short{i}", 1.0)))
        threads[-1].start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a request hung"
    assert time.monotonic() - start >= LONG_S
    failed = {k: v for k, v in answers.items() if isinstance(v, InferError)}
    assert not failed and len(answers) == 21, failed
    log = server.log()
    assert "broker silent" not in log and "registering again" not in log, log[-3000:]
    assert server.pids("worker") == worker


def state(server: Server, name: str) -> str:
    with Client(server.control, timeout_s=5) as c:
        return str(c.control("models")["models"][name].get("state"))


def test_a_model_asked_for_while_a_long_batch_runs_loads_meanwhile(server: Server) -> None:
    """The main thread reads the LOAD (the compute thread is inside the long batch) and
    routes it to the loader, whose LOADED reaches the broker before the long batch ends."""
    answers: dict[str, object] = {}

    def call(name: str, model: str, first: float) -> None:
        with Client(server.frontend, timeout_s=30) as c:
            try:
                answers[name] = c.infer(model, {"input": np.full((1, 4), first, np.float32)})
            except InferError as exc:
                answers[name] = exc

    with Client(server.frontend, timeout_s=30) as c:   # warm: a prediction for the model
        for _ in range(3):
            c.infer("slow", {"input": np.ones((1, 4), np.float32)})
    assert state(server, "lazy") == "available"
    start = time.monotonic()
    threads = [threading.Thread(target=call, args=("long", "slow", 7.0))]
    threads[0].start()
    wait_for(lambda: inflight(server) == 1, 30, "the long batch to be running")
    threads.append(threading.Thread(target=call, args=("lazy", "lazy", 1.0)))
    threads[-1].start()
    wait_for(lambda: state(server, "lazy") == "ready", LONG_S, "the load while the batch runs")
    assert "long" not in answers and time.monotonic() - start < LONG_S, \
        "loaded only once the long batch was done"
    for t in threads:
        t.join(60)
    failed = {k: v for k, v in answers.items() if isinstance(v, InferError)}
    assert not failed and set(answers) == {"long", "lazy"}, failed
