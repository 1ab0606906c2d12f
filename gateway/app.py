"""The HTTP gateway: a Starlette app that forwards to the broker over one DEALER.

The AsyncClient (one socket, one reader task, futures keyed by request id) is
created in the lifespan. Errors are always JSON ``{"error": "..."}``.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from zeroserve.broker import __version__
from zeroserve.broker.client import AsyncClient, InferError
from zeroserve.broker.protocol import ErrorCode
from zeroserve.gateway import v2

logger = logging.getLogger(__name__)

STATUS = {
    ErrorCode.BAD_INPUT: 400, ErrorCode.NOT_FOUND: 404, ErrorCode.DEADLINE: 504,
    ErrorCode.OVERLOADED: 429, ErrorCode.QUOTA: 429, ErrorCode.NO_WORKER: 503,
    ErrorCode.UNAVAILABLE: 503, ErrorCode.WORKER_LOST: 503, ErrorCode.MODEL_ERROR: 500,
    ErrorCode.CANCELLED: 499, ErrorCode.INTERNAL: 500,
    ErrorCode.FORBIDDEN: 403, ErrorCode.CONFLICT: 409,
}
EXTENSIONS = ["binary_tensor_data", "schedule_policy", "model_configuration"]


@dataclass
class Settings:
    frontend: str
    max_body_bytes: int = 64 << 20
    broker_timeout_s: float = 3.0
    admin_token: str = ""      # management routes from anywhere with it; loopback only without


def json_response(doc: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(doc), status, headers, media_type="application/json")


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return json_response({"error": message}, status, headers)


def infer_error_response(err: InferError) -> Response:
    headers = None
    if err.retry_after_s is not None:
        headers = {"Retry-After": str(max(1, round(err.retry_after_s)))}
    elif err.code in (ErrorCode.OVERLOADED, ErrorCode.NO_WORKER, ErrorCode.UNAVAILABLE):
        headers = {"Retry-After": "1"}
    return error_response(STATUS.get(err.code, 500), err.message, headers)


class BodyTooLarge(Exception):
    pass


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge()
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge()
        chunks.append(chunk)
    return b"".join(chunks)


def _version(request: Request) -> int | None:
    raw = request.path_params.get("version")
    if raw is None:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"version must be a positive integer, got {raw!r}")
    return int(raw)


def _int_param(params: dict[str, Any], name: str) -> int:
    value = params.get(name, 0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise v2.DecodeError(f"parameter {name!r} must be a non-negative number")
    return int(value)


class Gateway:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.client = AsyncClient(settings.frontend, broker_timeout_s=settings.broker_timeout_s)
        self.draining = False

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        await self.client.start()
        await self.client.wait_connected(1.0)
        try:
            yield
        finally:
            await self.client.close()

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
            models = (await self.client.control("models"))["models"]
        except InferError as exc:
            return exc.message
        if not any(m["ready"] for m in models.values()):
            return "no model is ready on any worker"
        return None

    async def server_metadata(self, request: Request) -> Response:
        return json_response({"name": "zeroserve", "version": __version__,
                              "extensions": EXTENSIONS})

    # -- models -------------------------------------------------------------
    async def model_metadata(self, request: Request) -> Response:
        try:
            meta = await self._metadata(request)
        except InferError as exc:
            return infer_error_response(exc)
        except ValueError as exc:
            return error_response(400, str(exc))
        meta.pop("ready", None)
        meta.pop("max_batch_size", None)
        return json_response(meta)

    async def model_ready(self, request: Request) -> Response:
        try:
            meta = await self._metadata(request)
        except InferError as exc:
            return infer_error_response(exc)
        except ValueError as exc:
            return error_response(400, str(exc))
        if not meta["ready"]:
            return error_response(503, f"model {meta['name']!r} is not ready")
        return Response(status_code=200)

    async def _metadata(self, request: Request) -> dict[str, Any]:
        version = _version(request)
        return await self.client.control(  # type: ignore[no-any-return]
            "metadata", model=request.path_params["name"], version=version)

    async def infer(self, request: Request) -> Response:
        name = request.path_params["name"]
        try:
            version = _version(request)
            body = await read_body(request, self.settings.max_body_bytes)
            hlen = request.headers.get(v2.HEADER_LENGTH)
            req = v2.decode_request(body, int(hlen) if hlen is not None and hlen.isdigit()
                                    else None if hlen is None else -1)
            priority = _int_param(req.parameters, "priority")
            timeout_us = _int_param(req.parameters, "timeout")
        except BodyTooLarge:
            return error_response(413, f"request body exceeds {self.settings.max_body_bytes} "
                                  "bytes")
        except ValueError as exc:  # DecodeError, a bad version
            return error_response(400, str(exc))
        try:
            reply = await self.client.infer_tensors(
                name, req.tensors, version=version, priority=priority,
                timeout_ms=timeout_us / 1000.0, outputs=req.output_names)
        except InferError as exc:
            return infer_error_response(exc)
        try:
            body, json_len = v2.encode_response(reply.model, reply.version, req.id,
                                                reply.tensors, req)
        except v2.DecodeError as exc:
            return error_response(400, str(exc))
        if json_len is None:
            return Response(body, 200, media_type="application/json")
        return Response(body, 200, {"Inference-Header-Content-Length": str(json_len)},
                        media_type="application/octet-stream")


def create_app(settings: Settings) -> Starlette:
    gw = Gateway(settings)
    m = "/v2/models/{name}"
    mv = "/v2/models/{name}/versions/{version}"
    routes = [
        Route("/v2/health/live", gw.live, methods=["GET"]),
        Route("/v2/health/ready", gw.ready, methods=["GET"]),
        Route("/healthz", gw.live, methods=["GET"]),
        Route("/readyz", gw.ready, methods=["GET"]),
        Route("/v2", gw.server_metadata, methods=["GET"]),
        Route(m, gw.model_metadata, methods=["GET"]),
        Route(mv, gw.model_metadata, methods=["GET"]),
        Route(m + "/ready", gw.model_ready, methods=["GET"]),
        Route(mv + "/ready", gw.model_ready, methods=["GET"]),
        Route(m + "/infer", gw.infer, methods=["POST"]),
        Route(mv + "/infer", gw.infer, methods=["POST"]),
    ]
    from zeroserve.gateway.registration import Registration  # it imports this module
    routes += Registration(gw).routes()

    async def not_found(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        detail = getattr(exc, "detail", "not found")
        return error_response(status, str(detail))

    app = Starlette(routes=routes, lifespan=gw.lifespan,
                    exception_handlers={404: not_found, 405: not_found})
    app.state.gateway = gw
    return app
