"""The broker without sockets, for in-process tests: the outboxes are lists, the clock
a number, and models enter through the broker's public seam (``Broker.add_model``)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from tests.conftest import write_model
from zeroserve.broker import protocol as p
from zeroserve.broker.server.admission import Admission
from zeroserve.broker.server.answering import Answering
from zeroserve.broker.server.breaker import BreakerOptions, Breakers
from zeroserve.broker.server.broker import Broker
from zeroserve.broker.server.cache import ResponseCache
from zeroserve.broker.server.cachepath import CachedAnswers
from zeroserve.broker.server.catalog import Catalog
from zeroserve.broker.server.dispatch import Dispatch
from zeroserve.broker.server.dispatchgate import DispatchGate
from zeroserve.broker.server.forecast import Forecast, Usage
from zeroserve.broker.server.intake import Intake
from zeroserve.broker.server.latency import LatencyBook
from zeroserve.broker.server.ledger import AnswerLedger
from zeroserve.broker.server.metrics import BrokerMetrics
from zeroserve.broker.server.pipeline import INTERNAL, Pipelines
from zeroserve.broker.server.pool import WorkerPool
from zeroserve.broker.server.results import Results
from zeroserve.broker.server.scheduler import Scheduler
from zeroserve.broker.server.stats import ModelStatistics
from zeroserve.broker.server.stopping import StopState
from zeroserve.broker.server.streampath import StreamPath
from zeroserve.broker.server.streams import Streams
from zeroserve.broker.server.tenancy import Tenancy
from zeroserve.broker.server.types import Send
from zeroserve.models.repository import RepoModel, parse_config, version_sha256

Outbox = list[tuple[bytes, list[Any]]]


class BrokerRig:
    def __init__(self, repo: Path, **broker: Any) -> None:
        self.now = 0.0
        self.repo = repo
        self.to_workers: Outbox = []
        self.to_clients: Outbox = []
        self.to_controllers: Outbox = []
        broker.setdefault("latency_model", False)
        self.b = Broker(repo, to_client=self._out(self.to_clients),
                        to_worker=self._out(self.to_workers),
                        to_controller=self._out(self.to_controllers),
                        clock=lambda: self.now, **broker)
        self._rids = 0

    @property
    def placement(self) -> Any:
        return self.b.placement

    @staticmethod
    def _out(box: Outbox) -> Callable[[bytes, list[Any]], bool]:
        def send(identity: bytes, frames: list[Any]) -> bool:
            box.append((identity, [bytes(f) for f in frames]))
            return True
        return send

    # -- models and workers -------------------------------------------------------
    def add_model(self, name: str, config: dict[str, Any], versions: tuple[int, ...] = (1,),
                  ready: Iterable[int] = (), factory: str | None = None) -> None:
        """Serve ``name`` as committed; with ``factory``, its version files are written
        first (and hashed, as the repository's would be)."""
        for v in versions if factory is not None else ():
            write_model(self.repo, name, v, factory)
        shas = {v: version_sha256(self.repo / name / str(v)) for v in versions
                if (self.repo / name / str(v)).is_dir()}
        rm = RepoModel(parse_config(config, "test"), self.repo / name, versions)
        self.b.add_model(rm, shas, ready)

    def worker(self, wid: str, device: str = "", budget: int = 0,
               models: list[list[Any]] | None = None, credits: int = 1,
               **memory: Any) -> Any:
        """A worker registers (READY), as a real one would; returns its state."""
        ready = p.WorkerReady(wid, credits, device=device, memory_budget_bytes=budget,
                              models=models or [],
                              memory={"device": device, **memory} if memory or device
                              else {})
        self.b.worker_ready(wid.encode(), ready, self.now)
        return self.b.pool.get(wid.encode())

    def from_worker(self, wid: str, msg: Any) -> None:
        frames = p.encode_result(msg) if isinstance(msg, p.BatchResult) else p.encode(msg)
        self.b.on_backend(wid.encode(), [bytes(f) for f in frames])

    def loaded(self, wid: str, name: str, version: int, **plan: Any) -> None:
        """The worker's LOADED for ``name/version``, with the repository's sha256."""
        sha = self.b.catalog.shas[name][version]
        self.from_worker(wid, p.ModelLoaded(name, version, True, sha256=sha,
                                            memory_bytes=plan.get("resident_bytes", 0),
                                            memory=plan))

    # -- clients and time -----------------------------------------------------------
    def request(self, client: bytes = b"gw", model: str = "m", shape: tuple[int, ...] = (1, 4)
                ) -> None:
        self._rids += 1
        req = p.InferRequest(str(self._rids), model,
                             [p.from_numpy("input", np.ones(shape, np.float32))])
        self.b.on_frontend(client, [bytes(f) for f in p.encode_request(req)])

    def tick(self, dt: float = 0.0) -> None:
        self.now += dt
        self.b.tick(self.now)

    # -- what was sent ---------------------------------------------------------------
    def sent(self, kind: p.Kind) -> list[tuple[bytes, dict[str, Any], Any]]:
        out = []
        for identity, frames in self.to_workers:
            k, header, bufs = p.unpack(frames)
            if k is kind:
                out.append((identity, header, p.decode_batch(header, bufs)
                            if k is p.Kind.BATCH else p.decode(p.Disconnect, header)
                            if k is p.Kind.DISCONNECT else None))
        return out

    def loads(self, wid: str) -> list[str]:
        return [f"{h['model']}/{h['version']}" for identity, h, _ in self.sent(p.Kind.LOAD)
                if identity == wid.encode()]

    def run_batches(self, wid: str) -> None:
        """Answer each batch the worker got, one at a time, until none comes."""
        answered: set[int] = set()
        while True:
            todo = [b for _, _, b in self.sent(p.Kind.BATCH) if b.batch_id not in answered]
            if not todo:
                return
            for batch in todo:
                answered.add(batch.batch_id)
                self.from_worker(wid, p.BatchResult(batch.batch_id, [
                    p.InferReply(i.request_id, batch.model, batch.version, i.tensors)
                    for i in batch.items], 1.0))
                self.tick(0.1)

    def live(self, wid: str, seconds: int) -> None:
        """Time passes, the worker heartbeating."""
        for _ in range(seconds):
            self.from_worker(wid, p.WorkerHeartbeat({}, ""))
            self.tick(1.0)

    def answers(self) -> list[str]:
        kinds = [p.unpack(frames)[0] for _, frames in self.to_clients]
        return ["ok" if k is p.Kind.REPLY else "error" for k in kinds
                if k in (p.Kind.REPLY, p.Kind.ERROR)]

    def disconnects(self) -> list[str]:
        return [msg.reason.value for _, _, msg in self.sent(p.Kind.DISCONNECT)]


class RequestPath:
    """The request path's parts wired as the broker's composition root wires them
    (broker.py ``_compose``), without the model lifecycle and load on demand: for tests
    of the path alone, with the pool, scheduler and catalog the test made."""

    def __init__(self, catalog: Catalog, scheduler: Scheduler, pool: WorkerPool,
                 latency: LatencyBook, metrics: BrokerMetrics, reply: Send,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.metrics = metrics
        self.scheduler = scheduler
        self.pool = pool
        batches = pool.batches   # the test's pool made its own
        self.tenancy = tenancy = Tenancy(None, metrics.registry, lambda: 0.0)
        stop = StopState()
        stop.client_draining(INTERNAL)
        stats = ModelStatistics()
        self.streams = streams = Streams()
        forecast = Forecast(pool, batches, latency)
        gate = DispatchGate()
        breakers = Breakers(BreakerOptions(error_rate=0.0))
        answers = CachedAnswers(ResponseCache(0), catalog, stats, metrics)
        self.ledger = ledger = AnswerLedger((streams.forget, tenancy.release))
        self.pipelines = pipelines = Pipelines(catalog, ledger, stats, metrics, reply, clock)
        self.answering = answering = Answering(catalog, scheduler, pool, batches, latency,
                                               ledger, streams, tenancy, stats, metrics,
                                               pipelines.reply, clock)
        self.streaming = StreamPath(streams, batches, catalog, metrics, stats, ledger,
                                    pipelines.reply, answering)
        admission = Admission(catalog, scheduler, pool, latency, tenancy, stop, gate,
                              forecast, answers)
        self.intake = Intake(catalog, scheduler, ledger, stop, breakers, admission, answers,
                             pipelines, streams, self.streaming, answering, tenancy,
                             pipelines.reply, clock)
        self.results = Results(catalog, pool, batches, ledger, answering, self.streaming, answers,
                               latency, forecast, breakers, None, stats, metrics,
                               pipelines.reply)
        self.dispatcher = Dispatch(catalog, scheduler, pool, batches, latency, gate, forecast,
                                   Usage(), answering, streams, self.streaming, tenancy, metrics)
        self.on_request = self.intake.on_request
        self.on_cancel = self.intake.on_cancel
        self.client_gone = self.intake.client_gone
        self.on_result = self.results.on_result
        self.overdue = self.results.overdue
        self.move_stalled = self.results.move_stalled
        self.worker_lost = answering.worker_lost
        self.fail_everything = answering.fail_everything
        self.dispatch = self.dispatcher.dispatch
        self.expire = self.dispatcher.expire
        self.next_due = self.dispatcher.next_due

    def open_count(self) -> int:
        return len(self.ledger)

    def census(self) -> dict[str, int]:
        """As the broker's census verb counts it."""
        return {**self.scheduler.census(), **self.ledger.census(), **self.pool.census(),
                "tenancy.open": self.tenancy.open_count(), **self.pipelines.census(),
                **{f"streams.{k}": n for k, n in self.streams.sizes().items()}}
