"""The inference fast path: ``POST /v2/models/{m}[/versions/{v}]/infer`` from uvicorn
straight to :class:`~zeroserve.gateway.routes.infer.InferEndpoint`, around Starlette's
middleware stack and router; everything else goes through the Starlette app.

Measured with py-spy under load at C=64 on ``mlp``: the middleware layers, routing
and exception wrappers took about 40% of the gateway's CPU per inference. The
endpoint is the same object the app's route calls, so there is one implementation
of infer; this module only routes and records the HTTP metrics (the middleware
records them on the other way in, never both).
"""

from __future__ import annotations

import re
import time
from typing import Any

from starlette.applications import Starlette
from starlette.types import Receive, Scope, Send

from zeroserve.gateway.routes.infer import STATUS_KEY, InferEndpoint
from zeroserve.gateway.metrics import HTTP_REQUESTS, HTTP_SECONDS

INFER = re.compile(r"^/v2/models/(?P<name>[^/]+)(?:/versions/(?P<version>[^/]+))?/infer$")
ROUTE = {False: "/v2/models/{name}/infer", True: "/v2/models/{name}/versions/{version}/infer"}


class InferFastPath:
    def __init__(self, app: Starlette) -> None:
        self.app = app
        self.endpoint: InferEndpoint = app.state.infer
        self._counters: dict[tuple[bool, int], Any] = {}   # labels() costs a lock a call
        self._timers = {v: HTTP_SECONDS.labels(r, "POST") for v, r in ROUTE.items()}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        match = INFER.match(scope["path"]) if scope["type"] == "http" and \
            scope["method"] == "POST" else None
        if match is None:
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        name, version = match.group("name", "version")
        scope["path_params"] = {"name": name} if version is None else \
            {"name": name, "version": version}
        scope["app"] = self.app
        try:
            await self.endpoint(scope, receive, send)
        finally:
            pinned = version is not None
            status = scope.get(STATUS_KEY, 500)
            counter = self._counters.get((pinned, status))
            if counter is None:
                counter = self._counters[pinned, status] = HTTP_REQUESTS.labels(
                    ROUTE[pinned], "POST", str(status))
            counter.inc()
            self._timers[pinned].observe(time.perf_counter() - start)
