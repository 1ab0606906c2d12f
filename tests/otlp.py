"""A real OTLP/HTTP trace receiver for the tests and benchmarks of opentelemetry mode:
an HTTP server on loopback that decodes each ``ExportTraceServiceRequest`` posted to
/v1/traces with opentelemetry-proto and keeps its spans."""

from __future__ import annotations

import gzip
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as trace_service

from tests.conftest import free_port


@dataclass(frozen=True)
class Span:
    name: str
    trace_id: str
    span_id: str
    parent: str
    kind: int
    links: tuple[tuple[str, str], ...]   # (trace id, span id)
    attributes: dict[str, Any]
    events: tuple[str, ...]
    start_ns: int
    end_ns: int
    resource: dict[str, Any]


def _value(v: Any) -> Any:
    return getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None


class Receiver:
    """An OTLP/HTTP trace receiver: every span posted to /v1/traces, decoded."""

    def __init__(self, keep: bool = True) -> None:
        self.keep = keep   # False: count the spans only (benchmarks)
        self.count = 0
        self.spans: list[Span] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                ok = self.path == "/v1/traces" and \
                    self.headers.get("Content-Type") == "application/x-protobuf"
                if ok:
                    request = trace_service.ExportTraceServiceRequest()
                    request.ParseFromString(body)
                    receiver.add(request)
                answer = trace_service.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if ok else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self.port = free_port()
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def add(self, request: Any) -> None:
        if not self.keep:
            with self.lock:
                self.count += sum(len(ss.spans) for rs in request.resource_spans
                                  for ss in rs.scope_spans)
            return
        got = []
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(Span(
                        s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                        s.kind, tuple((ln.trace_id.hex(), ln.span_id.hex()) for ln in s.links),
                        {a.key: _value(a.value) for a in s.attributes},
                        tuple(e.name for e in s.events), s.start_time_unix_nano,
                        s.end_time_unix_nano, resource))
        with self.lock:
            self.spans.extend(got)
            self.count += len(got)

    def of_trace(self, trace_id: str) -> list[Span]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def batches_linking(self, trace_id: str) -> list[Span]:
        with self.lock:
            return [s for s in self.spans if s.name == "batch"
                    and any(t == trace_id for t, _ in s.links)]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


def traced_serve_flags(port: int) -> list[str]:
    """`zeroserve serve` flags that trace every request, with timestamps, to a receiver
    listening on ``port`` (the benches that cut a request's time into legs)."""
    return ["--trace-config", "mode=opentelemetry", "--trace-config", "rate=1",
            "--trace-config", "level=TIMESTAMPS", "--trace-config",
            f"opentelemetry,url=127.0.0.1:{port}/v1/traces"]
