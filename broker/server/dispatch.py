"""The request path's dispatch: queued requests taken as batches and sent to the workers
that hold their model, when the dispatch gate (dispatchgate.py) says a worker may take
more; and the queue's time: deadlines passed while queued, and when next to look."""

from __future__ import annotations

import math
from functools import partial
from typing import Iterator


from zeroserve.broker import protocol as p, tracing
from zeroserve.broker.server import preemption
from zeroserve.broker.server.answering import Answering
from zeroserve.broker.server.catalog import Catalog, CatalogModel
from zeroserve.broker.server.dispatchgate import DispatchGate
from zeroserve.broker.server.forecast import Forecast, Usage
from zeroserve.broker.server.latency import LatencyBook
from zeroserve.broker.server.metrics import BrokerMetrics
from zeroserve.broker.server.pool import Batches, Loss, WorkerPool, WorkerState
from zeroserve.broker.server.scheduler import Entry, Scheduler
from zeroserve.broker.server.streampath import StreamPath
from zeroserve.broker.server.streams import NOT_PAUSED, Streams
from zeroserve.broker.server.tenancy import Tenancy
from zeroserve.broker.server.tokenfill import Predict
from zeroserve.broker.server.types import earliest


class Dispatch:
    def __init__(self, catalog: Catalog, scheduler: Scheduler, pool: WorkerPool,
                 batches: Batches, latency: LatencyBook, gate: DispatchGate,
                 forecast: Forecast, usage: Usage, answering: Answering, streams: Streams,
                 streaming: StreamPath, tenancy: Tenancy, metrics: BrokerMetrics) -> None:
        self.catalog = catalog
        self.scheduler = scheduler
        self.pool = pool
        self.batches = batches
        self.latency = latency
        self.gate = gate
        self.forecast = forecast
        self.usage = usage
        self.answering = answering
        self.streams = streams
        self.streaming = streaming
        self.tenancy = tenancy
        self.metrics = metrics
        self._looked_s = -math.inf   # when dispatch last looked at every waiting model

    def expire(self, now: float) -> None:
        for entry in self.scheduler.expire(now):
            self.answering.answer_error(entry, p.ErrorCode.DEADLINE,
                                        "deadline exceeded while queued")
        if self.streams:
            self.streaming.expire_streams(now)

    def dispatch(self, now: float) -> None:
        self._looked_s = now
        for name in self.scheduler.models_waiting():
            model = self.catalog.get(name)
            if model is not None:
                self._dispatch_model(model, now)

    def _dispatch_model(self, model: CatalogModel, now: float) -> None:
        name = model.config.name
        # after a take the queue is often empty (one request a message): nothing to ask
        # the workers, the gate or the latency model for
        while self.scheduler.depth(name):
            if model.config.max_sequences:
                # an iterative model's requests join the sequences running on a worker at
                # its next step: as many as it has free slots, whatever else it runs
                worker, free = self.pool.sequence_holder(name, model.config.max_sequences)
                if worker is None:
                    if not self._preempt(model, now):
                        return
                elif not self._take(worker, model, now, now, free):
                    return
                continue
            worker = self.pool.free_holder(name)
            if worker is None:
                return
            predict = self.latency.predictor(name, worker.worker_id)
            busy = bool(worker.inflight)
            queued = self.scheduler.queued_samples(name)
            if busy and not self.gate.may_send(name, now, busy, worker.on_cpu,
                                               partial(self.forecast.work_s, worker), queued,
                                               model.config.max_batch_size):
                return  # its result frees it
            half = self.gate.split(name, now, busy, worker.free, queued,
                                   self.scheduler.queued_units(name) / max(queued, 1), predict)
            if not self._take(worker, model, now, self.forecast.busy_until(worker, now), half,
                              predict=predict):
                return

    def _preempt(self, model: CatalogModel, now: float) -> bool:
        """Every slot is held: the highest priority waiting takes the slot of a running
        sequence of a lower one, which pauses (broker/server/preemption.py); False if
        none may. Not the dispatch order's head, which may be a request that aging lifted
        over it: that one waits for a free slot, and took a VIP's preemption with it."""
        name = model.config.name
        head = self.scheduler.strongest(name, now)
        if head is None:
            return False
        version = head.version if head.version is not None else model.default_version
        chosen = preemption.victim(head, self._running(name, version))
        if chosen is None or not self.batches.stop(chosen.worker.identity, chosen.batch_id,
                                                   [chosen.item], pause=True):
            return False
        self.streams.pause(chosen.entry.key, head.key)
        # a paused join sends nothing for a while: its next response bounds it again
        self.batches.progressed(chosen.batch_id, now, math.inf)
        self.metrics.preempted(name, chosen.entry.tenant)
        return self._take(chosen.worker, model, now, now, 1, only=head)

    def _running(self, name: str, version: int) -> Iterator[preemption.Running]:
        """The sequences of a model running (not paused) on the workers that may pause
        them."""
        for w in self.pool.holders(name, version):
            if w.draining or w.stalled or not self.pool.speaks(w, p.PAUSE_VERSION):
                continue
            for b in w.sequences:
                rec = self.batches.inflight[b]
                if rec.model != name:
                    continue
                for item, entry in rec.entries.items():
                    state = self.streams.get(entry.key)
                    if state is not None and state.paused == NOT_PAUSED:
                        yield preemption.Running(w, b, item, entry)

    def _take(self, worker: WorkerState, model: CatalogModel, now: float, start_s: float,
              max_samples: int | None, only: Entry | None = None,
              predict: Predict | None = None) -> bool:
        """A batch for ``worker`` taken from the queue (``only``: of that entry) and sent;
        False when the queue has none for it now. ``predict``: the worker's latency model,
        when already looked up."""
        name = model.config.name
        held, default = worker.versions_of(name), model.default_version

        def resolve(e: Entry, held: set[int] = held, default: int = default) -> int | None:
            if only is not None and e is not only:
                return None
            v = e.version if e.version is not None else default
            return v if v in held else None

        decision = self.scheduler.take(name, now, predict or self.latency.predictor(
            name, worker.worker_id), resolve, start_s=start_s, max_samples=max_samples,
            mixed=self.gate.mixed(name, now))
        if decision is None:
            return False
        for entry in decision.doomed:
            self.answering.answer_error(entry, p.ErrorCode.DEADLINE,
                              "deadline cannot be met: the work ahead of this request "
                              "takes longer than its remaining time")
        if not decision.entries:
            return bool(decision.doomed)
        self._send_batch(worker, model, decision.entries, decision.reason, now,
                         decision.tokens, decision.padded_tokens)
        return True

    def _send_batch(self, worker: WorkerState, model: CatalogModel, entries: list[Entry],
                    reason: str, now: float, tokens: int = 0, padded_tokens: int = 0
                    ) -> None:
        version = entries[0].version
        assert version is not None
        items = [p.BatchItem(str(i), e.payload.request.tensors, e.payload.request.outputs)
                 for i, e in enumerate(entries)]  # open entries: their requests are held
        exec_s = model.config.dynamic_batching.max_execution_ms / 1000.0
        rec = self.batches.send_batch(worker, model.config.name, version, entries, items, reason,
                                   now, exec_s, model.config.decoupled,
                                   _batch_trace(entries, now),
                                   _callers(entries, now) if model.config.platform == "python"
                                   else None, sequences=model.config.max_sequences > 0)
        if rec is None:
            self.answering.worker_lost(self.pool.remove(worker, Loss.UNREACHABLE), Loss.UNREACHABLE,
                             worker.worker_id, now)
            self.answering.requeue(entries, f"worker {worker.worker_id} is unreachable", now)
            return
        self.usage.used(model.config.name, now)
        if rec.stream:
            self.streaming.streams_started(rec)
        self.metrics.batch_sent(model.config.name, reason, rec.samples, tokens, padded_tokens)
        self.metrics.queued(model.config.name, [(e.priority, now - e.arrival_s) for e in entries])
        self.tenancy.queued([(e.tenant, now - e.arrival_s) for e in entries])

    def next_due(self, now: float) -> float | None:
        due = [self.scheduler.next_deadline(), self.batches.next_exec_deadline(),
               self.streams.next_deadline() if self.streams else None,
               self.batches.next_stall(self.forecast.stall_limit_s)]
        for name in self.scheduler.models_waiting():
            due_s = self.scheduler.next_due(name, now, self.latency.predictor(name))
            # due when dispatch last looked, and still queued: what holds it is a message
            # to come (a busy worker's result, a load, a worker joining), and every message
            # ticks. Asked as a due time it was a poll timeout of 0: the loop spun a core
            # for as long as every worker was busy
            if due_s is not None and due_s > self._looked_s:
                due.append(due_s)
        return earliest(due)


def _callers(entries: list[Entry], now: float) -> list[p.Caller]:
    """Who sent each request of a handler's batch: the models the handler calls inherit
    it (workers/bls.py)."""
    return [p.Caller(e.priority, (e.deadline_s - now) * 1000.0 if e.deadline_s < math.inf
                     else 0.0, e.payload.request.api_key) for e in entries]


def _batch_trace(entries: list[Entry], now: float) -> p.BatchTrace | None:
    """The traced requests of a batch; None (the common case) when none is."""
    traced = [(i, e.payload.request.trace, tracing.ns(e.arrival_s))
              for i, e in enumerate(entries) if e.payload.request.trace is not None]
    if not traced:
        return None
    return p.BatchTrace(tracing.boot_id(), tracing.ns(now), traced)
