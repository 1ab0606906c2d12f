"""Mixed lengths under faults, with real processes: a padded and a shape-only BERT
(``transformers``, random weights) on 2 workers, direct clients sending mixed lengths at
once, and a worker SIGKILLed twice mid-batch. The broker's pid never changes, every
request gets exactly one answer, every answer that succeeds equals the model run
in-process on that request alone, and nothing of any request remains in the broker."""

from __future__ import annotations

import os
import shutil
import signal
import threading
import warnings
from collections import Counter
from typing import Any, Iterator

import numpy as np
import pytest

from tests import bert
from tests.conftest import Server, short_tmpdir, wait_for
from zeroserve.broker.client import Client, InferError

pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(300)

LENGTHS = (3, 9, 17, 30)


@pytest.fixture(scope="module")
def module() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return bert.model()


@pytest.fixture
def srv(module: Any) -> Iterator[Server]:
    repo = short_tmpdir("zsbertf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bert.write(repo, "plain", module, max_queue_delay_ms=5)
        bert.write(repo, "padded", module, padding={**bert.PADDING, "buckets": [8, 32]},
                   max_queue_delay_ms=5)
    server = Server(repo, workers=2)
    try:
        yield server.wait_ready(180)
    finally:
        server.stop()
        shutil.rmtree(repo, ignore_errors=True)


class Load:
    """Threads of direct clients, each sending mixed lengths to both models; every
    answer is counted once, and a success is checked against the model in-process."""

    def __init__(self, srv: Server, module: Any, threads: int = 8) -> None:
        self.srv, self.module = srv, module
        self.sent = 0
        self.outcomes: Counter[str] = Counter()
        self.wrong: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(threads)]

    def __enter__(self) -> "Load":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)
        assert not any(t.is_alive() for t in self._threads), "a request hung"

    def answered(self) -> int:
        with self._lock:
            return sum(self.outcomes.values())

    def _run(self, i: int) -> None:
        rng = np.random.default_rng(i)
        with Client(self.srv.frontend, timeout_s=60) as c:
            k = 0
            while not self._stop.is_set():
                req = bert.inputs(LENGTHS[(k + i) % len(LENGTHS)], bert.SMALL["vocab_size"], rng)
                model = ("plain", "padded")[k % 2]
                k += 1
                with self._lock:
                    self.sent += 1
                try:
                    out = c.infer(model, req, timeout_ms=30000)
                except InferError as exc:
                    with self._lock:
                        self.outcomes[exc.code.value] += 1
                    continue
                hidden, pooled = bert.expected(self.module, req["input_ids"],
                                               req["attention_mask"])
                ok = out.outputs["last_hidden_state"].shape == hidden.shape and np.allclose(
                    out.outputs["last_hidden_state"], hidden, atol=1e-4) and np.allclose(
                    out.outputs["pooler_output"], pooled, atol=1e-4)
                with self._lock:
                    self.outcomes["ok"] += 1
                    if not ok:
                        self.wrong.append(f"{model} length {req['input_ids'].shape[1]}")


def holders(srv: Server) -> int:
    """Workers that hold both models (the broker's view)."""
    with Client(srv.control, timeout_s=5) as c:
        return len([w for w in c.control("status")["workers"] if len(w["models"]) == 2])


def test_mixed_lengths_survive_worker_kills(srv: Server, module: Any) -> None:
    broker = srv.pids("broker")
    wait_for(lambda: holders(srv) == 2, 120, "both workers to hold both models")
    with Load(srv, module) as load:
        wait_for(lambda: load.answered() >= 60, 120, "mixed-length traffic to flow")
        for _ in range(2):
            victim = srv.pids("worker")[0]
            os.kill(victim, signal.SIGKILL)
            seen = load.answered()
            wait_for(lambda: load.answered() >= seen + 40, 120, "traffic after a SIGKILL")
            # the broker's view: a killed worker leaves the process table before the
            # broker has noticed, and killing the other one then leaves none
            wait_for(lambda: holders(srv) == 2, 120, "the killed worker back")
    assert srv.pids("broker") == broker, "the broker restarted"
    assert load.answered() == load.sent, "a request got no answer"
    assert not load.wrong, load.wrong[:5]
    assert load.outcomes["ok"] >= 0.9 * load.sent, load.outcomes
    assert set(load.outcomes) <= {"ok", "worker_lost", "no_worker"}, load.outcomes
    with Client(srv.control, timeout_s=10) as c:
        census = c.control("census")
    assert census and not any(census.values()), census
