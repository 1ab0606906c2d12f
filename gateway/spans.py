"""The gateway's spans in opentelemetry mode (imported only in that mode: it needs the
optional SDK through broker/otel.py): one SERVER span a traced request, a child of the
caller's context, whose own context goes on the wire so the worker's queue span is its
child (workers/spans.py)."""

from __future__ import annotations

import time
from typing import Mapping, Sequence

from zeroserve.broker import otel
from zeroserve.broker.traceconfig import OtelConfig
from zeroserve.broker.tracing import CORE_ORDER


class GatewaySpans:
    def __init__(self, config: OtelConfig) -> None:
        # the gateway samples before it starts a span: every span it starts is recorded
        self.exporter = otel.Exporter(config, "gateway", follow_parent=False)

    def start(self, model: str, caller: Mapping[str, str] | None, start_ns: int,
              protocol: str) -> tuple[otel.Span, dict[str, str]]:
        """The span of a request read from ``start_ns`` (monotonic), and the wire context
        that makes it the parent of what follows (the caller's tracestate kept)."""
        span = self.exporter.start(
            "gateway", caller, start_ns + otel.epoch_offset_ns(), otel.SpanKind.SERVER,
            {"zeroserve.model": model, "zeroserve.protocol": protocol})
        return span, otel.wire_context(span, (caller or {}).get("tracestate", ""))

    def end(self, span: otel.Span, stamps: Mapping[str, int], version: int,
            request_id: str, error: str,
            steps: Sequence[tuple[str, int, Mapping[str, int]]] = ()) -> None:
        """The span ends at its last stamp, the front end's own stamps (Triton's names)
        events on it. The broker's and worker's are the queue and batch spans' bounds
        already: as events too they cost the gateway about 50 µs a request more
        (measured in process: the span and its encoding, 11 events against 4)."""
        offset = otel.epoch_offset_ns()
        ordered = sorted(stamps.items(), key=lambda kv: kv[1])
        for name, value in ordered:
            if name not in CORE_ORDER:
                span.add_event(name, timestamp=value + offset)
        if version:
            span.set_attribute("zeroserve.model.version", version)
        if request_id:
            span.set_attribute("zeroserve.request_id", request_id)
        if error:
            span.set_status(otel.Status(otel.StatusCode.ERROR, error))
        self._steps(span, steps, offset)
        span.end(end_time=max(ordered[-1][1], time.monotonic_ns()) + offset)

    def _steps(self, span: otel.Span, steps: Sequence[tuple[str, int, Mapping[str, int]]],
               offset: int) -> None:
        """An ensemble's steps (broker/server/pipeline.py): one span each under the
        request's, from the step's first stamp to its last. The broker exports no span,
        so the gateway writes them from the stamps the pipeline's answer carries."""
        parent = otel.wire_context(span) if steps else {}
        for model, version, got in steps:
            if not got:
                continue
            child = self.exporter.start(
                "step", parent, min(got.values()) + offset, otel.SpanKind.INTERNAL,
                {"zeroserve.model": model, "zeroserve.model.version": version})
            child.end(end_time=max(got.values()) + offset)

    def close(self) -> None:
        self.exporter.close()
