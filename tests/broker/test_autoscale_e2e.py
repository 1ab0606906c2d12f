"""Replica autoscaling with real processes: ``zeroserve serve`` with three workers and a
model with ``instances`` min 1, max 2 whose batches take 20 ms. Closed-loop load from
eight client threads queues far past its 30 ms queue-time SLO on one replica, so a
second replica is loaded; once the load stops, utilization stays low and the broker
drains one replica and unloads it. Every request gets its answer."""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest

from tests.conftest import Server, linear_config, short_tmpdir, wait_for
from tests.e2e.load import cli
from zeroserve.broker.admin import human
from zeroserve.broker.client import Client

pytestmark = pytest.mark.timeout(150)

SLOW = '''
import time


class Model:
    def load(self, version_dir, device):
        pass

    def predict(self, inputs):
        time.sleep(0.02)  # noqa: sleep-ok (a model with a known service time)
        return {"output": inputs["input"] * 2}
'''


@pytest.fixture
def repo() -> Iterator[Path]:
    folder = short_tmpdir("zsrepo")
    (folder / "slow" / "1").mkdir(parents=True)
    (folder / "slow" / "1" / "model.py").write_text(SLOW)
    cfg = {**linear_config("slow", n_out=4, mbs=1), "platform": "python",
           "instances": {"min": 1, "max": 2},
           "autoscaling": {"queue_slo_ms": 30, "window_s": 1, "down_window_s": 2,
                           "up_cooldown_s": 1, "down_cooldown_s": 2}}
    (folder / "slow" / "config.json").write_text(json.dumps(cfg))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def status(srv: Server) -> dict[str, Any]:
    with Client(srv.control, timeout_s=5) as c:
        return c.control("status")  # type: ignore[no-any-return]


def replicas(srv: Server) -> list[str]:
    return status(srv)["autoscaling"]["slow"]["replicas"]  # type: ignore[no-any-return]


class Load:
    """Closed-loop requests from a few threads, each with its own client, until stopped."""

    def __init__(self, endpoint: str, threads: int) -> None:
        self.stop = threading.Event()
        self.ok = 0
        self.errors: list[str] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(endpoint,), daemon=True)
                        for _ in range(threads)]
        for t in self.threads:
            t.start()

    def _run(self, endpoint: str) -> None:
        x = np.ones((1, 4), np.float32)
        with Client(endpoint, timeout_s=30) as c:
            while not self.stop.is_set():
                try:
                    out = c.infer("slow", {"input": x}).outputs["output"]
                    assert float(out[0, 0]) == 2.0
                    with self.lock:
                        self.ok += 1
                except Exception as exc:  # every failure is the test's failure
                    with self.lock:
                        self.errors.append(repr(exc))

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)


def test_scales_up_under_load_and_back_down_after(serve: Callable[..., Server],
                                                  repo: Path) -> None:
    srv = serve(repo, workers=3)
    first = wait_for(lambda: replicas(srv), 60, "the first replica")
    assert len(first) == 1
    holders = [w for w in status(srv)["workers"] if any(m.startswith("slow/")
                                                         for m in w["models"])]
    assert [w["id"] for w in holders] == first   # only the chosen worker loaded it

    load = Load(srv.frontend, threads=8)
    try:
        wait_for(lambda: len(replicas(srv)) == 2, 60, "a second replica under load")
        scaled = status(srv)["autoscaling"]["slow"]
        ups = [d for d in scaled["decisions"] if d["action"] == "up"]
        assert ups and ups[-1]["reason"] == "queue_time", scaled
        before = load.ok
        wait_for(lambda: load.ok > before + 20, 30, "requests served on two replicas")
        assert len(replicas(srv)) == 2   # at max: it holds there under load
    finally:
        load.finish()
    assert load.errors == []

    wait_for(lambda: len(replicas(srv)) == 1, 60, "back to one replica after the load")
    st = status(srv)
    downs = [d for d in st["autoscaling"]["slow"]["decisions"] if d["action"] == "down"]
    assert downs and downs[-1]["reason"] == "low_utilization"
    wait_for(lambda: sum(any(m.startswith("slow/") for m in w["models"])
                         for w in status(srv)["workers"]) == 1, 30,
             "the drained replica unloaded")
    text = human("status", status(srv))
    assert "autoscale slow: 1 replica(s) [1..2]" in text, text
    with Client(srv.control, timeout_s=5) as c:
        metrics = c.control("metrics")["broker"]
    assert 'zeroserve_autoscale_decisions_total{action="up",model="slow",' \
           'reason="queue_time"}' in metrics
    assert 'zeroserve_model_replicas{model="slow"} 1.0' in metrics
    log = srv.log()
    assert "scale up to 2 replica(s) (queue_time)" in log
    assert "scale down to 1 replica(s) (low_utilization)" in log
    out = cli("status", "--runtime-dir", str(srv.runtime))
    assert "autoscale slow:" in out.stdout, out.stdout + out.stderr
    assert os.path.isdir(srv.runtime)
