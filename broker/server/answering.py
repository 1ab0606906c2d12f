"""Where an admitted request that its batch does not answer goes: an error answer, or
back to the queue once.

A request is in exactly one place: queued in the scheduler, in one batch in flight on
one worker (the pool's record), or answered. Every error answer goes through
:meth:`Answering.answer_error`, which closes the request's key in the answer ledger
first; a key answered once is never answered again, so a late result from a worker
presumed dead, a retry racing a cancel, or an expiry racing a result can never produce
a second answer. A request refused at the door holds no key: :meth:`Answering.refuse`.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

from zeroserve.broker import protocol as p
from zeroserve.broker.server.admission import Payload
from zeroserve.broker.server.catalog import Catalog
from zeroserve.broker.server.latency import LatencyBook
from zeroserve.broker.server.ledger import AnswerLedger
from zeroserve.broker.server.metrics import BrokerMetrics
from zeroserve.broker.server.pool import Batches, Inflight, Loss, WorkerPool
from zeroserve.broker.server.scheduler import Entry, Scheduler
from zeroserve.broker.server.stats import ModelStatistics
from zeroserve.broker.server.streams import Streams
from zeroserve.broker.server.tenancy import Tenancy
from zeroserve.broker.server.types import Send


class Answering:
    """Implements the stream path's :class:`~zeroserve.broker.server.streampath.BatchAnswers`
    and the releases' ``reroute``. ``reply`` is the request path's one reply function
    (the pipelines' in front of the socket)."""

    def __init__(self, catalog: Catalog, scheduler: Scheduler, pool: WorkerPool,
                 batches: Batches, latency: LatencyBook, ledger: AnswerLedger, streams: Streams,
                 tenancy: Tenancy, stats: ModelStatistics, metrics: BrokerMetrics,
                 reply: Send, clock: Callable[[], float]) -> None:
        self.catalog = catalog
        self.scheduler = scheduler
        self.pool = pool
        self.batches = batches
        self.latency = latency
        self.ledger = ledger
        self.streams = streams
        self.tenancy = tenancy
        self.stats = stats
        self.metrics = metrics
        self._reply = reply
        self.clock = clock   # the broker's (for fail times)

    # -- error answers ----------------------------------------------------------
    def answer_error(self, entry: Entry, code: p.ErrorCode, message: str,
                     retry_after_s: float | None = None) -> None:
        if self.streams and self.streams.get(entry.key) is not None:
            self.metrics.stream_ended(entry.model, code.value)
        if not self.ledger.close(entry.key):
            return
        self.stats.request_failed(entry.model, entry.version,
                                  max(0.0, self.clock() - entry.arrival_s))
        self.tenancy.rejected(entry.tenant, code)
        pl: Payload = entry.payload
        self.refuse(pl.client, pl.request_id, code, message, entry.model, retry_after_s)
        pl.release()

    def refuse(self, client: bytes, request_id: str, code: p.ErrorCode, message: str,
               model: str, retry_after_s: float | None = None) -> None:
        """An error answer to a request that holds no place (refused at the door). A
        model the catalog does not know counts under model "": a client naming models
        at random would otherwise grow a series (and the broker's memory) per name."""
        self.metrics.error(model if self.catalog.get(model) is not None else "", code)
        self._reply(client, p.encode_error(p.ErrorReply(request_id, code, message,
                                                        retry_after_s)))

    def refuse_ids(self, client: bytes, ids: Sequence[str], code: p.ErrorCode,
                   message: str) -> None:
        """Answer the ids a malformed message names, except those already in progress
        (an error sent for one of those would be taken as its answer)."""
        for rid in dict.fromkeys(ids):
            if not self.ledger.is_open((client, rid)):
                self.refuse(client, rid, code, message, model="")

    def fail_batch(self, rec: Inflight, code: p.ErrorCode, message: str) -> None:
        for entry in rec.entries.values():
            self.answer_error(entry, code, message)
        rec.entries.clear()

    def fail_queued(self, model: str, code: p.ErrorCode, message: str) -> None:
        for entry in self.scheduler.drop_model(model):
            self.answer_error(entry, code, message)

    def fail_waiting(self, model: str, code: p.ErrorCode, message: str,
                     retry_after_s: float | None = None) -> None:
        """Every request queued for ``model`` answered ``code``; the model stays served
        (a load on demand that failed)."""
        for entry in self.scheduler.queued(model):
            if self.scheduler.cancel(entry.key) is not None:
                self.answer_error(entry, code, message, retry_after_s)

    def fail_everything(self, code: p.ErrorCode, message: str) -> None:
        for name in list(self.scheduler.models_waiting()):
            self.fail_queued(name, code, message)
        for batch_id in list(self.batches.inflight):
            rec = self.batches.finish(batch_id)
            if rec is not None:
                self.fail_batch(rec, code, message)

    # -- back to the queue --------------------------------------------------------
    def queue(self, entry: Entry) -> None:
        """Queued; what the queue sheds for it (a full queue) is answered overloaded."""
        for victim in self.scheduler.add(entry):
            predict = self.latency.predictor(victim.model)
            retry = self.scheduler.estimate_wait(victim.model, 1, predict,
                                                 len(self.pool.holders(victim.model)))
            self.answer_error(victim, p.ErrorCode.OVERLOADED,
                              f"queue of model {victim.model!r} is full",
                              retry_after_s=max(1.0, math.ceil(retry)))

    def requeue(self, entries: list[Entry], why: str, now: float, spend: bool = True,
                version: int | None = None) -> None:
        """Queued again, once, while the deadline allows; unpinned ones to ``version``
        (None: the model's default when dispatched)."""
        for entry in entries:
            pl: Payload = entry.payload
            if (pl.attempts < 1 or not spend) and entry.deadline_s > now \
                    and self.pool.holders(entry.model) \
                    and self.scheduler.knows(entry.model) and self.ledger.is_open(entry.key) \
                    and not (self.streams and self.streams.has_responded(entry.key)):
                if self.streams:
                    self.streams.forget(entry.key)   # it runs again from the start
                pl.attempts += int(spend)
                fresh = entry.again()
                fresh.version = entry.version if pl.pinned else version
                self.queue(fresh)
            else:
                self.answer_error(entry, p.ErrorCode.WORKER_LOST, f"{why}; retry")

    def worker_lost(self, lost: list[Inflight], loss: Loss, worker_id: str, now: float) -> None:
        """What a lost worker's in-flight requests get. Retried once elsewhere while their
        deadlines allow, except the batch that was running on a worker that went silent:
        it may be what stopped the worker, so it is not sent to another one (a poison
        input must not take down every worker)."""
        why = f"worker {worker_id} was lost while running this request: {loss.value}"
        for i, rec in enumerate(lost):
            if loss is Loss.SILENT and i == 0:
                self.fail_batch(rec, p.ErrorCode.WORKER_LOST, f"{why}; retry")
            else:
                self.requeue(list(rec.entries.values()), why, now)

    def reroute(self, name: str, gone: set[int], to: int | None = None) -> None:
        """Queued requests for versions that left (or were rolled back): unpinned ones go
        to ``to`` (None: the new default), pinned ones to a retired version get not
        found."""
        if not gone:
            return
        model = self.catalog.get(name)
        for entry in self.scheduler.queued(name):
            if entry.version not in gone:
                continue
            if not entry.payload.pinned:
                entry.version = to
            elif model is None or entry.version not in model.versions:
                if self.scheduler.cancel(entry.key) is not None:
                    self.answer_error(entry, p.ErrorCode.NOT_FOUND,
                                      f"version {entry.version} of model {name!r} was retired")
