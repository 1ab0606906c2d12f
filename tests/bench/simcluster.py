"""A simulated cluster around the real broker objects: the :class:`Broker` (pool,
scheduler, request path, lifecycle, replica controller) runs unchanged on a simulated
clock; workers and clients are played here, speaking the real protocol frames but with
no sockets, no processes and no torch. A worker runs its batches one after another,
each taking ``a_s + c_s * samples``; a load takes ``load_s``.

Events are processed in time order; after each one the broker ticks, as the real loop
does after each poll, and the next tick is scheduled at ``Broker.next_due``.
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from tests.conftest import short_tmpdir
from zeroserve.broker import protocol as p
from zeroserve.broker.server.broker import Broker
from zeroserve.broker.tensors import from_numpy

MODEL_PY = "class Model:\n    def load(self, d, device):\n        pass\n"


def write_repo(configs: dict[str, dict[str, Any]]) -> Path:
    """A repository of python-handler models (never loaded: the workers are simulated)."""
    repo = short_tmpdir("zssim")
    for name, extra in configs.items():
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.py").write_text(MODEL_PY)
        cfg = {"name": name, "platform": "python", "max_batch_size": 16,
               "inputs": [{"name": "input", "datatype": "FP32", "shape": [4]}],
               "outputs": [{"name": "output", "datatype": "FP32", "shape": [1]}], **extra}
        (repo / name / "config.json").write_text(json.dumps(cfg))
    return repo


@dataclass
class SimWorker:
    identity: bytes
    worker_id: str
    a_s: float
    c_s: float
    footprint_bytes: int
    busy_until: float = 0.0
    batches: int = 0
    busy_s: float = 0.0
    waits: list[tuple[float, float]] = field(default_factory=list)  # (sent, held there)
    sizes: list[int] = field(default_factory=list)                  # of each batch


@dataclass
class Outcome:
    sent_s: float
    done_s: float = math.nan
    code: str = ""          # "" ok, else the error code


@dataclass(order=True)
class _Event:
    t: float
    seq: int
    run: Callable[[], None] | None = field(compare=False)


class SimCluster:
    def __init__(self, repo: Path, workers: int, *, a_s: float = 0.008, c_s: float = 0.0005,
                 load_s: float = 2.0, footprint_bytes: int = 1 << 30,
                 budget_bytes: int | list[int] = 0, credits: int = 2,
                 footprints: dict[str, int] | None = None, device: str = "sim") -> None:
        self.t = 0.0
        self.load_s = load_s
        self.footprints = footprints or {}
        self._heap: list[_Event] = []
        self._seq = itertools.count()
        self._next_tick = math.inf
        self.outcomes: dict[str, Outcome] = {}
        # (time, worker, model, when its last batch ends): an unload while a batch of
        # ours still runs there would lose it
        self.unloads: list[tuple[float, str, str, float]] = []
        self.broker = Broker(repo, to_client=self._to_client, to_worker=self._to_worker,
                             to_controller=lambda c, f: True, clock=lambda: self.t,
                             worker_expiry_s=1e9)  # simulated workers do not beat
        self.broker.load_catalog()
        self._out = [from_numpy("output", np.zeros((1, 1), np.float32))]
        self._x = [from_numpy("input", np.zeros((1, 4), np.float32))]
        self._ids = itertools.count(1)
        self.priority: Callable[[int], int] = lambda n: 0   # of the n-th request
        self.workers: dict[bytes, SimWorker] = {}
        budgets = budget_bytes if isinstance(budget_bytes, list) else [budget_bytes] * workers
        for i in range(workers):
            w = SimWorker(f"w{i}".encode(), f"sim/{i}", a_s, c_s, footprint_bytes)
            self.workers[w.identity] = w
            self.broker.on_backend(w.identity, p.encode(p.WorkerReady(
                w.worker_id, credits=credits, host="sim", device=device,
                memory_budget_bytes=budgets[i])))
        self._after(0.0)

    # -- the broker's sends -------------------------------------------------------
    def _to_worker(self, identity: bytes, frames: list[Any]) -> bool:
        kind, header, _ = p.unpack(frames)
        w = self.workers[identity]
        if kind is p.Kind.BATCH:
            self._run_batch(w, header)
        elif kind is p.Kind.LOAD:
            msg = p.decode(p.LoadModel, header)
            # a real worker times its warm-up batches (1 and 8 by default) and says so
            warm = {str(b): w.a_s + w.c_s * b for b in (1, 8)}
            done = p.ModelLoaded(msg.model, msg.version, True, sha256=msg.sha256,
                                 memory_bytes=self.footprints.get(msg.model,
                                                                  w.footprint_bytes),
                                 load_s=self.load_s, memory={"warmup_seconds": warm})
            self.at(self.t + self.load_s,
                    lambda: self.broker.on_backend(identity, p.encode(done)))
        elif kind is p.Kind.UNLOAD:
            self.unloads.append((self.t, w.worker_id, header["model"], w.busy_until))
        return True   # heartbeats, log settings: nothing to play

    def _run_batch(self, w: SimWorker, header: dict[str, Any]) -> None:
        items = header["items"]
        run_s = w.a_s + w.c_s * len(items)
        start = max(self.t, w.busy_until)
        w.waits.append((self.t, start - self.t))
        w.sizes.append(len(items))
        w.busy_until = start + run_s
        w.batches += 1
        w.busy_s += run_s
        result = p.BatchResult(header["id"], [
            p.InferReply(it[0], header["model"], header["version"], self._out)
            for it in items], compute_ms=run_s * 1000.0)
        frames = p.encode_result(result)
        self.at(w.busy_until, lambda: self.broker.on_backend(w.identity, frames))

    def _to_client(self, client: bytes, frames: list[Any]) -> bool:
        kind, header, _ = p.unpack(frames)
        rid = header.get("id") or header.get("request_id")
        out = self.outcomes.get(str(rid))
        if out is not None and math.isnan(out.done_s):
            out.done_s = self.t
            if kind is not p.Kind.REPLY:
                out.code = p.decode_error(header).code.value
        return True

    # -- clients ------------------------------------------------------------------
    def request(self, model: str, timeout_ms: float = 0.0) -> None:
        n = next(self._ids)
        rid = str(n)
        self.outcomes[rid] = Outcome(self.t)
        self.broker.on_frontend(b"client", p.encode_request(
            p.InferRequest(rid, model, self._x, timeout_ms=timeout_ms,
                           priority=self.priority(n))))

    # -- time -----------------------------------------------------------------------
    def at(self, t: float, run: Callable[[], None] | None) -> None:
        heapq.heappush(self._heap, _Event(t, next(self._seq), run))

    def _after(self, now: float) -> None:
        """The broker's tick after an event, and its next wake-up."""
        self.broker.tick(now)
        due = max(self.broker.next_due(now), now + 1e-4)
        if due < self._next_tick:
            self._next_tick = due
            self.at(due, None)

    def run(self, until_s: float, arrivals: np.ndarray, model: str, timeout_ms: float,
            every_s: float = 0.0, probe: Callable[[float], None] | None = None) -> None:
        """Deliver ``arrivals`` (sorted times) and every event up to ``until_s``;
        ``probe(now)`` runs every ``every_s``."""
        i, n = 0, len(arrivals)
        next_probe = self.t if probe is not None else math.inf
        while True:
            ta = arrivals[i] if i < n else math.inf
            th = self._heap[0].t if self._heap else math.inf
            t = min(ta, th, next_probe)
            if t > until_s:
                break
            self.t = t
            if t == next_probe and probe is not None:
                probe(t)
                next_probe += every_s
                continue
            if ta <= th:
                # arrivals at the same instant come as one message (a client's bundle):
                # the broker ticks once after all of them, as the real loop does
                while i < n and arrivals[i] == ta:
                    i += 1
                    self.request(model, timeout_ms)
            else:
                ev = heapq.heappop(self._heap)
                if ev.run is None:
                    if ev.t >= self._next_tick:
                        self._next_tick = math.inf
                else:
                    ev.run()
            self._after(t)
        self.t = until_s

    def close(self, repo: Path) -> None:
        self.broker.close()
        shutil.rmtree(repo, ignore_errors=True)
