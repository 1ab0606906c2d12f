"""The HTTP gateway: a Starlette app that forwards to the broker over one DEALER.

The AsyncClient (one socket, one reader task, futures keyed by request id) is
created in the lifespan. Errors are always JSON ``{"error": "..."}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from zeroserve.broker import __version__
from zeroserve.broker.client import AsyncClient, InferError
from zeroserve.broker.curve import ClientKeys
from zeroserve.broker import protocol as p
from zeroserve.broker.protocol import ErrorCode
from zeroserve.gateway import metrics, openapi, readiness, routes_simple
from zeroserve.gateway.classification import classify
from zeroserve.gateway.door import Door
from zeroserve.gateway.infer import InferEndpoint
from zeroserve.broker.logsettings import LogSettings
from zeroserve.gateway.shm import SharedMemory
from zeroserve.gateway.http import STATUS, BadRequest, BodyTooLarge, error_response, \
    infer_error_response, json_response, path_version, read_body

__all__ = ["STATUS", "Settings", "create_app", "error_response", "json_response",
           "infer_error_response", "read_body", "BodyTooLarge"]

logger = logging.getLogger(__name__)

# exactly what this gateway implements; system_shared_memory only when it is on
EXTENSIONS = ["binary_tensor_data", "schedule_policy", "model_configuration",
              "classification", "logging", "statistics", "model_repository"]


@dataclass
class Settings:
    frontend: str
    max_body_bytes: int = 64 << 20
    broker_timeout_s: float = 3.0
    admin_token: str = ""      # management routes from anywhere with it; loopback only without
    control: str = ""          # the broker's control socket (default: beside the frontend)
    readiness: str = readiness.STRICT
    server_name: str = "zeroserve"
    server_version: str = __version__
    allow_shared_memory: bool = False
    shed_lag_ms: float = 50.0  # shed at the door while the event loop is this far behind
    max_in_flight: int = 2048  # inference requests in the gateway at most (0: no bound)
    curve_keys: ClientKeys | None = None  # a broker on tcp:// with CurveZMQ (broker/curve.py)

    @property
    def control_endpoint(self) -> str:
        if self.control:
            return self.control
        base, _, _ = self.frontend.rpartition("/")
        return f"{base}/control"

    def extensions(self) -> list[str]:
        return EXTENSIONS + (["system_shared_memory"] if self.allow_shared_memory else [])


class Gateway:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.client = AsyncClient(settings.frontend, broker_timeout_s=settings.broker_timeout_s,
                                  curve_keys=settings.curve_keys)
        # verbs that change state go to the control socket, with the admin token: the
        # broker answers only read-only verbs on the frontend
        self.admin = AsyncClient(settings.control_endpoint,
                                 broker_timeout_s=settings.broker_timeout_s,
                                 admin_token=settings.admin_token)
        self.draining = False
        self.door = Door(settings.shed_lag_ms, settings.max_in_flight)
        self.shm = SharedMemory(settings.allow_shared_memory)
        self.logs = LogSettings()

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        await self.client.start()
        await self.admin.start()
        await self.client.wait_connected(1.0)
        self.door.start()
        try:
            yield
        finally:
            self.door.stop()
            await self.admin.close()
            self.shm.close()
            await self.client.close()

    async def control(self, verb: str, **args: Any) -> Any:
        """A control call that cannot hang: one sent just as the broker died is lost,
        and a broker restarted at once keeps the client "connected"."""
        try:
            return await asyncio.wait_for(self.client.control(verb, **args),
                                          self.settings.broker_timeout_s)
        except asyncio.TimeoutError:
            raise InferError(ErrorCode.UNAVAILABLE,
                             f"no answer from the broker within "
                             f"{self.settings.broker_timeout_s:g} s") from None

    # -- health -------------------------------------------------------------
    async def live(self, request: Request) -> Response:
        return Response(status_code=200)

    async def ready(self, request: Request) -> Response:
        why = await self._not_ready()
        if why:
            return error_response(503, why)
        return Response(status_code=200)

    async def _not_ready(self) -> str | None:
        if self.draining:
            return "gateway is shutting down"
        if not self.client.connected:
            return "broker is not reachable"
        try:
            return await readiness.not_ready(self.control, self.settings.readiness)
        except InferError as exc:
            return exc.message

    async def server_metadata(self, request: Request) -> Response:
        return json_response({"name": self.settings.server_name,
                              "version": self.settings.server_version,
                              "extensions": self.settings.extensions()})

    # -- models -------------------------------------------------------------
    async def model_metadata(self, request: Request) -> Response:
        try:
            meta = await self._control(request, "metadata")
        except InferError as exc:
            return infer_error_response(exc)
        except BadRequest as exc:
            return error_response(400, str(exc))
        for internal in ("ready", "max_batch_size", "labels"):
            meta.pop(internal, None)
        return json_response(meta)

    async def model_config(self, request: Request) -> Response:
        try:
            return json_response(await self._control(request, "config"))
        except InferError as exc:
            return infer_error_response(exc)
        except BadRequest as exc:
            return error_response(400, str(exc))

    async def model_ready(self, request: Request) -> Response:
        try:
            meta = await self._control(request, "metadata")
        except InferError as exc:
            return infer_error_response(exc)
        except BadRequest as exc:
            return error_response(400, str(exc))
        if not meta["ready"]:
            return error_response(503, f"model {meta['name']!r} is not ready")
        return Response(status_code=200)

    async def _control(self, request: Request, verb: str) -> dict[str, Any]:
        version = path_version(request)
        return await self.control(  # type: ignore[no-any-return]
            verb, model=request.path_params["name"], version=version)

    async def classify(self, model: str, version: int, tensors: list[p.Tensor],
                        counts: dict[str, int]) -> list[p.Tensor]:
        """The top N of each output that asks for it. The model's metadata says
        whether dimension 0 is the batch, and (once the broker sends them) its labels."""
        meta = await self.control("metadata", model=model, version=version)
        batched = int(meta.get("max_batch_size") or 0) > 0
        labels = meta.get("labels")
        return [classify(t, counts[t.meta.name], batched, labels)
                if t.meta.name in counts else t for t in tensors]


def create_app(settings: Settings) -> Starlette:
    gw = Gateway(settings)
    infer = InferEndpoint(gw)   # the fast path (fastpath.py) calls the same object
    m = "/v2/models/{name}"
    mv = "/v2/models/{name}/versions/{version}"
    from zeroserve.gateway.routes_repo import RepositoryRoutes
    repository = RepositoryRoutes(gw)
    routes = [
        *repository.stats_routes(),   # before m: "/v2/models/stats" is no model's metadata
        Route("/v2/health/live", gw.live, methods=["GET"]),
        Route("/v2/health/ready", gw.ready, methods=["GET"]),
        Route("/healthz", gw.live, methods=["GET"]),
        Route("/readyz", gw.ready, methods=["GET"]),
        Route("/v2", gw.server_metadata, methods=["GET"]),
        Route(m, gw.model_metadata, methods=["GET"]),
        Route(mv, gw.model_metadata, methods=["GET"]),
        Route(m + "/ready", gw.model_ready, methods=["GET"]),
        Route(mv + "/ready", gw.model_ready, methods=["GET"]),
        Route(m + "/config", gw.model_config, methods=["GET"]),
        Route(mv + "/config", gw.model_config, methods=["GET"]),
        Route(m + "/infer", infer, methods=["POST"]),
        Route(mv + "/infer", infer, methods=["POST"]),
        *routes_simple.routes(gw),
        Route("/metrics", metrics.Scrape(gw.control).endpoint, methods=["GET"]),
    ]
    from zeroserve.gateway.registration import Registration  # it imports this module
    from zeroserve.gateway.routes_ext import Extensions
    routes += Registration(gw).routes()
    routes += Extensions(gw).routes()
    routes += repository.routes()
    routes.append(openapi.route(routes))

    async def http_error(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        detail = getattr(exc, "detail", "not found")
        return error_response(status, str(detail), getattr(exc, "headers", None))

    async def unexpected(request: Request, exc: Exception) -> Response:
        # the traceback goes to the log; the client gets JSON, never an HTML page
        logger.exception("unexpected error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}")

    app = Starlette(routes=routes, lifespan=gw.lifespan,
                    middleware=[metrics.middleware()],
                    exception_handlers={404: http_error, 405: http_error,
                                        Exception: unexpected})
    app.state.gateway = gw
    app.state.infer = infer
    return app
