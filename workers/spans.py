"""A worker's spans in opentelemetry mode: each traced request's queue span and one
span per batch that links them all.

The worker emits them because it is the one process that sees a batch whole, once:
the broker stays free of the SDK (it only adds its stamps to a traced batch,
``protocol.BatchTrace``), and the front ends see one request each. A request's queue
span is a child of its wire context (the gateway's span, or a direct client's own) and
runs from the broker's receipt to the batch's departure, on the broker's clock (moved
onto this one when the broker runs on another host: the batch left when it was taken
up here). The batch span is a root of its own trace, as a batch serves several, with a
link to each queue span. The callers decided the sampling: a request whose context is
unsampled gets no span, and a batch none of whose requests is sampled gets none.

A request of an iterative model (workers/sequences.py) is a sequence, whose time the
queue span does not tell: its trace gets a ``sequence`` span beside its queue span, from
the worker's receipt of its join to the step it left at, with three children: ``wait``
(for the step running to end, and for a free slot), ``prefill`` (the handler's ``join``) and
``steps`` (its first response to its last; the steps it answered and the times it was
paused as attributes, not a span a token).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from zeroserve.broker import otel, protocol as p, tracing

if TYPE_CHECKING:
    from zeroserve.workers.sequences import Timeline


class BatchSpans:
    def __init__(self, exporter: otel.Exporter, worker_id: str) -> None:
        self.exporter = exporter
        self.worker_id = worker_id

    def emit(self, batch: p.Batch, result: p.BatchResult, start_ns: int, end_ns: int
             ) -> None:
        """The spans of ``batch``, taken up at ``start_ns`` and done at ``end_ns`` (this
        host's monotonic clock)."""
        bt = batch.trace
        if bt is None:
            return
        offset = otel.epoch_offset_ns()
        shift = offset + (0 if bt.boot == tracing.boot_id() else start_ns - bt.sent_ns)
        model = {"zeroserve.model": batch.model, "zeroserve.model.version": batch.version,
                 "zeroserve.batch.id": batch.batch_id}
        links = []
        for index, context, arrival_ns in bt.items:
            span = self.exporter.start("queue", context, arrival_ns + shift, attributes=model)
            if span.is_recording():
                links.append(otel.Link(span.get_span_context(),
                                       {"zeroserve.batch.item": index}))
            span.end(end_time=bt.sent_ns + shift)
        if not links:
            return
        attrs: dict[str, Any] = {**model, "zeroserve.batch.requests": len(batch.items),
                                 "zeroserve.worker": self.worker_id}
        stamps: dict[str, int] = result.trace["ns"] if result.trace is not None else {}
        if result.trace is not None and "tokens" in result.trace:
            attrs["zeroserve.batch.tokens"] = result.trace["tokens"]
        # run: from COMPUTE_START to COMPUTE_END, the stamps between as events; else
        # (expired, not loaded, the model raised) from its taking up to its answer
        span = self.exporter.start("batch", None, stamps.get("COMPUTE_START", start_ns)
                                   + offset, attributes=attrs, links=links)
        for name in ("COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START"):
            if name in stamps:
                span.add_event(name, timestamp=stamps[name] + offset)
        if result.error is not None:
            span.set_status(otel.Status(otel.StatusCode.ERROR, result.error))
        span.end(end_time=stamps.get("COMPUTE_END", end_ns) + offset)

    def sequences(self, batch: p.Batch, timelines: Mapping[str, Timeline]) -> None:
        """Each traced sequence's spans of an iterative join (this host's clock): a
        ``sequence`` span under the request's context, its ``wait``, ``prefill`` and
        ``steps`` under it."""
        bt = batch.trace
        if bt is None:
            return
        offset = otel.epoch_offset_ns()
        for index, context, _ in bt.items:
            t = timelines.get(batch.items[index].request_id)
            if t is None:
                continue
            prefilled = t.prefilled_ns or t.end_ns   # a join that raised never returned
            first = t.first_ns or t.end_ns
            ms = 1e-6
            attrs: dict[str, Any] = {
                "zeroserve.model": batch.model, "zeroserve.model.version": batch.version,
                "zeroserve.batch.id": batch.batch_id,
                "zeroserve.sequence.wait_ms": (t.prefill_ns - t.received_ns) * ms,
                "zeroserve.sequence.waited_steps": t.waited_steps,
                "zeroserve.sequence.prefill_ms": (prefilled - t.prefill_ns) * ms,
                "zeroserve.sequence.first_response_ms": (first - t.received_ns) * ms,
                "zeroserve.sequence.steps": t.steps,
                "zeroserve.sequence.paused": t.paused}
            span = self.exporter.start("sequence", context, t.received_ns + offset,
                                       attributes=attrs)
            if not span.is_recording():
                continue
            parent = otel.wire_context(span)
            for name, start, end, more in (
                    ("wait", t.received_ns, t.prefill_ns, {}),
                    ("prefill", t.prefill_ns, prefilled, {}),
                    ("steps", first, t.end_ns, {"zeroserve.sequence.steps": t.steps,
                                                "zeroserve.sequence.paused": t.paused})):
                self.exporter.start(name, parent, start + offset,
                                    attributes=more).end(end_time=end + offset)
            span.end(end_time=t.end_ns + offset)

    def close(self) -> None:
        self.exporter.close()
