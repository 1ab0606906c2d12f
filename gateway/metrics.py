"""The gateway's own metrics and the one scrape that covers every process.

How one scrape gathers everything: each worker renders its registry into every
heartbeat; the broker keeps the latest text per worker and answers the control
verb ``metrics`` with ``{"broker": text, "workers": {id: text}}``. ``GET /metrics``
on any gateway asks the broker for that, parses every text, labels each series with
``component`` (gateway | broker | worker) and ``instance`` (gateway host:pid, broker
host:pid, worker id) and writes one HELP/TYPE per family. Gateway processes of a
host share prometheus_client's multiprocess mode when ``PROMETHEUS_MULTIPROC_DIR``
is set (their series are then summed, with the host as instance).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any, Awaitable, Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.process_collector import ProcessCollector
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from zeroserve.broker.client import InferError

logger = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
MULTIPROC = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))

REGISTRY = CollectorRegistry(auto_describe=True)
if not MULTIPROC:  # in multiprocess mode the process collector cannot aggregate
    ProcessCollector(namespace="zeroserve", registry=REGISTRY)
HTTP_REQUESTS = Counter("http_requests", "HTTP requests answered by the gateway",
                        ["route", "method", "status"], namespace="zeroserve",
                        registry=REGISTRY)
HTTP_SECONDS = Histogram("http_request_seconds", "HTTP request time in the gateway, "
                         "first byte in to last byte out", ["route", "method"],
                         namespace="zeroserve", registry=REGISTRY,
                         buckets=(.0005, .001, .002, .005, .01, .02, .05, .1, .2, .5, 1, 2,
                                  5, 10, 30))

GRPC_REQUESTS = Counter("grpc_requests", "gRPC calls answered by the gateway (a stream "
                        "counts once, when it ends)", ["method", "code"],
                        namespace="zeroserve", registry=REGISTRY)
GRPC_SECONDS = Histogram("grpc_request_seconds", "gRPC call time in the gateway, from "
                         "the request decoded to the answer handed to gRPC", ["method"],
                         namespace="zeroserve", registry=REGISTRY,
                         buckets=(.0005, .001, .002, .005, .01, .02, .05, .1, .2, .5, 1, 2,
                                  5, 10, 30))


class _HttpMetrics:
    """Pure ASGI middleware (no BaseHTTPMiddleware: it would buffer bodies). The route
    label is the matched path template, so model names do not explode cardinality."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            HTTP_REQUESTS.labels(route, scope["method"], str(status)).inc()
            HTTP_SECONDS.labels(route, scope["method"]).observe(time.perf_counter() - start)


def middleware() -> Middleware:
    return Middleware(_HttpMetrics)


def gateway_text() -> str:
    if MULTIPROC:
        registry = CollectorRegistry()
        MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        return generate_latest(registry).decode()
    return generate_latest(REGISTRY).decode()


def _labelled(text: str, component: str, instance: str) -> Iterator[Metric]:
    for family in text_string_to_metric_families(text):
        if family.name.endswith("_created"):
            continue  # creation stamps double the scrape and no dashboard reads them
        for sample in family.samples:
            labels = sample.labels
            labels.setdefault("component", component)
            labels.setdefault("instance", instance)
        yield family


class _Merged:
    """A collector over already-parsed families, so generate_latest does the escaping."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self.families


def merge(sources: Iterable[tuple[str, str, str]]) -> str:
    """Merge (component, instance, text) exposition texts into one, one family each."""
    families: dict[str, Metric] = {}
    for component, instance, text in sources:
        try:
            parsed = list(_labelled(text, component, instance))
        except ValueError as exc:  # one bad text must not cost the whole scrape
            logger.warning("unparsable metrics from %s %s: %s", component, instance, exc)
            continue
        for family in parsed:
            seen = families.get(family.name)
            if seen is None:
                families[family.name] = family
            elif seen.type == family.type:
                seen.samples.extend(family.samples)
            else:
                logger.warning("metric %s is a %s in %s but a %s elsewhere; dropped there",
                               family.name, family.type, component, seen.type)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(families.values()))
    return generate_latest(registry).decode()


def _instance() -> str:
    return socket.gethostname() if MULTIPROC else f"{socket.gethostname()}:{os.getpid()}"


def _broker_up(up: bool) -> str:
    # set by the scrape itself: the broker's own series vanish when it is down, so only
    # the gateway can say so (alert ZeroserveBrokerUnreachable)
    return ("# HELP zeroserve_gateway_broker_up 1 if this scrape reached the broker\n"
            "# TYPE zeroserve_gateway_broker_up gauge\n"
            f"zeroserve_gateway_broker_up {1 if up else 0}\n")


class Scrape:
    """``GET /metrics``: the gateway's series, then the broker's and every worker's.
    With the broker unreachable the scrape still answers, with the gateway's alone."""

    def __init__(self, control: Callable[..., Awaitable[Any]]) -> None:
        self.control = control

    async def endpoint(self, request: Request) -> Response:
        sources = []
        try:
            got: dict[str, Any] = await self.control("metrics")
        except InferError as exc:
            logger.warning("metrics from the broker unavailable: %s", exc.message)
            got = {}
        if got:
            broker_instance = str(got.get("instance") or "broker")
            sources.append(("broker", broker_instance, str(got.get("broker", ""))))
            for worker_id, text in sorted((got.get("workers") or {}).items()):
                if text:
                    sources.append(("worker", str(worker_id), str(text)))
        sources.insert(0, ("gateway", _instance(), gateway_text() + _broker_up(bool(got))))
        return Response(merge(sources), 200, media_type=CONTENT_TYPE)
