"""The inference fast path: ``POST /v2/models/{m}[/versions/{v}]/infer`` from uvicorn
straight to :class:`~zeroserve.gateway.routes.infer.InferEndpoint`, around Starlette's
middleware stack and router; everything else goes through the Starlette app.

Measured with py-spy under load at C=64 on ``mlp``: the middleware layers, routing
and exception wrappers took about 40% of the gateway's CPU per inference. The
endpoint is the same object the app's route calls, so there is one implementation
of infer; this module only routes and records the HTTP metrics (the middleware
records them on the other way in, never both).

uvicorn's proxy headers (``X-Forwarded-For`` and ``-Proto`` from a trusted address,
``FORWARDED_ALLOW_IPS``) are applied here rather than by uvicorn around the whole app
(``serve`` turns uvicorn's off): every other route and an infer request that carries
one of them goes through uvicorn's own middleware, as before; an infer request without
them skips its layer (a coroutine, the trusted-address check and a pass over the
headers: 1.3-1.5% of the gateway's busy samples at C=64).
"""

from __future__ import annotations

import os
import re
import time
from typing import Any

from starlette.applications import Starlette
from starlette.types import Receive, Scope, Send
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from zeroserve.gateway.routes.infer import STATUS_KEY, InferEndpoint
from zeroserve.gateway.metrics import HTTP_REQUESTS, HTTP_SECONDS

INFER = re.compile(r"^/v2/models/(?P<name>[^/]+)(?:/versions/(?P<version>[^/]+))?/infer$")
ROUTE = {False: "/v2/models/{name}/infer", True: "/v2/models/{name}/versions/{version}/infer"}
FORWARDED = (b"x-forwarded-for", b"x-forwarded-proto")   # what uvicorn's middleware reads


def forwarded_allow_ips() -> str:
    """Whom uvicorn trusts for proxy headers by default (its Config's own default)."""
    return os.environ.get("FORWARDED_ALLOW_IPS", "127.0.0.1,::1")


class InferFastPath:
    """``trusted_hosts``: as uvicorn's ``forwarded_allow_ips``; None for an app whose
    server applies the proxy headers itself (or where none are wanted)."""

    def __init__(self, app: Starlette, trusted_hosts: str | None = None) -> None:
        self.app = app
        self.endpoint: InferEndpoint = app.state.infer
        self._counters: dict[tuple[bool, int], Any] = {}   # labels() costs a lock a call
        self._timers = {v: HTTP_SECONDS.labels(r, "POST") for v, r in ROUTE.items()}
        self._other: Any = app
        self._proxied_infer: Any = None
        if trusted_hosts is not None:
            self._other = ProxyHeadersMiddleware(app, trusted_hosts)  # type: ignore[arg-type]
            self._proxied_infer = ProxyHeadersMiddleware(self._infer,  # type: ignore[arg-type]
                                                         trusted_hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        match = INFER.match(scope["path"]) if scope["type"] == "http" and \
            scope["method"] == "POST" else None
        if match is None:
            await self._other(scope, receive, send)
            return
        name, version = match.group("name", "version")
        scope["path_params"] = {"name": name} if version is None else \
            {"name": name, "version": version}
        scope["app"] = self.app
        if self._proxied_infer is not None:
            for header, _ in scope["headers"]:
                if header in FORWARDED:
                    await self._proxied_infer(scope, receive, send)
                    return
        # the endpoint called here rather than through _infer: one coroutine less
        start = time.perf_counter()
        try:
            await self.endpoint(scope, receive, send)
        finally:
            self._record(scope, start)

    async def _infer(self, scope: Scope, receive: Receive, send: Send) -> None:
        start = time.perf_counter()
        try:
            await self.endpoint(scope, receive, send)
        finally:
            self._record(scope, start)

    def _record(self, scope: Scope, start: float) -> None:
        pinned = "version" in scope["path_params"]
        status = scope.get(STATUS_KEY, 500)
        counter = self._counters.get((pinned, status))
        if counter is None:
            counter = self._counters[pinned, status] = HTTP_REQUESTS.labels(
                ROUTE[pinned], "POST", str(status))
        counter.inc()
        self._timers[pinned].observe(time.perf_counter() - start)
