"""The request path's part for decoupled models: responses forwarded as they arrive.

A worker running a stream batch sends a PARTIAL for each yield of the model's
generator (for an iterative model's step, a STEPS holding several batches' PARTIALs);
each part is forwarded at once to its client as a PARTS message, numbered
per request (``index``), and the part marked final answers its request: it closes
the request's key as a reply does, so "exactly one final answer per request" holds
for streams too, and a part that arrives for a request answered meanwhile (cancelled,
timed out, its worker presumed dead) is dropped. The batch's RESULT, sent when the
generator ends, gives each stream still open an empty final response, or the error.

A stream answered early (its client cancelled or went away, or its deadline passed
before its first response) is stopped at its worker: STOP names the batch item, and
the worker closes the generator at its next yield once no item of the batch is left,
which frees its slot. The deadline bounds the first response only, and
``max_execution_ms`` the time between two responses (a generation may run long).

The composition root gives it the one answer ledger, so the books are the same as for
unary requests; what is retried or failed whole goes back through the request path's
answering (:class:`BatchAnswers`, implemented by answering.py).
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

from zeroserve.broker import protocol as p
from zeroserve.broker.server.catalog import Catalog
from zeroserve.broker.server.ledger import AnswerLedger, Key
from zeroserve.broker.server.metrics import BrokerMetrics
from zeroserve.broker.server.pool import Batches, Inflight, WorkerState
from zeroserve.broker.server.scheduler import Entry
from zeroserve.broker.server.stats import ModelStatistics
from zeroserve.broker.server.streams import StreamState, Streams

Parts = dict[bytes, list[p.StreamPart]]


class BatchAnswers(Protocol):
    """What the stream path asks of the request path for a whole batch or entry."""

    def answer_error(self, entry: Entry, code: p.ErrorCode, message: str,
                     retry_after_s: float | None = None) -> None: ...

    def requeue(self, entries: list[Entry], why: str, now: float,
                spend: bool = True) -> None: ...

    def fail_batch(self, rec: Inflight, code: p.ErrorCode, message: str) -> None: ...


class StreamPath:
    def __init__(self, streams: Streams, batches: Batches, catalog: Catalog,
                 metrics: BrokerMetrics, stats: ModelStatistics, ledger: AnswerLedger,
                 reply: Callable[[bytes, list[Any]], bool], answers: BatchAnswers) -> None:
        self.streams = streams
        self.batches = batches
        self.catalog = catalog
        self.metrics = metrics
        self.stats = stats
        self.ledger = ledger
        self._reply = reply
        self._answers = answers

    # -- dispatch -------------------------------------------------------------
    def streams_started(self, rec: Inflight) -> None:
        for item, entry in rec.entries.items():
            self.streams.started(entry.key, StreamState(
                rec.batch_id, item, rec.worker, entry.deadline_s, rec.model, entry.arrival_s))

    # -- responses ------------------------------------------------------------
    def on_partial(self, worker: WorkerState, header: dict[str, Any], bufs: Sequence[Any],
                   now: float) -> None:
        rec = self._running(worker, p.result_batch_id(header))
        if rec is None:
            return   # no longer ours (answered, or its worker presumed lost): dropped
        try:
            msg = p.decode_partial(header, bufs)
        except p.ProtocolError as exc:
            self._malformed(rec, exc)
            raise
        out: Parts = {}
        self._forward(rec, msg, now, out)
        self._send_parts(out)

    def on_steps(self, worker: WorkerState, header: dict[str, Any], bufs: Sequence[Any],
                 now: float) -> None:
        """One step of an iterative model: several batches' responses, forwarded to each
        client in as few messages as the protocol allows."""
        try:
            msgs = p.decode_steps(header, bufs)
        except p.ProtocolError as exc:
            for batch_id in p.steps_batch_ids(header):
                rec = self._running(worker, batch_id)
                if rec is not None:
                    self._malformed(rec, exc)
            raise
        out: Parts = {}
        for msg in msgs:
            rec = self._running(worker, msg.batch_id)
            if rec is not None:
                self._forward(rec, msg, now, out)
        self._send_parts(out)

    def _running(self, worker: WorkerState, batch_id: int) -> Inflight | None:
        rec = self.batches.inflight.get(batch_id)
        if rec is None or not rec.stream or rec.worker != worker.identity:
            return None
        return rec

    def _malformed(self, rec: Inflight, exc: p.ProtocolError) -> None:
        items = list(rec.entries)
        self._answers.fail_batch(rec, p.ErrorCode.INTERNAL,
                                 f"worker sent a malformed response: {exc}")
        self.batches.stop(rec.worker, rec.batch_id, items)

    def _forward(self, rec: Inflight, msg: p.Partial, now: float, out: Parts) -> None:
        model = self.catalog.get(rec.model)
        exec_ms = model.config.dynamic_batching.max_execution_ms if model is not None else 0
        self.batches.progressed(rec.batch_id, now, exec_ms / 1000.0)
        for part in msg.parts:
            entry = rec.entries.get(part.item)
            if entry is None:
                continue   # answered already (cancelled, late), or an item it never had
            if part.final:
                del rec.entries[part.item]
            self._respond(out, rec, entry, part.final, part.tensors, now)

    def stream_result(self, worker: WorkerState, rec: Inflight, result: p.BatchResult,
                      now: float) -> None:
        """The generator ended (or raised): each stream still open ends now."""
        self.metrics.batch_done(rec.model, rec.samples, result.compute_ms / 1000.0,
                                result.phases_ms)
        self.stats.batch_done(rec.model, rec.version, rec.samples, result.phases_ms,
                              result.compute_ms)
        if result.error is not None:
            if result.retry:
                self._answers.requeue(list(rec.entries.values()), result.error, now)
            else:
                code = p.ErrorCode.DEADLINE if result.expired else p.ErrorCode.MODEL_ERROR
                self._answers.fail_batch(rec, code, result.error)
            return
        out: Parts = {}
        for entry in rec.entries.values():   # what the model never marked final
            self._respond(out, rec, entry, True, [], now)
        rec.entries.clear()
        self._send_parts(out)

    def _respond(self, out: Parts, rec: Inflight, entry: Entry, final: bool,
                 tensors: Sequence[p.Tensor], now: float) -> None:
        state = self.streams.get(entry.key)
        if state is None or state.batch_id != rec.batch_id:
            return
        index, gap_s = self.streams.responded(state, entry.key, now)
        self.metrics.stream_response(rec.model, entry.tenant, index, gap_s)
        pl = entry.payload
        stats: dict[str, float] = {}
        if final:
            if not self.ledger.close(entry.key):
                return
            queue_s, total_s = rec.sent_s - entry.arrival_s, now - entry.arrival_s
            self.metrics.requests_done(rec.model, rec.version, (total_s,))
            self.metrics.stream_ended(rec.model, "ok")
            self.stats.request_done(rec.model, rec.version, queue_s, total_s, {}, 0.0)
            stats = {"queue_ms": queue_s * 1000.0, "batch_size": rec.samples,
                     "responses": index + 1, **pl.notes}
            pl.release()
        out.setdefault(pl.client, []).append(p.StreamPart(
            pl.request_id, rec.model, rec.version, index, final, tensors, stats,
            self.catalog.build(rec.model, rec.version)))

    def _send_parts(self, out: Parts) -> None:
        sent: dict[str, int] = {}
        for client, parts in out.items():
            for i in range(0, len(parts), p.MAX_BUNDLE):
                self._reply(client, p.encode_parts(parts[i:i + p.MAX_BUNDLE]))
            for part in parts:
                sent[part.model] = sent.get(part.model, 0) + 1
        for model, n in sent.items():
            self.metrics.stream_responses_sent(model, n)

    # -- ended early ----------------------------------------------------------
    def stop_stream(self, key: Key, code: p.ErrorCode, message: str) -> bool:
        """Answer a running stream now and stop it at its worker; False if it is not
        running (then there is nothing to stop)."""
        state = self.streams.get(key)
        if state is None:
            return False
        rec = self.batches.inflight.get(state.batch_id)
        entry = rec.entries.pop(state.item, None) if rec is not None else None
        if entry is None:
            self.streams.forget(key)
            return False
        self._answers.answer_error(entry, code, message)
        self.batches.stop(state.worker, state.batch_id, [state.item])
        return True

    def expire_streams(self, now: float) -> None:
        for key in self.streams.late(now):
            self.stop_stream(key, p.ErrorCode.DEADLINE,
                             "deadline exceeded before the first response")
