"""The request path: admission, dispatch, results and answers.

A request is in exactly one place: queued in the scheduler, in one batch in flight
on one worker (the pool's record), or answered. Every answer goes through
:meth:`RequestPath.answer_error` or the reply in :meth:`on_result`, which close the
request's key; a key answered once is never answered again, so a late result from
a worker presumed dead, a retry racing a cancel, or an expiry racing a result can
never produce a second answer.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from functools import partial
from typing import Any, Callable, Sequence

from zeroserve.broker import protocol as p, tracing
from zeroserve.broker.server.admission import Admission, Cached, Payload, warmup_scale
from zeroserve.broker.server.breaker import BreakerOptions, Breakers, refusal
from zeroserve.broker.server.cache import ResponseCache
from zeroserve.broker.server.cachepath import CachedAnswers, Hit
from zeroserve.broker.server.catalog import Catalog, CatalogModel
from zeroserve.broker.server.dispatchgate import DispatchGate
from zeroserve.broker.server.latency import LatencyBook
from zeroserve.broker.server.metrics import BrokerMetrics
from zeroserve.broker.server.releases import Releases
from zeroserve.broker.server.pipeline import INTERNAL, Pipelines
from zeroserve.broker.server.pool import Inflight, Loss, WorkerPool, WorkerState
from zeroserve.broker.server.scheduler import Entry, Scheduler
from zeroserve.broker.server.stats import ModelStatistics
from zeroserve.broker.server.stopping import StopState
from zeroserve.broker.server.ledger import AnswerLedger, Key
from zeroserve.broker.server.streampath import StreamPath
from zeroserve.broker.server.streams import Streams
from zeroserve.broker.server.tenancy import Grant, Refusal, Tenancy
from zeroserve.broker.server.types import Send

# A running batch counts as hung, and the batches queued behind it on its worker move to
# others, once it has run this many times its predicted time, and at least STALL_MIN_S
# (a model with no prediction yet, or one whose times swing, is not taken for hung).
STALL_FACTOR = 10.0
STALL_MIN_S = 1.0

logger = logging.getLogger(__name__)



class RequestPath:
    def __init__(self, catalog: Catalog, scheduler: Scheduler, pool: WorkerPool,
                 latency: LatencyBook, metrics: BrokerMetrics, reply: Send,
                 tenancy: Tenancy | None = None, stop: StopState | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 cache: ResponseCache | None = None,
                 releases: Releases | None = None,
                 breakers: Breakers | None = None) -> None:
        self.catalog = catalog
        self.tenancy = tenancy or Tenancy(None, metrics.registry, lambda: 0.0)
        self.scheduler = scheduler
        self.pool = pool
        self.latency = latency
        self.metrics = metrics
        self._last_used: dict[str, float] = {}
        self.gate = DispatchGate()                     # when a worker may take a batch
        self.stop = stop or StopState()                # the broker's: asked at admission
        self.releases = releases                       # rollouts: told what versions answer
        self.breakers = breakers or Breakers(BreakerOptions(error_rate=0.0))
        self.stats = ModelStatistics()                 # the statistics extension's figures
        self.clock = clock                             # the broker's (for fail times)
        self.streams = Streams()                       # decoupled models' running requests
        self.ledger = AnswerLedger(self._let_go)       # admitted, not answered
        self.answers = CachedAnswers(cache if cache is not None else ResponseCache(0), catalog,
                                     self.stats, metrics)
        self.admission = Admission(catalog, scheduler, pool, latency, self.tenancy,
                                   self.stop, self.gate, self._soonest_free, self.answers)
        # ensembles: their steps' answers come back through this reply (pipeline.py)
        self.pipelines = Pipelines(catalog, pool, self.admission, self.tenancy, self.ledger,
                                   self.stats, metrics, reply, submit=self.submit,
                                   withdraw=self.on_cancel, refuse=self.refuse, clock=clock)
        self._reply = reply = self.pipelines.reply
        # a stopping broker that drains what it accepted runs the pipelines' next steps
        self.stop.client_draining(INTERNAL)
        self.streaming = StreamPath(self.streams, pool, catalog, metrics, self.stats,
                                    self.ledger, reply, self)

    # -- state --------------------------------------------------------------
    def open_count(self) -> int:
        return len(self.ledger)

    def is_open(self, key: Key) -> bool:
        return self.ledger.is_open(key)

    def census(self) -> dict[str, int]:
        """Every structure that holds something of a request, by name and size: each is
        0 once every request has been answered, at any load (the fault tests check it)."""
        out = self.scheduler.census()
        out.update(self.ledger.census())
        out.update({
            "pool.inflight": len(self.pool.inflight),
            "pool.worker_batches": sum(len(w.inflight) for w in self.pool.workers.values()),
            "pool.worker_sequences": sum(len(w.sequences) for w in self.pool.workers.values()),
            "tenancy.open": self.tenancy.open_count(), **self.pipelines.census(),
            **{f"streams.{k}": n for k, n in self.streams.sizes().items()}})
        return out

    def worker_gone(self, worker_id: str) -> None:
        """No worker of this id is registered any more."""
        if self.pool.by_id(worker_id) is None:
            self.latency.forget_worker(worker_id)

    def last_used(self, model: str) -> float:
        return self._last_used.get(model, 0.0)

    # -- intake -------------------------------------------------------------
    def on_requests(self, client: bytes, header: dict[str, Any], bufs: Sequence[Any],
                    now: float) -> None:
        """A REQUESTS message: each request admitted as if it came alone. One without an
        id to answer does not stop the others; the first such is raised afterwards (the
        loop counts it as malformed)."""
        first: p.ProtocolError | None = None
        for sub, sub_bufs in p.unbundle(header, bufs, "requests"):
            try:
                self.on_request(client, sub, sub_bufs, now, bundled=True)
            except p.ProtocolError as exc:
                first = first or exc
        if first is not None:
            raise first

    def on_request(self, client: bytes, header: dict[str, Any], bufs: Sequence[Any],
                   now: float, bundled: bool = False) -> None:
        try:
            req = p.decode_request(header, bufs)
        except p.ProtocolError as exc:
            rid = p.request_id_of(header)
            if rid is None:
                raise  # nothing to answer: the loop counts it as a malformed message
            self.refuse_ids(client, [rid], p.ErrorCode.BAD_INPUT, str(exc))
            return
        self.submit(client, req, now, bundled)

    def submit(self, client: bytes, req: p.InferRequest, now: float,
               bundled: bool = False) -> None:
        """A decoded request (a client's, or a pipeline's step) admitted or answered."""
        key = (client, req.request_id)
        if self.ledger.is_open(key):
            self.refuse(client, req.request_id, p.ErrorCode.BAD_INPUT,
                        "a request with this id is already in progress", model=req.model)
            return
        model = self.catalog.get(req.model)
        if model is not None and model.config.ensemble and self.stop.admits(client):
            self.pipelines.start(client, req, model, now)
            return
        wait_s = self.breakers.admit(req.model, now)
        if wait_s is not None:
            held = [] if model is None else [v for v in model.ready if v not in model.failed]
            version = self.breakers.route(req.model, req.version, held)
            if version is None:
                self.refuse(client, req.request_id, p.ErrorCode.UNAVAILABLE,
                            refusal(req.model, wait_s), req.model, wait_s)
                return
            req = dataclasses.replace(req, version=version)   # a healthy version it holds
        entry = self.admission.admit(client, req, now)
        if isinstance(entry, Refusal):
            self.refuse(client, req.request_id, entry.code, entry.message, req.model,
                        entry.retry_after_s)
            return
        if isinstance(entry, Cached):
            self._answer_hit(client, key, entry.grant, entry.hit, now)
            return
        entry.payload.bundled = bundled
        self.ledger.admit(key, req.model)
        self._queue(entry)

    def _answer_hit(self, client: bytes, key: Key, grant: Grant, hit: Hit, now: float
                    ) -> None:
        """Answered from the response cache: never queued nor open, so this is its one
        answer; the tenant's in-flight place it took at the gate is given back."""
        req, answer = grant.request, hit.answer
        trace = None if req.trace is None else \
            tracing.broker_stamps(now, now, self.clock(), None)
        part = p.reply_part(req.request_id, req.model, answer.version, answer.tensors,
                            {"queue_ms": 0.0, "compute_ms": 0.0, "cache_hit": 1,
                             **grant.notes}, trace, self.catalog.build(req.model, answer.version))
        self.tenancy.release(key)
        self._reply(client, p.encode_reply_parts([part]))
        self.answers.answered(req.model, hit, max(0.0, self.clock() - now))

    def warmed_up(self, worker: WorkerState, msg: p.ModelLoaded) -> None:
        """A load's measured warm-up runs seed the latency model with two batch sizes:
        from one size alone it can only guess how the time grows."""
        timings = msg.memory.get("warmup_seconds") if msg.ok else None
        if not isinstance(timings, dict):
            return
        scale = warmup_scale(self.catalog.get(msg.model))
        for size, seconds in timings.items():
            try:
                b, t = int(size), float(seconds)
            except (TypeError, ValueError):
                continue
            if b > 0 and 0.0 < t < 60.0:
                self.latency.observe(msg.model, worker.worker_id, b * scale, t)

    def _queue(self, entry: Entry) -> None:
        for victim in self.scheduler.add(entry):
            predict = self.latency.predictor(victim.model)
            retry = self.scheduler.estimate_wait(victim.model, 1, predict,
                                                 len(self.pool.holders(victim.model)))
            self.answer_error(victim, p.ErrorCode.OVERLOADED,
                              f"queue of model {victim.model!r} is full",
                              retry_after_s=max(1.0, math.ceil(retry)))

    def on_cancel(self, client: bytes, request_id: str) -> None:
        entry = self.scheduler.cancel((client, request_id))
        if entry is not None:
            self.answer_error(entry, p.ErrorCode.CANCELLED, "cancelled by the client")
        elif self.pipelines and self.pipelines.cancel((client, request_id),
                                                      "cancelled by the client"):
            pass
        elif self.streams:
            self.streaming.stop_stream((client, request_id), p.ErrorCode.CANCELLED,
                             "cancelled by the client")

    def client_gone(self, client: bytes) -> int:
        """A client's connection closed: its queued requests leave the queue (what is in
        flight finishes; its answer goes nowhere). Returns how many were withdrawn."""
        withdrawn = 0
        for rid in self.ledger.ids_of(client):
            entry = self.scheduler.cancel((client, rid))
            if entry is not None:
                self.answer_error(entry, p.ErrorCode.CANCELLED, "the client went away")
                withdrawn += 1
            elif self.pipelines and self.pipelines.cancel((client, rid),
                                                          "the client went away"):
                withdrawn += 1
            elif self.streams and self.streaming.stop_stream((client, rid),
                                                             p.ErrorCode.CANCELLED,
                                                   "the client went away"):
                withdrawn += 1   # a running stream: its generation stops too
        return withdrawn

    # -- results ------------------------------------------------------------
    def on_result(self, worker: WorkerState, header: dict[str, Any], bufs: Sequence[Any],
                  now: float) -> None:
        rec = self.pool.finish(p.result_batch_id(header))
        if rec is None:
            return  # already answered or retried (its worker was lost, or it timed out)
        try:
            result = p.decode_result(header, bufs, rec.model, rec.version)
        except p.ProtocolError as exc:
            self.fail_batch(rec, p.ErrorCode.INTERNAL, f"worker sent a malformed result: {exc}")
            raise
        try:
            self._answer_batch(worker, rec, result, now)
        except Exception as exc:
            # out of the in-flight table, the batch's requests have no other way to an answer
            self.fail_batch(rec, p.ErrorCode.INTERNAL, f"internal error on the batch's "
                             f"result: {type(exc).__name__}: {exc}"[:300])
            raise

    def _answer_batch(self, worker: WorkerState, rec: Inflight, result: p.BatchResult,
                      now: float) -> None:
        if rec.stream:
            self.streaming.stream_result(worker, rec, result, now)
            return
        if result.error is not None:
            if not result.retry and not result.expired:
                self._model_failed(rec, result.error, now)
            if result.retry:
                self.requeue(list(rec.entries.values()), result.error, now)
            elif self.releases is not None and rec.model in self.releases.watched:
                self._canary_failed(rec, result, now)
            else:
                code = p.ErrorCode.DEADLINE if result.expired else p.ErrorCode.MODEL_ERROR
                self.fail_batch(rec, code, result.error)
            return
        compute_s = result.compute_ms / 1000.0
        self.latency.observe(rec.model, worker.worker_id, rec.units, compute_s)
        self.tenancy.used(self.scheduler.used(rec.model, rec.entries.values(), compute_s), now)
        self.metrics.batch_done(rec.model, rec.samples, compute_s, result.phases_ms)
        self.stats.batch_done(rec.model, rec.version, rec.samples, result.phases_ms,
                              result.compute_ms)
        build = self.catalog.build(rec.model, rec.version)
        bundles: dict[bytes, list[tuple[dict[str, Any], list[Any]]]] = {}
        totals_s: list[float] = []   # the metrics and statistics take the batch's at once
        queued_s = 0.0
        # a model with a free length: the tokens its batch computed, padding included
        longest = max((e.length for e in rec.entries.values()), default=0)
        shared: dict[str, float] = {"batch_tokens": rec.samples * longest} if longest else {}
        for rep in result.replies:
            entry = rec.entries.get(rep.request_id)
            if entry is None or not self.ledger.is_open(entry.key):
                continue
            pl: Payload = entry.payload
            queue_s = rec.sent_s - entry.arrival_s
            totals_s.append(now - entry.arrival_s)
            queued_s += queue_s
            stats = {"queue_ms": queue_s * 1000.0, "compute_ms": result.compute_ms,
                     "batch_size": rec.samples, **shared, **pl.notes}
            trace = None
            if pl.request is not None and pl.request.trace is not None:
                trace = tracing.broker_stamps(entry.arrival_s, rec.sent_s, now, result.trace)
            part = p.reply_part(pl.request_id, rec.model, rec.version, rep.tensors, stats,
                                trace, build)
            frames = None if pl.bundled else p.encode_reply_parts([part])
            if pl.digest is not None:
                self.answers.keep(rec.model, rec.version, pl.digest, rep.tensors)
            del rec.entries[rep.request_id]   # from here on nothing can fail before it leaves
            self.ledger.close(entry.key)
            if frames is None:
                got = bundles.get(pl.client)
                if got is None:
                    bundles[pl.client] = [part]
                else:
                    got.append(part)
            else:
                self._reply(pl.client, frames)
            pl.release()
        for client, replies in bundles.items():
            self._send_replies(client, replies)
        if totals_s:
            if self.releases is not None and rec.model in self.releases.watched:
                self.releases.answered(rec.model, rec.version, len(totals_s), compute_s)
            if not self._rolling_out(rec.model):
                self.breakers.answered(rec.model, len(totals_s), now)
            self.metrics.requests_done(rec.model, rec.version, totals_s)
            self.stats.request_done(rec.model, rec.version, queued_s, sum(totals_s),
                                    result.phases_ms, result.compute_ms, len(totals_s))
        self.fail_batch(rec, p.ErrorCode.INTERNAL, "worker returned no output")


    def _rolling_out(self, model: str) -> bool:
        return self.releases is not None and model in self.releases.rollouts

    def _model_failed(self, rec: Inflight, error: str, now: float) -> None:
        """A batch the model itself failed: the breaker counts it, outside a rollout (a
        rollout compares the versions and rolls back the bad one instead)."""
        if self._rolling_out(rec.model):
            return
        if self.breakers.failed(rec.model, len(rec.entries), now, error[:200], rec.version):
            self.metrics.breaker_tripped(rec.model)
            logger.error("model %s: circuit breaker open, its requests answered 503 (or "
                         "routed to another version it holds) until probes pass: %s",
                         rec.model, error[:200])

    def _canary_failed(self, rec: Inflight, result: p.BatchResult, now: float) -> None:
        """A failed batch of a model in a rollout: counted against its version; when that
        is the canary of a plan that retries, or a version rolled back, its unpinned
        requests run again (their one retry) on the stable version."""
        assert self.releases is not None and result.error is not None
        self.releases.failed(rec.model, rec.version, len(rec.entries))
        target = self.releases.fallback(rec.model, rec.version)
        entries = list(rec.entries.values())
        if target is not None and not result.expired:
            rec.entries.clear()
            again = [e for e in entries if not e.payload.pinned and e.payload.attempts < 1]
            self.requeue(again, result.error, now, version=target)
            taken = {id(e) for e in again}
            entries = [e for e in entries if id(e) not in taken]   # the model's error
        code = p.ErrorCode.DEADLINE if result.expired else p.ErrorCode.MODEL_ERROR
        for entry in entries:
            self.answer_error(entry, code, result.error)
        rec.entries.clear()

    def _send_replies(self, client: bytes, parts: list[tuple[dict[str, Any], list[Any]]]
                      ) -> None:
        """A batch's replies to one client in as few messages as the protocol allows: a
        message sent costs the broker more than the bytes in it."""
        for i in range(0, len(parts), p.MAX_BUNDLE):
            self._reply(client, p.encode_reply_parts(parts[i:i + p.MAX_BUNDLE]))

    # -- workers lost ---------------------------------------------------------
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

    def overdue(self, now: float) -> list[bytes]:
        """Batches past max_execution_ms fail (504, never retried elsewhere); returns the
        identities of their workers, which are hung and must go."""
        hung = []
        for rec in self.pool.overdue(now):
            worker = self.pool.get(rec.worker)
            # one that waits on the models its handler called is off the worker's compute
            # thread: it fails alone, the worker is not hung (workers/bls.py)
            waiting = worker is not None and rec.batch_id in worker.waiting
            self.pool.finish(rec.batch_id)
            self.fail_batch(rec, p.ErrorCode.DEADLINE,
                            f"batch ran past max_execution_ms of model {rec.model!r}"
                            + (" waiting on the models it called" if waiting else ""))
            if not waiting:
                hung.append(rec.worker)
        return hung

    def move_stalled(self, now: float) -> None:
        """Batches queued behind a hung one go back to the queue; they never ran, so this
        spends none of their one retry."""
        for worker, behind in self.pool.stalled(now, self._stall_limit_s):
            logger.warning("worker %s: its running batch overran its prediction; %d batch(es) "
                           "queued behind it move to other workers", worker.worker_id,
                           len(behind))
            for rec in behind:
                self.requeue(list(rec.entries.values()), f"worker {worker.worker_id} is "
                              "stuck on an earlier batch", now, spend=False)

    def _stall_limit_s(self, worker: WorkerState, head: Inflight) -> float:
        predict = self.latency.predictor(head.model, worker.worker_id)
        return max(STALL_MIN_S, STALL_FACTOR * predict(head.units))

    def requeue(self, entries: list[Entry], why: str, now: float, spend: bool = True,
                version: int | None = None) -> None:
        """Queued again, once, while the deadline allows; unpinned ones to ``version``
        (None: the model's default when dispatched)."""
        for entry in entries:
            pl: Payload = entry.payload
            if (pl.attempts < 1 or not spend) and entry.deadline_s > now \
                    and self.pool.holders(entry.model) \
                    and self.scheduler.knows(entry.model) and self.is_open(entry.key) \
                    and not (self.streams and self.streams.has_responded(entry.key)):
                if self.streams:
                    self.streams.forget(entry.key)   # it runs again from the start
                pl.attempts += int(spend)
                fresh = entry.again()
                fresh.version = entry.version if pl.pinned else version
                self._queue(fresh)
            else:
                self.answer_error(entry, p.ErrorCode.WORKER_LOST, f"{why}; retry")

    def fail_batch(self, rec: Inflight, code: p.ErrorCode, message: str) -> None:
        for entry in rec.entries.values():
            self.answer_error(entry, code, message)
        rec.entries.clear()

    # -- time ---------------------------------------------------------------
    def expire(self, now: float) -> None:
        for entry in self.scheduler.expire(now):
            self.answer_error(entry, p.ErrorCode.DEADLINE, "deadline exceeded while queued")
        if self.streams:
            self.streaming.expire_streams(now)

    def dispatch(self, now: float) -> None:
        for name in self.scheduler.models_waiting():
            model = self.catalog.get(name)
            if model is not None:
                self._dispatch_model(model, now)

    def _dispatch_model(self, model: CatalogModel, now: float) -> None:
        name = model.config.name
        while True:
            if model.config.max_sequences:
                # an iterative model's requests join the sequences running on a worker at
                # its next step: as many as it has free slots, whatever else it runs
                worker, free = self.pool.sequence_holder(name, model.config.max_sequences)
                if worker is None or not self._take(worker, model, now, now, free):
                    return
                continue
            worker = self.pool.free_holder(name)
            if worker is None:
                return
            predict = self.latency.predictor(name, worker.worker_id)
            busy = bool(worker.inflight)
            queued = self.scheduler.queued_samples(name)
            if busy and not self.gate.may_send(name, now, busy, worker.on_cpu,
                                               partial(self._work_s, worker), queued,
                                               model.config.max_batch_size):
                return  # its result frees it
            half = self.gate.split(name, now, busy, worker.free, queued,
                                   self.scheduler.queued_units(name) / max(queued, 1), predict)
            if not self._take(worker, model, now, self._busy_until(worker, now), half):
                return

    def _take(self, worker: WorkerState, model: CatalogModel, now: float, start_s: float,
              max_samples: int | None) -> bool:
        """A batch for ``worker`` taken from the queue and sent; False when the queue has
        none for it now."""
        name = model.config.name
        held, default = worker.versions_of(name), model.default_version

        def resolve(e: Entry, held: set[int] = held, default: int = default) -> int | None:
            v = e.version if e.version is not None else default
            return v if v in held else None

        decision = self.scheduler.take(name, now, self.latency.predictor(name, worker.worker_id),
                                       resolve, start_s=start_s, max_samples=max_samples)
        if decision is None:
            return False
        for entry in decision.doomed:
            self.answer_error(entry, p.ErrorCode.DEADLINE,
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
        rec = self.pool.send_batch(worker, model.config.name, version, entries, items, reason,
                                   now, exec_s, model.config.decoupled,
                                   _batch_trace(entries, now),
                                   _callers(entries, now) if model.config.platform == "python"
                                   else None, sequences=model.config.max_sequences > 0)
        if rec is None:
            self.worker_lost(self.pool.remove(worker, Loss.UNREACHABLE), Loss.UNREACHABLE,
                             worker.worker_id, now)
            self.requeue(entries, f"worker {worker.worker_id} is unreachable", now)
            return
        self._last_used[model.config.name] = now
        if rec.stream:
            self.streaming.streams_started(rec)
        self.metrics.batch_sent(model.config.name, reason, rec.samples, tokens, padded_tokens)
        self.metrics.queued(model.config.name, [(e.priority, now - e.arrival_s) for e in entries])
        self.tenancy.queued([(e.tenant, now - e.arrival_s) for e in entries])

    def _soonest_free(self, workers: list[WorkerState], now: float) -> float:
        """When the first of ``workers`` is predicted to be done with what it has."""
        soonest = math.inf
        for w in workers:
            if not w.inflight:
                return now   # idle: none can be sooner
            soonest = min(soonest, self._busy_until(w, now))
        return soonest if workers else now

    def _busy_until(self, worker: WorkerState, now: float) -> float:
        def predict(model: str, units: float) -> float:
            return self.latency.predictor(model, worker.worker_id)(units)
        return self.pool.busy_until(worker, now, predict)

    def _work_s(self, worker: WorkerState) -> float:
        def predict(model: str, units: float) -> float:
            return self.latency.predictor(model, worker.worker_id)(units)
        return self.pool.work_s(worker, predict)

    def next_due(self, now: float) -> float | None:
        due = [d for d in (self.scheduler.next_deadline(), self.pool.next_exec_deadline(),
                           self.streams.next_deadline() if self.streams else None,
                           self.pool.next_stall(self._stall_limit_s)) if d is not None]
        for name in self.scheduler.models_waiting():
            d = self.scheduler.next_due(name, now, self.latency.predictor(name))
            if d is not None:
                due.append(d)
        return min(due, default=None)

    # -- answers ------------------------------------------------------------
    def _let_go(self, key: Key) -> None:
        """A request was answered: what the streams and its tenant held of it goes."""
        if self.streams:
            self.streams.forget(key)
        self.tenancy.release(key)

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
        for batch_id in list(self.pool.inflight):
            rec = self.pool.finish(batch_id)
            if rec is not None:
                self.fail_batch(rec, code, message)

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
