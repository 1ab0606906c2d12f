"""The request path: admission, dispatch, results and answers.

A request is in exactly one place: queued in the scheduler, in one batch in flight
on one worker (the pool's record), or answered. Every answer goes through
:meth:`RequestPath.answer_error` or the reply in :meth:`on_result`, which close the
request's key; a key answered once is never answered again, so a late result from
a worker presumed dead, a retry racing a cancel, or an expiry racing a result can
never produce a second answer.
"""

from __future__ import annotations

import logging
import math
import random
import time
from typing import Any, Callable, Hashable, Sequence

from zeroserve.broker import protocol as p, tracing
from zeroserve.broker.server.admission import admission_error, deadline_of
from zeroserve.broker.server.cache import ResponseCache
from zeroserve.broker.server.cachepath import CachedAnswers, Hit
from zeroserve.broker.server.catalog import Catalog, CatalogModel, RequestError, check_inputs, \
    normalize_priority
from zeroserve.broker.server.latency import LatencyBook
from zeroserve.broker.server.metrics import BrokerMetrics
from zeroserve.broker.server.pool import Inflight, Loss, WorkerPool, WorkerState
from zeroserve.broker.server.scheduler import Entry, Scheduler
from zeroserve.broker.server.stats import ModelStatistics
from zeroserve.broker.server.stopping import StopState
from zeroserve.broker.server.streampath import StreamPath
from zeroserve.broker.server.streams import Streams
from zeroserve.broker.server.tenancy import Grant, Refusal, Tenancy
from zeroserve.models.repository import ModelConfig
from zeroserve.models.shapes import ShapeError, rule as shape_rule

# A batch sent to a busy worker waits there, in a FIFO that neither priority nor deadline
# reorders: under 2x overload of cnn with two priorities, a second credit made
# high-priority requests wait a whole low-priority batch (about 20 ms): 56% of them were
# answered within a 50 ms deadline, 98% with this rule (measured, same run). So while a
# model's recent requests mix priorities, a busy worker gets a batch to queue only while
# what it holds is predicted to run this long at most: short batches (mlp: 2-3 ms) keep
# the pipelining that hides the hop to the worker, long ones wait in the broker's queue.
# With one priority the queue at the worker reorders nothing, and it keeps a closed loop's
# stages overlapping.
PREFETCH_S = 0.005
MIXED_PRIORITIES_S = 10.0   # how long a model counts as seeing more than one priority
# Requests that arrive together (a client sends what one loop turn made as one message)
# would form one batch, and a closed loop then falls into step with it: the worker idles
# while the replies travel. An idle worker with two credits gets the queue in two halves
# instead, when two half batches are predicted to cost at most this much more than one
# whole (so where batching gains little, like cnn on a CPU, and never on a GPU model
# whose batch costs about the same at any size).
SPLIT_COST = 1.15
# A CPU worker with a batch running gets a second one only once at least this fraction
# of a full batch is queued. Held in the broker, a small batch grows while the worker's
# core runs the gateway and the broker of the same host; sent at once, it would wait at
# the worker just as long, as small. Measured on mlp (max batch 64) at C=64, same runs:
# HTTP 6,670 -> 6,950-7,110 req/s, the mean batch 24 -> 27, every process spending less
# a request; direct level (10,200-10,290 -> 10,360-10,400). Holding every batch until the
# result returns (a threshold of a whole batch) gained more over HTTP (7,070-7,530) but
# cost direct clients 4%, whose load turns round faster than the worker's idle moment.
# An accelerator's idle moment is lost, so a GPU worker always gets its second batch.
CPU_PREFETCH_FRACTION = 0.5
# A running batch counts as hung, and the batches queued behind it on its worker move to
# others, once it has run this many times its predicted time, and at least STALL_MIN_S
# (a model with no prediction yet, or one whose times swing, is not taken for hung).
STALL_FACTOR = 10.0
STALL_MIN_S = 1.0

logger = logging.getLogger(__name__)

Send = Callable[[bytes, list[Any]], bool]
Key = tuple[bytes, str]


class Payload:
    __slots__ = ("client", "request_id", "request", "pinned", "attempts", "notes", "bundled",
                 "digest")

    def __init__(self, client: bytes, request: p.InferRequest, pinned: bool) -> None:
        self.client = client
        self.request_id = request.request_id
        self.request: p.InferRequest | None = request
        self.pinned = pinned
        self.attempts = 0
        self.notes: dict[str, float] = {}   # the tenant's clamps, for the reply's stats
        self.bundled = False   # came in a REQUESTS: the client takes its reply in REPLIES
        self.digest: bytes | None = None   # a response cache miss: its answer is kept

    def release(self) -> None:
        """Answered: let go of the tensor frames. The entry itself may linger in the
        scheduler's lazily cleaned heaps; its frames must not."""
        self.request = None


