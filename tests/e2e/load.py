"""Helpers for tests under load: steady request load from threads, and a model whose
run time the request chooses."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from tests.conftest import ZEROSERVE, linear_config, wait_for
from zeroserve.broker.client import Client, InferError


class Load:
    """``threads`` sync clients, each sending one request after the other."""

    def __init__(self, frontend: str, model: str, x: np.ndarray, threads: int = 16) -> None:
        self.outcomes: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(frontend, model, x))
                         for _ in range(threads)]

    def _run(self, frontend: str, model: str, x: np.ndarray) -> None:
        with Client(frontend, timeout_s=30) as c:
            while not self._stop.is_set():
                try:
                    c.infer(model, {"input": x})
                    what = "ok"
                except InferError as exc:
                    what = f"{exc.code.value}: {exc.message}"
                with self._lock:
                    self.outcomes.append(what)

    def __enter__(self) -> "Load":
        for t in self._threads:
            t.start()
        return self

    def ok(self) -> int:
        return self.outcomes.count("ok")

    def more(self, n: int, what: str, timeout_s: float = 30.0) -> None:
        """Wait until ``n`` more requests were answered."""
        target = len(self.outcomes) + n
        wait_for(lambda: len(self.outcomes) >= target, timeout_s, what)

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)
        assert not any(t.is_alive() for t in self._threads), "a request hung"

    def failures(self) -> list[str]:
        return [o for o in self.outcomes if o != "ok"]


def cli(*argv: str, timeout_s: float = 90.0) -> subprocess.CompletedProcess[str]:
    """``zeroserve ARGV`` as a real process."""
    return subprocess.run([*ZEROSERVE, *argv],
                          capture_output=True, text=True, timeout=timeout_s)


def worker_ids(control: str) -> list[str]:
    with Client(control, timeout_s=5) as c:
        return sorted(w["id"] for w in c.control("status")["workers"])


def worker(control: str, worker_id: str) -> dict[str, Any] | None:
    with Client(control, timeout_s=5) as c:
        return next((w for w in c.control("status")["workers"] if w["id"] == worker_id), None)


def write_spin_model(repo: Path, name: str = "spin") -> None:
    """A model that runs ``x[0, 0]`` rounds of a 256x256 matmul: the caller picks how long
    a batch takes (zeros, as in warm-up, cost nothing)."""
    import torch

    class Spin(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.eye(256) * 0.5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            n = int(x[0, 0].item())
            y = torch.ones(256, 256)
            for _ in range(n):
                y = torch.tanh(y @ self.w)
            return x + y.sum() * 0

    vdir = repo / name / "1"
    vdir.mkdir(parents=True, exist_ok=True)
    torch.jit.save(torch.jit.script(Spin().eval()), str(vdir / "model.pt"))
    (repo / name / "config.json").write_text(json.dumps(linear_config(name, 4, 4, mbs=1)))


def spin_input(rounds: int) -> np.ndarray:
    x = np.zeros((1, 4), np.float32)
    x[0, 0] = rounds
    return x


def elapsed_since(start: float) -> float:
    return time.monotonic() - start
