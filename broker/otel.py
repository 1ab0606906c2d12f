"""OpenTelemetry's SDK as the gateway and the workers use it in opentelemetry mode
(``--trace-config mode=opentelemetry``): one tracer provider a process, whose spans a
batch span processor exports over OTLP/HTTP.

The SDK is an optional extra (``pip install 'zeroserve[otel]'``): only
:func:`zeroserve.broker.tracing.otel` imports this module, and only in opentelemetry
mode, so the other modes neither need it nor pay for its import. The broker never
imports it: it forwards trace contexts and stamps, and the workers emit the spans of
its queue (workers/spans.py).

What the ``opentelemetry,...`` entries leave unset, the SDK reads from its environment:
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (else ``OTEL_EXPORTER_OTLP_ENDPOINT`` +
``/v1/traces``, else ``http://localhost:4318/v1/traces``), ``OTEL_EXPORTER_OTLP_HEADERS``,
``_TIMEOUT`` and ``_COMPRESSION``, ``OTEL_BSP_*``, and the resource's
``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES``.
"""

from __future__ import annotations

import os
import time
from typing import Any, Mapping, Sequence

from opentelemetry import trace as api
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased
from opentelemetry.trace import Link, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from zeroserve.broker import __version__
from zeroserve.broker.traceconfig import OtelConfig

__all__ = ["Exporter", "Link", "SpanKind", "Status", "StatusCode"]

_PROPAGATOR = TraceContextTextMapPropagator()
Span = api.Span


def epoch_offset_ns() -> int:
    """What turns this host's monotonic stamps into the wall-clock times spans carry:
    the wall clock read between two monotonic reads, the closest of three pairs, so a
    process preempted between two reads (milliseconds on a loaded host) is not off by
    that much against the other processes' spans."""
    best, offset = -1, 0
    for _ in range(3):
        before = time.monotonic_ns()
        wall = time.time_ns()
        after = time.monotonic_ns()
        if best < 0 or after - before < best:
            best, offset = after - before, wall - (before + after) // 2
    return offset


def resource(config: OtelConfig, component: str, environ: Mapping[str, str]) -> Resource:
    """zeroserve's service name unless OTEL_SERVICE_NAME or OTEL_RESOURCE_ATTRIBUTES names
    one; the ``opentelemetry,resource=`` entries over both (a flag wins over the
    environment)."""
    attrs: dict[str, Any] = {"zeroserve.component": component}
    named = environ.get("OTEL_SERVICE_NAME") or \
        "service.name=" in environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    if not named:
        attrs["service.name"] = "zeroserve"
    attrs.update(dict(config.resource))
    return Resource.create(attrs)


class Exporter:
    """A process's tracer. ``follow_parent``: a span whose parent is unsampled is not
    recorded (the workers, whose callers decided); else every span started is (the
    gateway, which samples before it starts one)."""

    def __init__(self, config: OtelConfig, component: str, follow_parent: bool) -> None:
        self.provider = TracerProvider(
            sampler=ParentBased(ALWAYS_ON) if follow_parent else ALWAYS_ON,
            resource=resource(config, component, os.environ), shutdown_on_exit=False)
        self.provider.add_span_processor(BatchSpanProcessor(
            OTLPSpanExporter(endpoint=config.url),
            max_queue_size=config.bsp_max_queue_size,
            schedule_delay_millis=config.bsp_schedule_delay_ms,
            max_export_batch_size=config.bsp_max_export_batch_size))
        self.tracer = self.provider.get_tracer("zeroserve", __version__)

    def start(self, name: str, parent: Mapping[str, str] | None, start_ns: int,
              kind: SpanKind = SpanKind.INTERNAL, attributes: Mapping[str, Any] | None = None,
              links: Sequence[Link] = ()) -> Span:
        """A span from ``start_ns`` (wall clock), child of the W3C context ``parent``
        (a wire trace field) or a root without one."""
        context = _PROPAGATOR.extract(dict(parent)) if parent else None
        return self.tracer.start_span(name, context=context, kind=kind, attributes=attributes,
                                      links=links, start_time=start_ns)

    def close(self) -> None:
        """Export what is queued (bounded by the exporter's timeout), then stop."""
        self.provider.shutdown()


def wire_context(span: Span, tracestate: str = "") -> dict[str, str]:
    """The trace field for the requests ``span`` makes: it is their parent."""
    ctx = span.get_span_context()
    out = {"traceparent": f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-"
                          f"{int(ctx.trace_flags):02x}"}
    if tracestate:
        out["tracestate"] = tracestate
    return out