class RequestPath(StreamPath):
    def __init__(self, catalog: Catalog, scheduler: Scheduler, pool: WorkerPool,
                 latency: LatencyBook, metrics: BrokerMetrics, reply: Send,
                 rng: random.Random | None = None, tenancy: Tenancy | None = None,
                 stop: StopState | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 cache: ResponseCache | None = None) -> None:
        self.catalog = catalog
        self.tenancy = tenancy or Tenancy(None, metrics.registry, lambda: 0.0)
        self.scheduler = scheduler
        self.pool = pool
        self.latency = latency
        self.metrics = metrics
        self._reply = reply
        self._rng = rng or random.Random()
        self._open: dict[Key, str] = {}               # admitted, not answered: key -> model
        self._by_client: dict[bytes, set[str]] = {}
        self._last_used: dict[str, float] = {}
        self._priorities: dict[str, tuple[int, float]] = {}  # model -> (last, mixed until)
        self.stop = stop or StopState()                # the broker's: asked at admission
        self.stats = ModelStatistics()                 # the statistics extension's figures
        self.clock = clock                             # the broker's (for fail times)
        self.streams = Streams()                       # decoupled models' running requests
        self.answers = CachedAnswers(cache if cache is not None else ResponseCache(0), catalog,
                                     self.stats, metrics)

    # -- state --------------------------------------------------------------
    def open_count(self) -> int:
        return len(self._open)

    def is_open(self, key: Key) -> bool:
        return key in self._open

    def census(self) -> dict[str, int]:
        """Every structure that holds something of a request, by name and size: each is
        0 once every request has been answered, at any load (the fault tests check it)."""
        out = self.scheduler.census()
        out.update({
            "requests.open": len(self._open), "requests.by_client": len(self._by_client),
            "pool.inflight": len(self.pool.inflight),
            "pool.worker_batches": sum(len(w.inflight) for w in self.pool.workers.values()),
            "tenancy.open": self.tenancy.open_count(),
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
        key = (client, req.request_id)
        if key in self._open:
            self.refuse(client, req.request_id, p.ErrorCode.BAD_INPUT,
                        "a request with this id is already in progress", model=req.model)
            return
        who = self.tenancy.identify(req)
        if isinstance(who, Refusal):
            self.refuse(client, req.request_id, who.code, who.message, model=req.model)
            return
        model = self.catalog.get(req.model)
        err = admission_error(req, model, self.pool, self.stop.admits(client))
        if err is not None:
            self.refuse(client, req.request_id, err[0], err[1], model=req.model)
            return
        assert model is not None
        try:
            samples = check_inputs(model.config, [t.meta for t in req.tensors], req.outputs)
            shape, scale = shape_class(model.config, req.tensors)
        except (RequestError, ShapeError) as exc:
            self.refuse(client, req.request_id, p.ErrorCode.BAD_INPUT, str(exc),
                        model=req.model)
            return
        grant = self.tenancy.admit(who, key, req, samples, now)
        if isinstance(grant, Refusal):
            self.refuse(client, req.request_id, grant.code, grant.message, req.model,
                        grant.retry_after_s)
            return
        digest = None
        if model.config.response_cache and self.answers.on:   # after the tenant's gate
            found = self.answers.lookup(grant.request, model)
            if isinstance(found, Hit):
                self._answer_hit(client, key, grant, found, now)
                return
            digest = found
        entry = self._entry(client, grant.request, model, samples, now, grant, shape, scale)
        if entry is None:
            self.tenancy.release(key)
            self.tenancy.rejected(grant.tenant, p.ErrorCode.DEADLINE)
            return
        entry.tenant, entry.weight, entry.shed_rank = grant.tenant, grant.weight, grant.shed_rank
        entry.payload.notes = grant.notes
        entry.payload.bundled = bundled
        entry.payload.digest = digest
        self._open[key] = req.model
        ids = self._by_client.get(client)
        if ids is None:
            ids = self._by_client[client] = set()
        ids.add(req.request_id)
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
                             **grant.notes}, trace)
        self.tenancy.release(key)
        self._reply(client, p.encode_reply_parts([part]))
        self.answers.answered(req.model, hit, max(0.0, self.clock() - now))

    def _entry(self, client: bytes, req: p.InferRequest, model: CatalogModel, samples: int,
               now: float, grant: Grant | None = None, shape: Hashable = None,
               scale: float = 1.0) -> Entry | None:
        """The queue entry, or None when the deadline cannot be met (refused now)."""
        cfg = model.config
        priority = normalize_priority(req.priority, cfg)
        timeout_ms, deadline = deadline_of(req, cfg, now)
        if deadline < math.inf:   # without a deadline there is nothing to refuse it for
            predict = self.latency.predictor(req.model)
            holders = self.pool.holders(req.model)
            wait_s = self.scheduler.estimate_wait(
                req.model, priority, predict, len(holders), *(
                    (grant.tenant, grant.weight, samples) if grant is not None else ()))
            wait_s += self._soonest_free(holders, now) - now
            if now + wait_s + predict(samples * scale) > deadline:
                self.refuse(client, req.request_id, p.ErrorCode.DEADLINE,
                            f"deadline of {timeout_ms:g} ms cannot be met: the queue ahead "
                            f"needs about {wait_s * 1000:.1f} ms", model=req.model)
                return None
        self._note_priority(req.model, priority, now)
        version = req.version
        if version is None and cfg.traffic:
            version = model.route(self._rng)
        return Entry(key=(client, req.request_id), model=req.model, priority=priority,
                     arrival_s=now, deadline_s=deadline, samples=samples, version=version,
                     payload=Payload(client, req, req.version is not None), shape=shape,
                     scale=scale)

    def _split(self, worker: WorkerState, model: str, predict: Callable[[float], float],
               now: float) -> int | None:
        """Half the queue, for an idle worker that can take two batches, when batching
        gains little and a queued batch reorders nothing; else None (the model's cap)."""
        if worker.inflight or worker.free < 2 or self._mixed(model, now):
            return None
        queued = self.scheduler.queued_samples(model)
        half = (queued + 1) // 2
        scale = self.scheduler.queued_units(model) / max(queued, 1)
        whole = predict(queued * scale)
        if queued < 2 or whole <= PREFETCH_S or \
                2 * predict(half * scale) > SPLIT_COST * whole:
            return None
        return half

    def warmed_up(self, worker: WorkerState, msg: p.ModelLoaded) -> None:
        """A load's measured warm-up runs seed the latency model with two batch sizes:
        from one size alone it can only guess how the time grows."""
        timings = msg.memory.get("warmup_seconds") if msg.ok else None
        if not isinstance(timings, dict):
            return
        model = self.catalog.get(msg.model)
        scale = shape_rule(model.config).warmup_scale() if model is not None else 1.0
        for size, seconds in timings.items():
            try:
                b, t = int(size), float(seconds)
            except (TypeError, ValueError):
                continue
            if b > 0 and 0.0 < t < 60.0:
                self.latency.observe(msg.model, worker.worker_id, b * scale, t)

    def _note_priority(self, model: str, priority: int, now: float) -> None:
        seen = self._priorities.get(model)
        if seen is None:
            self._priorities[model] = (priority, -math.inf)
        elif priority != seen[0]:
            self._priorities[model] = (priority, now + MIXED_PRIORITIES_S)

    def _mixed(self, model: str, now: float) -> bool:
        return self._priorities.get(model, (0, -math.inf))[1] > now

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
        elif self.streams:
            self.stop_stream((client, request_id), p.ErrorCode.CANCELLED,
                             "cancelled by the client")

    def client_gone(self, client: bytes) -> int:
        """A client's connection closed: its queued requests leave the queue (what is in
        flight finishes; its answer goes nowhere). Returns how many were withdrawn."""
        withdrawn = 0
        for rid in list(self._by_client.get(client, ())):
            entry = self.scheduler.cancel((client, rid))
            if entry is not None:
                self.answer_error(entry, p.ErrorCode.CANCELLED, "the client went away")
                withdrawn += 1
            elif self.streams and self.stop_stream((client, rid), p.ErrorCode.CANCELLED,
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
            self._fail_batch(rec, p.ErrorCode.INTERNAL, f"worker sent a malformed result: {exc}")
            raise
        try:
            self._answer_batch(worker, rec, result, now)
        except Exception as exc:
            # out of the in-flight table, the batch's requests have no other way to an answer
            self._fail_batch(rec, p.ErrorCode.INTERNAL, f"internal error on the batch's "
                             f"result: {type(exc).__name__}: {exc}"[:300])
            raise

    def _answer_batch(self, worker: WorkerState, rec: Inflight, result: p.BatchResult,
                      now: float) -> None:
        if rec.stream:
            self.stream_result(worker, rec, result, now)
            return
        if result.error is not None:
            if result.retry:
                self._requeue(list(rec.entries.values()), result.error, now)
            else:
                code = p.ErrorCode.DEADLINE if result.expired else p.ErrorCode.MODEL_ERROR
                self._fail_batch(rec, code, result.error)
            return
        compute_s = result.compute_ms / 1000.0
        self.latency.observe(rec.model, worker.worker_id, rec.units, compute_s)
        self.metrics.batch_done(rec.model, rec.samples, compute_s, result.phases_ms)
        self.stats.batch_done(rec.model, rec.version, rec.samples, result.phases_ms,
                              result.compute_ms)
        bundles: dict[bytes, list[tuple[dict[str, Any], list[Any]]]] = {}
        totals_s: list[float] = []   # the metrics and statistics take the batch's at once
        queued_s = 0.0
        for rep in result.replies:
            entry = rec.entries.get(rep.request_id)
            if entry is None or entry.key not in self._open:
                continue
            pl: Payload = entry.payload
            queue_s = rec.sent_s - entry.arrival_s
            totals_s.append(now - entry.arrival_s)
            queued_s += queue_s
            stats = {"queue_ms": queue_s * 1000.0, "compute_ms": result.compute_ms,
                     "batch_size": rec.samples, **pl.notes}
            trace = None
            if pl.request is not None and pl.request.trace is not None:
                trace = tracing.broker_stamps(entry.arrival_s, rec.sent_s, now, result.trace)
            part = p.reply_part(pl.request_id, rec.model, rec.version, rep.tensors, stats,
                                trace)
            frames = None if pl.bundled else p.encode_reply_parts([part])
            if pl.digest is not None:
                self.answers.keep(rec.model, rec.version, pl.digest, rep.tensors)
            del rec.entries[rep.request_id]   # from here on nothing can fail before it leaves
            self._close(entry.key)
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
            self.metrics.requests_done(rec.model, rec.version, totals_s)
            self.stats.request_done(rec.model, rec.version, queued_s, sum(totals_s),
                                    result.phases_ms, result.compute_ms, len(totals_s))
        self._fail_batch(rec, p.ErrorCode.INTERNAL, "worker returned no output")

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
                self._fail_batch(rec, p.ErrorCode.WORKER_LOST, f"{why}; retry")
            else:
                self._requeue(list(rec.entries.values()), why, now)

    def overdue(self, now: float) -> list[bytes]:
        """Batches past max_execution_ms fail (504, never retried elsewhere); returns the
        identities of their workers, which are hung and must go."""
        hung = []
        for rec in self.pool.overdue(now):
            self.pool.finish(rec.batch_id)
            self._fail_batch(rec, p.ErrorCode.DEADLINE,
                             f"batch ran past max_execution_ms of model {rec.model!r}")
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
                self._requeue(list(rec.entries.values()), f"worker {worker.worker_id} is "
                              "stuck on an earlier batch", now, spend=False)

    def _stall_limit_s(self, worker: WorkerState, head: Inflight) -> float:
        predict = self.latency.predictor(head.model, worker.worker_id)
        return max(STALL_MIN_S, STALL_FACTOR * predict(head.units))

    def _requeue(self, entries: list[Entry], why: str, now: float, spend: bool = True) -> None:
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
                fresh.version = entry.version if pl.pinned else None
                self._queue(fresh)
            else:
                self.answer_error(entry, p.ErrorCode.WORKER_LOST, f"{why}; retry")

    def _fail_batch(self, rec: Inflight, code: p.ErrorCode, message: str) -> None:
        for entry in rec.entries.values():
            self.answer_error(entry, code, message)
        rec.entries.clear()

    # -- time ---------------------------------------------------------------
    def expire(self, now: float) -> None:
        for entry in self.scheduler.expire(now):
            self.answer_error(entry, p.ErrorCode.DEADLINE, "deadline exceeded while queued")
        if self.streams:
            self.expire_streams(now)

    def dispatch(self, now: float) -> None:
        for name in self.scheduler.models_waiting():
            model = self.catalog.get(name)
            if model is not None:
                self._dispatch_model(model, now)

    def _dispatch_model(self, model: CatalogModel, now: float) -> None:
        name = model.config.name
        while True:
            worker = self.pool.free_holder(name)
            if worker is None:
                return
            held, default = worker.versions_of(name), model.default_version

            def resolve(e: Entry, held: set[int] = held, default: int = default) -> int | None:
                v = e.version if e.version is not None else default
                return v if v in held else None

            predict = self.latency.predictor(name, worker.worker_id)
            if worker.inflight and self._mixed(name, now) and \
                    self._work_s(worker) > PREFETCH_S:
                return  # its result frees it
            if worker.inflight and worker.on_cpu and self.scheduler.queued_samples(name) < \
                    CPU_PREFETCH_FRACTION * model.config.max_batch_size:
                return  # likewise
            start_s = self._busy_until(worker, now)
            decision = self.scheduler.take(name, now, predict, resolve, start_s=start_s,
                                           max_samples=self._split(worker, name, predict, now))
            if decision is None:
                return
            for entry in decision.doomed:
                self.answer_error(entry, p.ErrorCode.DEADLINE,
                                  "deadline cannot be met: the work ahead of this request "
                                  "takes longer than its remaining time")
            if not decision.entries:
                if decision.doomed:
                    continue
                return
            self._send_batch(worker, model, decision.entries, decision.reason, now)

    def _send_batch(self, worker: WorkerState, model: CatalogModel, entries: list[Entry],
                    reason: str, now: float) -> None:
        version = entries[0].version
        assert version is not None
        items = [p.BatchItem(str(i), e.payload.request.tensors, e.payload.request.outputs)
                 for i, e in enumerate(entries)]  # open entries: their requests are held
        exec_s = model.config.dynamic_batching.max_execution_ms / 1000.0
        rec = self.pool.send_batch(worker, model.config.name, version, entries, items, reason,
                                   now, exec_s, model.config.decoupled,
                                   _batch_trace(entries, now))
        if rec is None:
            self.worker_lost(self.pool.remove(worker, Loss.UNREACHABLE), Loss.UNREACHABLE,
                             worker.worker_id, now)
            self._requeue(entries, f"worker {worker.worker_id} is unreachable", now)
            return
        self._last_used[model.config.name] = now
        if rec.stream:
            self.streams_started(rec)
        self.metrics.batch_sent(model.config.name, reason, rec.samples)
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
    def _close(self, key: Key) -> bool:
        """Mark a request answered; False if it already was (then send nothing)."""
        if self._open.pop(key, None) is None:
            return False
        if self.streams:
            self.streams.forget(key)
        self.tenancy.release(key)
        rids = self._by_client.get(key[0])
        if rids is not None:
            rids.discard(key[1])
            if not rids:
                del self._by_client[key[0]]
        return True

    def answer_error(self, entry: Entry, code: p.ErrorCode, message: str,
                     retry_after_s: float | None = None) -> None:
        if self.streams and self.streams.get(entry.key) is not None:
            self.metrics.stream_ended(entry.model, code.value)
        if not self._close(entry.key):
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
            if (client, rid) not in self._open:
                self.refuse(client, rid, code, message, model="")

    def fail_queued(self, model: str, code: p.ErrorCode, message: str) -> None:
        for entry in self.scheduler.drop_model(model):
            self.answer_error(entry, code, message)

    def fail_everything(self, code: p.ErrorCode, message: str) -> None:
        for name in list(self.scheduler.models_waiting()):
            self.fail_queued(name, code, message)
        for batch_id in list(self.pool.inflight):
            rec = self.pool.finish(batch_id)
            if rec is not None:
                self._fail_batch(rec, code, message)

    def reroute(self, name: str, gone: set[int]) -> None:
        """Queued requests for versions that left: unpinned ones follow the new default,
        pinned ones get not found."""
        if not gone:
            return
        for entry in self.scheduler.queued(name):
            if entry.version not in gone:
                continue
            if entry.payload.pinned:
                if self.scheduler.cancel(entry.key) is not None:
                    self.answer_error(entry, p.ErrorCode.NOT_FOUND,
                                      f"version {entry.version} of model {name!r} was retired")
            else:
                entry.version = None


def shape_class(cfg: ModelConfig, tensors: Sequence[p.Tensor]) -> tuple[Hashable, float]:
    """A request's shape key and scale (models/shapes.py); one test for a model of fixed
    shapes, the common case."""
    rule = shape_rule(cfg)
    if rule.fixed:
        return None, 1.0
    return rule.classify({t.meta.name: t.meta.shape for t in tensors})


def _batch_trace(entries: list[Entry], now: float) -> p.BatchTrace | None:
    """The traced requests of a batch; None (the common case) when none is."""
    traced = [(i, e.payload.request.trace, tracing.ns(e.arrival_s))
              for i, e in enumerate(entries) if e.payload.request.trace is not None]
    if not traced:
        return None
    return p.BatchTrace(tracing.boot_id(), tracing.ns(now), traced)
