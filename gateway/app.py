"""The HTTP gateway: a Starlette app that forwards to the broker over one DEALER.

:class:`Gateway` builds the parts once and gives each route object the few it uses:
the broker client (one socket, one reader task, futures keyed by request id, started
in the lifespan), the one inference path (gateway/inference.py), the facade of what
the front ends read (gateway/facade.py), shared memory and the tenant gate. Errors are
always JSON ``{"error": "..."}``.
"""

from __future__ import annotations

import contextlib
import logging
from typing import AsyncIterator

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from zeroserve.broker.client import AsyncClient, InferError
from zeroserve.gateway import errors, metrics, routes, tracing
from zeroserve.gateway.facade import Facade
from zeroserve.gateway.http import error_response
from zeroserve.gateway.inference import InferencePath
from zeroserve.gateway.routes.infer import InferEndpoint
from zeroserve.gateway.settings import EXTENSIONS, Settings
from zeroserve.gateway.shm import SharedMemory
from zeroserve.gateway.tenantgate import GateMiddleware, TenantGate, networks
from zeroserve.gateway.tokens import Tokenizers

__all__ = ["EXTENSIONS", "Gateway", "Settings", "create_app"]

logger = logging.getLogger(__name__)


class Gateway:
    """The parts of one gateway process, built once; the lifespan starts and stops them."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        # the admin token rides on the frontend too: with tenants the broker shows the
        # gateway's own calls (readiness, a scrape) everything, its callers' only theirs
        self.client = AsyncClient(settings.frontend, broker_timeout_s=settings.broker_timeout_s,
                                  curve_keys=settings.curve_keys,
                                  admin_token=settings.admin_token)
        self.tracer = tracing.for_gateway(settings.trace_config, settings.shared_port)
        self.facade = Facade(settings, self.client, self.tracer)
        self.gate = TenantGate(self.facade.control, settings.admin_token,
                               networks(settings.metrics_allow))
        self.inference = InferencePath(self.client, self.facade.control, self.gate,
                                       self.tracer, settings.shed_lag_ms,
                                       settings.max_in_flight)
        self.shm = SharedMemory(settings.allow_shared_memory)
        self.tokenizers = Tokenizers(self.facade.control)

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        await self.client.start()
        await self.facade.start()
        await self.client.wait_connected(1.0)
        self.inference.start()
        try:
            yield
        finally:
            self.inference.stop()
            await self.facade.close()
            self.tracer.close()   # what the trace file has not been given yet
            self.shm.close()
            self.tokenizers.close()
            await self.client.close()


def create_app(settings: Settings) -> Starlette:
    gw = Gateway(settings)
    # the fast path (fastpath.py) calls the same object
    infer = InferEndpoint(gw.inference, gw.shm, settings.max_body_bytes)

    async def http_error(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        detail = getattr(exc, "detail", "not found")
        return error_response(status, str(detail), getattr(exc, "headers", None))

    async def unexpected(request: Request, exc: Exception) -> Response:
        # the traceback goes to the log; the client gets JSON, never an HTML page
        logger.exception("unexpected error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}")

    async def refuse(scope: Scope, receive: Receive, send: Send, exc: InferError) -> None:
        got = errors.infer_answer(exc)
        await error_response(got.status.http, got.message, got.http_headers())(
            scope, receive, send)

    table = routes.routes(routes.Parts(
        facade=gw.facade, inference=gw.inference, infer=infer, shm=gw.shm, gate=gw.gate,
        max_body_bytes=settings.max_body_bytes, admin_token=settings.admin_token,
        tokenizers=gw.tokenizers))
    app = Starlette(routes=table, lifespan=gw.lifespan,
                    middleware=[metrics.middleware(),
                                Middleware(GateMiddleware, gate=gw.gate, refuse=refuse)],
                    exception_handlers={404: http_error, 405: http_error,
                                        **errors.http_handlers(), Exception: unexpected})
    app.state.gateway = gw
    app.state.facade = gw.facade
    app.state.infer = infer
    return app
