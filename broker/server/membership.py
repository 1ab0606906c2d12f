"""The workers' side of the broker: the backend socket's messages handed to their parts
(results, streams, loads, heartbeats), and membership: a worker registering once per
process, leaving (drained, or at once), lost (crashed, silent, hung), and released
once drained."""

from __future__ import annotations

import logging
import math
from typing import Any, Callable

from zeroserve.broker import protocol as p
from zeroserve.broker.server.answering import Answering
from zeroserve.broker.server.forecast import Forecast
from zeroserve.broker.server.ledger import AnswerLedger
from zeroserve.broker.server.lifecycle import Lifecycle
from zeroserve.broker.server.loads import WorkerLoads
from zeroserve.broker.server.metrics import BrokerMetrics
from zeroserve.broker.server.ondemand import OnDemand
from zeroserve.broker.server.pool import Batches, Loss, WorkerPool, WorkerState
from zeroserve.broker.server.replicas import Replicas
from zeroserve.broker.server.results import Results
from zeroserve.broker.server.stopping import StopState
from zeroserve.broker.server.streampath import StreamPath

logger = logging.getLogger(__name__)


class Membership:
    def __init__(self, pool: WorkerPool, batches: Batches, limits: p.Limits, results: Results,
                 streaming: StreamPath, lifecycle: Lifecycle, loads: WorkerLoads,
                 ondemand: OnDemand,
                 replicas: Replicas, answering: Answering, forecast: Forecast,
                 ledger: AnswerLedger, stop: StopState, metrics: BrokerMetrics,
                 clock: Callable[[], float]) -> None:
        self.pool = pool
        self.batches = batches
        self.limits = limits
        self.results = results
        self.streaming = streaming
        self.lifecycle = lifecycle
        self.loads = loads
        self.ondemand = ondemand
        self.replicas = replicas
        self.answering = answering
        self.forecast = forecast
        self.ledger = ledger
        self.stop = stop
        self.metrics = metrics
        self.clock = clock
        self._left_s: dict[bytes, float] = {}      # when a worker said it shuts down

    def on_backend(self, identity: bytes, frames: list[Any]) -> None:
        kind, header, bufs = p.unpack(frames, self.limits)
        now = self.clock()
        if kind is p.Kind.READY:
            self.worker_ready(identity, p.decode(p.WorkerReady, header), now)
            return
        worker = self.pool.get(identity)
        if worker is None:
            # a worker we do not know (we restarted, or removed it): it registers again
            self.pool.disconnect(identity, p.DisconnectReason.UNKNOWN_WORKER)
            return
        self.pool.heard(worker, now)
        if kind is p.Kind.RESULT:
            self.results.on_result(worker, header, bufs, now)
        elif kind is p.Kind.PARTIAL:
            self.streaming.on_partial(worker, header, bufs, now)
        elif kind is p.Kind.STEPS:
            self.streaming.on_steps(worker, header, bufs, now)
        elif kind is p.Kind.HEARTBEAT:
            self.pool.beat(worker, p.decode(p.WorkerHeartbeat, header))
        elif kind is p.Kind.LOADED:
            loaded = p.decode(p.ModelLoaded, header)
            self.lifecycle.on_loaded(worker, loaded)
            self.results.warmed_up(worker, loaded)
            self.ondemand.settle(now)
        elif kind is p.Kind.LEAVE:
            self._on_leave(worker, p.decode(p.Leave, header))
        elif kind is p.Kind.WAITING:   # its freed credit is used by this round's dispatch
            self.batches.waits(worker, p.decode(p.Waiting, header).batch_id)
        else:
            raise p.ProtocolError(f"unexpected kind {kind.name} on the backend")

    def worker_ready(self, identity: bytes, ready: p.WorkerReady, now: float) -> None:
        """A worker registers. Once per process: a READY from a process already registered
        (it answered an "unknown worker" to a message sent before its first READY was
        read) changes nothing, where it used to re-queue what had just been sent to it.
        A worker id is one process's: another live process's claim to it is refused,
        naming both, and never takes it over."""
        old = self.pool.get(identity)
        if old is not None:
            if (old.info.get("pid"), old.info.get("host")) == (ready.pid, ready.host):
                return
            self.lose(old, Loss.REREGISTERED)   # its connection taken over by a new process
        twin = self.pool.by_id(ready.worker_id) if ready.worker_id else None
        if twin is not None and self.pool.alive(twin, now):
            detail = (f"worker id {ready.worker_id!r} is held by pid {twin.info.get('pid')} "
                      f"on {twin.info.get('host') or '?'}; pid {ready.pid} on "
                      f"{ready.host or '?'} was refused (give each worker its own --index "
                      "or --worker-id)")
            logger.error("%s", detail)
            self.metrics.bad_message("backend", "duplicate_worker_id")
            self.pool.disconnect(identity, p.DisconnectReason.DUPLICATE_ID, detail=detail)
            return
        if twin is not None:   # silent past its expiry: its successor takes its place
            self.lose(twin, Loss.REREGISTERED)
        worker = self.pool.register(identity, ready, now)
        self.metrics.worker_registered(worker.worker_id)
        self.replicas.adopt(worker)
        self.ondemand.adopt(worker)
        self.loads.sync_worker(worker)
        self.metrics.workers_alive(len(self.pool.workers))

    def _on_leave(self, worker: WorkerState, msg: p.Leave) -> None:
        logger.info("worker %s leaves: %s %s", worker.worker_id, msg.reason.value, msg.detail)
        if not msg.drain:
            self.lose(worker, Loss.LEFT)
            return
        recycle = msg.reason is p.LeaveReason.RECYCLE
        if recycle:
            self.metrics.worker_recycled(worker.worker_id)
        self.pool.leave(worker, recycle=recycle)
        if self.stop.stopping and not recycle:
            # the whole server stops: keep it until what we accepted is answered
            self.pool.keep(worker)
            logger.info("worker %s kept until the broker's queue is done", worker.worker_id)
        elif not recycle:
            self._left_s[worker.identity] = self.clock()

    def worker_connection_closed(self, identity: bytes) -> None:
        worker = self.pool.get(identity)
        if worker is not None:
            self.lose(worker, Loss.CRASHED)

    def lose(self, worker: WorkerState, loss: Loss) -> None:
        self._left_s.pop(worker.identity, None)
        lost = self.pool.remove(worker, loss)
        self.metrics.worker_lost(worker.worker_id, loss.name.lower())
        self.answering.worker_lost(lost, loss, worker.worker_id, self.clock())
        self.forecast.worker_gone(worker.worker_id)
        self.lifecycle.worker_removed(worker.worker_id, worker.identity)
        self.ondemand.worker_lost(worker)
        self.metrics.workers_alive(len(self.pool.workers))

    def release_drained(self, now: float) -> None:
        """Leaving workers with nothing in flight go, except those a stopping broker keeps
        (they leave when it exits). One that left on SIGTERM waits a heartbeat first: the
        same signal may be on its way to us (a process group, a systemd target), and then
        it stays to run our queue instead of leaving it stranded."""
        for worker in self.pool.drained():
            if self.stop.stopping and not worker.draining and len(self.ledger):
                continue
            if not self.stop.stopping and now < self._left_s.get(worker.identity, -math.inf) \
                    + self.pool.heartbeat_s:
                continue
            self._left_s.pop(worker.identity, None)
            self.pool.release(worker)
            self.forecast.worker_gone(worker.worker_id)
            self.lifecycle.worker_removed(worker.worker_id, worker.identity)
            self.metrics.workers_alive(len(self.pool.workers))


    def hung(self, now: float) -> None:
        """Batches past max_execution_ms fail; their workers are hung and restart."""
        for identity in self.results.overdue(now):
            worker = self.pool.get(identity)
            if worker is not None:
                logger.error("worker %s hung past max_execution_ms; restarting it",
                             worker.worker_id)
                self.pool.disconnect(identity, p.DisconnectReason.HUNG, restart=True)
                self.lose(worker, Loss.HUNG)

    def heartbeat(self, now: float) -> None:
        for worker in self.pool.heartbeat(now):
            self.lose(worker, Loss.SILENT)
