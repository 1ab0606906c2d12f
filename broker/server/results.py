"""The request path's results: a worker's RESULT answers its batch's requests (or, for
a stream batch, ends the streams, streampath.py); a batch the model failed counts
against its circuit breaker or its rollout; batches past their time fail, and those
stuck behind a hung one move. Each reply closes its request's key in the answer ledger
before it is sent, so a late result finds it closed and sends nothing."""

from __future__ import annotations

import logging
from typing import Any, Sequence

from zeroserve.broker import protocol as p, tracing
from zeroserve.broker.server.admission import Payload, warmup_scale
from zeroserve.broker.server.answering import Answering
from zeroserve.broker.server.breaker import Breakers
from zeroserve.broker.server.cachepath import CachedAnswers
from zeroserve.broker.server.catalog import Catalog
from zeroserve.broker.server.forecast import Forecast
from zeroserve.broker.server.latency import LatencyBook
from zeroserve.broker.server.ledger import AnswerLedger
from zeroserve.broker.server.metrics import BrokerMetrics
from zeroserve.broker.server.pool import Batches, Inflight, WorkerPool, WorkerState
from zeroserve.broker.server.releases import Releases
from zeroserve.broker.server.scheduler import Scheduler
from zeroserve.broker.server.stats import ModelStatistics
from zeroserve.broker.server.streampath import StreamPath
from zeroserve.broker.server.tenancy import Tenancy
from zeroserve.broker.server.types import Send

logger = logging.getLogger(__name__)


class Results:
    def __init__(self, catalog: Catalog, pool: WorkerPool, batches: Batches,
                 ledger: AnswerLedger,
                 answering: Answering, streaming: StreamPath, answers: CachedAnswers,
                 latency: LatencyBook, forecast: Forecast, breakers: Breakers,
                 releases: Releases | None, stats: ModelStatistics, metrics: BrokerMetrics,
                 reply: Send, *, scheduler: Scheduler, tenancy: Tenancy) -> None:
        self.catalog = catalog
        self.pool = pool
        self.batches = batches
        self.ledger = ledger
        self.answering = answering
        self.streaming = streaming
        self.answers = answers
        self.latency = latency
        self.forecast = forecast
        self.breakers = breakers
        self.releases = releases   # rollouts: told what versions answer
        self.stats = stats
        self.scheduler = scheduler   # a batch's measured time: its tenants' fair shares
        self.tenancy = tenancy       # and compute quotas
        self.metrics = metrics
        self._reply = reply

    def on_result(self, worker: WorkerState, header: dict[str, Any], bufs: Sequence[Any],
                  now: float) -> None:
        rec = self.batches.finish(p.result_batch_id(header))
        if rec is None:
            return  # already answered or retried (its worker was lost, or it timed out)
        try:
            result = p.decode_result(header, bufs, rec.model, rec.version)
        except p.ProtocolError as exc:
            self.answering.fail_batch(rec, p.ErrorCode.INTERNAL,
                                      f"worker sent a malformed result: {exc}")
            raise
        try:
            self._answer_batch(worker, rec, result, now)
        except Exception as exc:
            # out of the in-flight table, the batch's requests have no other way to an answer
            self.answering.fail_batch(rec, p.ErrorCode.INTERNAL, f"internal error on the batch's "
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
                self.answering.requeue(list(rec.entries.values()), result.error, now)
            elif self.releases is not None and rec.model in self.releases.watched:
                self._canary_failed(rec, result, now)
            else:
                code = p.ErrorCode.DEADLINE if result.expired else p.ErrorCode.MODEL_ERROR
                self.answering.fail_batch(rec, code, result.error)
            return
        compute_s = result.compute_ms / 1000.0
        self.latency.observe(rec.model, worker.worker_id, rec.units, compute_s)
        if self.tenancy.enabled:   # without tenants no share is kept, and nothing is spent
            self.tenancy.used(self.scheduler.used(rec.model, rec.entries.values(), compute_s),
                              now)
        self.metrics.batch_done(rec.model, rec.samples, compute_s, result.phases_ms)
        self.stats.batch_done(rec.model, rec.version, rec.samples, result.phases_ms,
                              result.compute_ms)
        build = self.catalog.build(rec.model, rec.version)
        bundles: dict[bytes, list[tuple[dict[str, Any], list[Any]]]] = {}
        totals_s: list[float] = []   # the metrics and statistics take the batch's at once
        queued_s = 0.0
        # a model with a free length: the tokens its batch computed, padding included
        longest = 0   # a loop: max over a generator with a default costs us, every batch
        for e in rec.entries.values():
            longest = e.length if e.length > longest else longest
        # the stats every reply of the batch carries, made once a batch
        shared: dict[str, float] = {"compute_ms": result.compute_ms, "batch_size": rec.samples}
        if longest:
            shared["batch_tokens"] = rec.samples * longest
        for rep in result.replies:
            entry = rec.entries.get(rep.request_id)
            if entry is None or not self.ledger.is_open(entry.key):
                continue
            pl: Payload = entry.payload
            queue_s = rec.sent_s - entry.arrival_s
            totals_s.append(now - entry.arrival_s)
            queued_s += queue_s
            stats = {"queue_ms": queue_s * 1000.0, **shared, **pl.notes}
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
        if rec.entries:
            self.answering.fail_batch(rec, p.ErrorCode.INTERNAL, "worker returned no output")

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
            self.answering.requeue(again, result.error, now, version=target)
            taken = {id(e) for e in again}
            entries = [e for e in entries if id(e) not in taken]   # the model's error
        code = p.ErrorCode.DEADLINE if result.expired else p.ErrorCode.MODEL_ERROR
        for entry in entries:
            self.answering.answer_error(entry, code, result.error)
        rec.entries.clear()

    def _send_replies(self, client: bytes, parts: list[tuple[dict[str, Any], list[Any]]]
                      ) -> None:
        """A batch's replies to one client in as few messages as the protocol allows: a
        message sent costs the broker more than the bytes in it."""
        for i in range(0, len(parts), p.MAX_BUNDLE):
            self._reply(client, p.encode_reply_parts(parts[i:i + p.MAX_BUNDLE]))

    def overdue(self, now: float) -> list[bytes]:
        """Batches past max_execution_ms fail (504, never retried elsewhere); returns the
        identities of their workers, which are hung and must go."""
        hung = []
        for rec in self.batches.overdue(now):
            worker = self.pool.get(rec.worker)
            # one that waits on the models its handler called is off the worker's compute
            # thread: it fails alone, the worker is not hung (workers/bls.py)
            waiting = worker is not None and rec.batch_id in worker.waiting
            self.batches.finish(rec.batch_id)
            self.answering.fail_batch(rec, p.ErrorCode.DEADLINE,
                            f"batch ran past max_execution_ms of model {rec.model!r}"
                            + (" waiting on the models it called" if waiting else ""))
            if not waiting:
                hung.append(rec.worker)
        return hung

    def move_stalled(self, now: float) -> None:
        """Batches queued behind a hung one go back to the queue; they never ran, so this
        spends none of their one retry."""
        for worker, behind in self.batches.stalled(now, self.forecast.stall_limit_s):
            logger.warning("worker %s: its running batch overran its prediction; %d batch(es) "
                           "queued behind it move to other workers", worker.worker_id,
                           len(behind))
            for rec in behind:
                self.answering.requeue(list(rec.entries.values()), f"worker {worker.worker_id} is "
                              "stuck on an earlier batch", now, spend=False)

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
