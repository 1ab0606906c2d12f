"""The gRPC server of the gateway: grpc.aio on the gateway's own event loop, beside
uvicorn (docs/grpc.md says why, with the measurements).

Method handlers are built from the service descriptors of the vendored protos (no
generated ``_pb2_grpc`` module), each wrapped once: a message that does not parse is
INVALID_ARGUMENT naming the message, an error of the table (gateway/errors.py) is its
gRPC code with its message, anything else is logged and INTERNAL. Message limits are
Triton's (INT32_MAX) unless ``--grpc-max-message-bytes`` says less; a bigger message is
refused by gRPC itself with RESOURCE_EXHAUSTED, and the server goes on serving. Answers
are compressed only with ``--grpc-response-compression`` (requests are taken compressed
either way).

Nothing of grpcio is created before :meth:`GrpcServer.start`, which runs in the
serving process's own loop: gRPC's core must not exist before a fork, and the serve
supervisor starts every component as a fresh process anyway.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable

import grpc
from google.protobuf.message import DecodeError

from zeroserve.gateway import errors
from zeroserve.gateway.grpc.infer import Malformed
from zeroserve.models.proto import grpc_service_pb2 as pb
from zeroserve.models.proto import health_pb2
from zeroserve.gateway.grpc.service import HealthService, InferenceService
from zeroserve.gateway.metrics import GRPC_REQUESTS, GRPC_SECONDS

if TYPE_CHECKING:
    from zeroserve.gateway.app import Gateway

logger = logging.getLogger(__name__)

INT32_MAX = 2**31 - 1
COMPRESSION = {"none": grpc.Compression.NoCompression, "gzip": grpc.Compression.Gzip,
               "deflate": grpc.Compression.Deflate}


class GrpcBindError(RuntimeError):
    """The gRPC port could not be bound (taken, or not an address of this host)."""


def _parser(cls: Any) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except DecodeError as exc:
            return Malformed(cls.DESCRIPTOR.name, str(exc) or "cannot parse")
    return parse


async def _abort(context: Any, method: str, exc: BaseException) -> None:
    got = errors.answer(exc)
    if got is None:
        logger.exception("unexpected error in gRPC %s", method, exc_info=exc)
        got = errors.Answer(errors.INTERNAL, "internal error")
    GRPC_REQUESTS.labels(method, got.status.grpc).inc()
    trailing = (("retry-after", str(got.retry_after_s)),) if got.retry_after_s else ()
    await context.abort(grpc.StatusCode[got.status.grpc], got.message, trailing)


def _unary(method: str, fn: Callable[[Any, Any], Awaitable[Any]]) -> Any:
    timer = GRPC_SECONDS.labels(method)
    ok = GRPC_REQUESTS.labels(method, "OK")   # labels() takes a lock: once, not per call

    async def handle(request: Any, context: Any) -> Any:
        if isinstance(request, Malformed):
            GRPC_REQUESTS.labels(method, "INVALID_ARGUMENT").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        start = time.perf_counter()
        try:
            answer = await fn(request, context)
        except Exception as exc:   # noqa: BLE001 - every error becomes the call's status
            await _abort(context, method, exc)
        ok.inc()
        timer.observe(time.perf_counter() - start)
        return answer
    return handle


def _streaming(method: str, fn: Callable[[Any, Any], AsyncIterator[Any]]) -> Any:
    async def handle(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
        try:
            async for answer in fn(requests, context):
                yield answer
        except Exception as exc:   # noqa: BLE001 - a broken stream ends with its status
            await _abort(context, method, exc)
        GRPC_REQUESTS.labels(method, "OK").inc()
    return handle


def _server_streaming(method: str, fn: Callable[[Any, Any], AsyncIterator[Any]]) -> Any:
    async def handle(request: Any, context: Any) -> AsyncIterator[Any]:
        if isinstance(request, Malformed):
            GRPC_REQUESTS.labels(method, "INVALID_ARGUMENT").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        try:
            async for answer in fn(request, context):
                yield answer
        except Exception as exc:   # noqa: BLE001 - a broken stream ends with its status
            await _abort(context, method, exc)
        GRPC_REQUESTS.labels(method, "OK").inc()
    return handle


def _handler(service: Any, descriptor: Any, module: Any,
             extra: dict[str, grpc.RpcMethodHandler] | None = None) -> grpc.GenericRpcHandler:
    methods = dict(extra or {})
    for m in descriptor.methods:
        req = getattr(module, m.input_type.name)
        resp = getattr(module, m.output_type.name)
        fn = getattr(service, m.name)
        if m.client_streaming and m.server_streaming:
            methods[m.name] = grpc.stream_stream_rpc_method_handler(
                _streaming(m.name, fn), request_deserializer=_parser(req),
                response_serializer=resp.SerializeToString)
        else:
            methods[m.name] = grpc.unary_unary_rpc_method_handler(
                _unary(m.name, fn), request_deserializer=_parser(req),
                response_serializer=resp.SerializeToString)
    return grpc.method_handlers_generic_handler(descriptor.full_name, methods)


class GrpcServer:
    def __init__(self, gateway: "Gateway", host: str, port: int,
                 max_message_bytes: int = INT32_MAX, reuse_port: bool = False,
                 response_compression: str = "none") -> None:
        self.gateway = gateway
        self.response_compression = response_compression
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.max_message_bytes = min(max_message_bytes, INT32_MAX)
        self.reuse_port = reuse_port
        self.port = 0
        self._server: Any = None

    async def start(self) -> int:
        """Bind and serve; the bound port. GrpcBindError when the port is taken."""
        options = [("grpc.max_receive_message_length", self.max_message_bytes),
                   ("grpc.max_send_message_length", INT32_MAX),
                   # off: a second server on a taken port must fail, not share it
                   ("grpc.so_reuseport", 1 if self.reuse_port else 0)]
        # gRPC's core compresses an answer only where the call's grpc-accept-encoding
        # names the algorithm, and sends it plain otherwise
        server = grpc.aio.server(options=options,
                                 compression=COMPRESSION[self.response_compression])
        gw = self.gateway
        health = HealthService(gw.facade)
        # grpc's health protocol has Watch; Triton's health.proto (vendored as it is)
        # declares only Check, so Watch is added here with the same messages
        watch = grpc.unary_stream_rpc_method_handler(
            _server_streaming("Watch", health.Watch),
            request_deserializer=_parser(health_pb2.HealthCheckRequest),
            response_serializer=health_pb2.HealthCheckResponse.SerializeToString)
        server.add_generic_rpc_handlers((
            _handler(InferenceService(gw.inference, gw.shm, gw.facade, gw.gate,
                                      gw.settings.admin_token),
                     pb.DESCRIPTOR.services_by_name["GRPCInferenceService"], pb),
            _handler(health, health_pb2.DESCRIPTOR.services_by_name["Health"], health_pb2,
                     {"Watch": watch})))
        try:
            self.port = server.add_insecure_port(self.address)
        except RuntimeError as exc:
            why = str(exc)
        else:
            why = "" if self.port else "the address is taken or not of this host"
        if why:
            raise GrpcBindError(f"cannot listen for gRPC on {self.address}: {why} (another "
                                "server on that port? --grpc-port picks another, 0 turns "
                                "gRPC off)")
        await server.start()
        self._server = server
        return self.port

    async def stop(self, grace_s: float) -> None:
        """New calls are refused at once; calls in flight get ``grace_s`` to finish."""
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None
