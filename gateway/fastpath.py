"""The inference fast path: ``POST /v2/models/{m}[/versions/{v}]/infer`` straight to
the handler, around Starlette's middleware stack and router.

Measured with py-spy under wrk at C=64 on ``mlp``: the middleware layers, routing
and exception wrappers took about 40% of the gateway's CPU per inference, the
handler itself the rest. Everything else still goes through the Starlette app.

It also withdraws a request whose HTTP client went away: once the body is read,
the handler runs beside a wait for ``http.disconnect``; a disconnect cancels the
handler, and cancelling the client call sends the broker a CANCEL, so the queued
request leaves the queue instead of running for nobody.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.types import Message, Receive, Scope, Send

from zeroserve.gateway.http import error_response, too_large_response
from zeroserve.gateway.metrics import HTTP_REQUESTS, HTTP_SECONDS

logger = logging.getLogger(__name__)

INFER = re.compile(r"^/v2/models/(?P<name>[^/]+)(?:/versions/(?P<version>[^/]+))?/infer$")
ROUTE = {False: "/v2/models/{name}/infer", True: "/v2/models/{name}/versions/{version}/infer"}


class Disconnected(Exception):
    pass


class InferFastPath:
    def __init__(self, app: Starlette) -> None:
        self.app = app
        self.gateway = app.state.gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        match = INFER.match(scope["path"]) if scope["type"] == "http" and \
            scope["method"] == "POST" else None
        if match is None:
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500
        params = {k: v for k, v in match.groupdict().items() if v is not None}
        scope["path_params"] = params
        scope["app"] = self.app
        try:
            status = await self._infer(scope, receive, send)
        except Disconnected:
            status = 499
        except Exception:  # a bug: answer JSON, log the traceback, keep serving
            logger.exception("unexpected error on POST %s", scope["path"])
            await error_response(500, "internal error")(scope, receive, send)
        finally:
            route = ROUTE["version" in params]
            HTTP_REQUESTS.labels(route, "POST", str(status)).inc()
            HTTP_SECONDS.labels(route, "POST").observe(time.perf_counter() - start)

    async def _infer(self, scope: Scope, receive: Receive, send: Send) -> int:
        limit = self.gateway.settings.max_body_bytes
        body = await _read_all(scope, receive, limit)
        if body is None:
            response = too_large_response(limit)
            await response(scope, receive, send)
            return response.status_code
        replay: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive_body() -> Message:
            return replay.pop() if replay else await receive()

        handler = asyncio.ensure_future(self.gateway.infer(Request(scope, receive_body)))
        watcher = asyncio.ensure_future(receive())
        try:
            done, _ = await asyncio.wait({handler, watcher},
                                         return_when=asyncio.FIRST_COMPLETED)
            if handler not in done:  # the client went away: withdraw the request
                handler.cancel()
                await asyncio.gather(handler, return_exceptions=True)
                raise Disconnected()
        finally:
            watcher.cancel()
        response = handler.result()
        await response(scope, receive, send)
        return int(response.status_code)


async def _read_all(scope: Scope, receive: Receive, limit: int) -> bytes | None:
    """The raw body, or None when it is larger than ``limit`` (decompression and its
    bound are the handler's)."""
    for name, value in scope["headers"]:
        if name == b"content-length" and value.isdigit() and int(value) > limit:
            return None
    chunks: list[bytes] = []
    size = 0
    while True:
        message: Any = await receive()
        if message["type"] == "http.disconnect":
            raise Disconnected()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)
