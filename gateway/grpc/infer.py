"""ModelInfer and ModelStreamInfer: a gRPC request becomes the same broker request as an
HTTP one, through the same inference path (gateway/inference.py: the door, the tenant
gate, the lag shed by priority, the deadline rule, the trace, the classification); a
shed request is UNAVAILABLE with a ``retry-after`` trailer. Each request of a stream
passes the door on its own.

The deadline counts from the door, as over HTTP: ``parameters.timeout`` (µs) and the
call's own gRPC deadline, whichever ends first, less what the request spent in the
gateway. A cancelled call (the client went away, or its deadline passed) cancels the
handler, and cancelling the client call withdraws the request from the broker's queue.

A stream carries many requests; each is sent as soon as it arrives (through
``AsyncClient.stream``), and each response is written when it is ready, so answers may
come in another order than the requests: clients match them by ``id`` (Triton's rule).
A plain model answers each request once; a decoupled one with every response it
yields, in order. Each answer carries ``triton_final_response``; an empty final
response (a decoupled model's end with no outputs) is sent only to a request whose
``triton_enable_empty_final_response`` parameter is true. An error is an answer with
``error_message`` and the request's id, model and version, and the stream goes on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator, Sequence

from zeroserve.broker import wording
from zeroserve.broker.client import InferError
from zeroserve.broker.protocol import ErrorCode
from zeroserve.gateway import errors
from zeroserve.gateway.apikey import api_key_of
from zeroserve.gateway.grpc import tensors
from zeroserve.gateway.http import BUILD_HEADER
from zeroserve.gateway.inference import InferencePath, peer_host, routing_key
from zeroserve.gateway.shm import SharedMemory
from zeroserve.models.proto import grpc_service_pb2 as pb
from zeroserve.gateway.routes.infer import clamped

logger = logging.getLogger(__name__)

FINAL = "triton_final_response"
EMPTY_FINAL = "triton_enable_empty_final_response"


def metadata_of(context: Any) -> dict[str, str]:
    """The call's metadata, first occurrence of each key (gRPC lowercases them)."""
    out: dict[str, str] = {}
    for key, val in context.invocation_metadata() or ():
        if isinstance(val, str):
            out.setdefault(key, val)
    return out


class Malformed:
    """A request whose bytes do not parse as its message: a unary call is answered
    INVALID_ARGUMENT, a stream answers it with an error and goes on."""

    def __init__(self, name: str, error: str) -> None:
        self.message = f"malformed {name}: {error}"


class Inference:
    def __init__(self, inference: InferencePath, shm: SharedMemory) -> None:
        self.inference = inference
        self.shm = shm

    async def _admit(self, request: Any, context: Any, metadata: dict[str, str],
                     accepted: float) -> tuple[tensors.GrpcRequest, float]:
        """The request (let in at ``accepted``) decoded, with what is left of its budget;
        raises the errors of the table (gateway/errors.py). With tenants, a caller
        without a key learns nothing, not even what is wrong with its request."""
        inference = self.inference
        await inference.caller(metadata)
        req = tensors.decode(request, self.shm.read if self.shm.enabled else None)
        inference.check_priority(req.priority, req.timeout_us > 0)
        return req, inference.budget_ms(req.timeout_us / 1000.0, accepted,
                                        context.time_remaining())

    async def _encode(self, req: tensors.GrpcRequest, model: str, version: int,
                      out: Sequence[Any], stats: dict[str, float], api_key: str) -> Any:
        if req.classified and out:
            out = await self.inference.classify(model, version, list(out), req.classified,
                                                api_key)
        return tensors.encode(model, version, req, out,
                              self.shm.write if self.shm.enabled else None,
                              clamped(stats))

    async def ModelInfer(self, request: Any, context: Any) -> Any:
        inference = self.inference
        accepted = inference.enter()
        try:
            metadata = metadata_of(context)
            trace = inference.trace(request.model_name, metadata, "GRPC_WAITREAD_END")
            req, timeout_ms = await self._admit(request, context, metadata, accepted)
            api_key = api_key_of(metadata)
            sent_ns = time.monotonic_ns() if trace is not None else 0
            try:
                reply = await inference.infer(
                    req.model, req.tensors, version=req.version, priority=req.priority,
                    timeout_ms=timeout_ms, outputs=req.output_names, api_key=api_key,
                    trace=trace.context if trace is not None else None,
                    routing_key=routing_key(metadata, req.parameters, api_key,
                                            peer_host(context.peer())))
            except InferError as exc:
                if trace is not None:
                    inference.finish(trace, None, sent_ns, time.monotonic_ns(), req.id or "",
                                     error=exc.message)
                raise tritons(exc, req.id, wording.DECOUPLED_GRPC) from None
            if reply.build:
                context.set_trailing_metadata(
                    ((BUILD_HEADER.lower(), f"{reply.version}/{reply.build}"),))
            if trace is None:
                return await self._encode(req, reply.model, reply.version, reply.tensors,
                                          reply.stats, api_key)
            received_ns = time.monotonic_ns()
            trace.stamp("GRPC_SEND_START")
            out = await self._encode(req, reply.model, reply.version, reply.tensors,
                                     reply.stats, api_key)
            trace.stamp("GRPC_SEND_END")   # handed to gRPC, which sends it after we return
            inference.finish(trace, reply, sent_ns, received_ns, req.id or "", req.tensors,
                             list(reply.tensors))
            return out
        finally:
            inference.leave()

    async def ModelStreamInfer(self, requests: AsyncIterator[Any],
                               context: Any) -> AsyncIterator[Any]:
        answers: asyncio.Queue[Any] = asyncio.Queue()
        running: set[asyncio.Task[None]] = set()   # to cancel them when the call ends
        started = 0

        async def one(request: Any) -> None:
            try:
                await self._stream_one(request, context, answers)
            finally:
                # behind its last answer: the loop below learns here that it ended, also
                # when it ended answering nothing (an empty final response not asked for)
                answers.put_nowait(_ENDED)

        async def read() -> None:
            nonlocal started
            try:
                async for request in requests:
                    started += 1
                    task = asyncio.ensure_future(one(request))
                    running.add(task)
                    task.add_done_callback(running.discard)
            except Exception as exc:   # noqa: BLE001 - reading the call failed: end it
                await answers.put(exc)
            else:
                await answers.put(None)   # the client half-closed: no more requests

        reader = asyncio.ensure_future(read())
        try:
            closed = False
            ended = 0
            # a request's task counts until its _ENDED is read, not until it leaves
            # ``running`` (its done callback runs later): waiting on the queue for a task
            # that has ended would hold the call open for ever
            while not closed or ended < started:
                got = await answers.get()
                if got is None:
                    closed = True
                elif got is _ENDED:
                    ended += 1
                elif isinstance(got, BaseException):   # the reader failed (a bad message)
                    raise got
                else:
                    yield got
            await reader
        finally:   # the call ended or was cancelled: withdraw what is still queued
            reader.cancel()
            for task in list(running):
                task.cancel()

    async def _stream_one(self, request: Any, context: Any, answers: "asyncio.Queue[Any]") -> None:
        """Every response of one request of the stream into ``answers``: one for a plain
        model, as many as it yields for a decoupled one (the empty final response only
        when the request asks with ``triton_enable_empty_final_response``)."""
        inference = self.inference
        if isinstance(request, Malformed):
            await answers.put(error_answer(None, errors.BadRequest(request.message)))
            return
        try:
            accepted = inference.enter()
        except InferError as exc:   # shed: this request's answer; the stream goes on
            await answers.put(error_answer(request, tritons(exc, request.id, "")))
            return
        req = None
        metadata = metadata_of(context)
        trace = inference.trace_stream(request.model_name, metadata, "GRPC_WAITREAD_END")
        error = "cancelled"   # unless it ends otherwise
        try:
            req, timeout_ms = await self._admit(request, context, metadata, accepted)
            empty_final = bool(req.parameters.get(EMPTY_FINAL))
            api_key = api_key_of(metadata)
            async with inference.stream(req.model, req.tensors, version=req.version,
                                        priority=req.priority, timeout_ms=timeout_ms,
                                        outputs=req.output_names, api_key=api_key,
                                        trace=trace.context if trace else None,
                                        routing_key=routing_key(
                                            metadata, req.parameters, api_key,
                                            peer_host(context.peer()))) as stream:
                async for part in stream:
                    if not part.tensors and part.final and not empty_final:
                        continue
                    resp = await self._encode(req, part.model, part.version, part.tensors,
                                              part.stats, api_key)
                    resp.parameters[FINAL].bool_param = part.final
                    if part.build:   # no trailing metadata per response: a parameter
                        resp.parameters[BUILD_PARAMETER].string_param = \
                            f"{part.version}/{part.build}"
                    await answers.put(pb.ModelStreamInferResponse(infer_response=resp))
            error = ""
        except asyncio.CancelledError:
            raise
        except Exception as exc:   # noqa: BLE001 - each request's error is its answer
            if isinstance(exc, InferError):
                exc = tritons(exc, req.id if req is not None else request.id, "")
            error = str(exc)
            await answers.put(error_answer(request, exc))
        finally:
            inference.leave()
            inference.finish_stream(trace, error)


_ENDED = object()   # a stream request's task has put its last answer
# a stream response's build (ModelInfer says it in trailing metadata, x-model-build)
BUILD_PARAMETER = "model_build"


def tritons(exc: InferError, request_id: str, decoupled: str) -> InferError:
    """The broker's error in Triton's words: its request-id prefix filled in, and the
    gRPC text for a unary call to a decoupled model."""
    message = decoupled if exc.code is ErrorCode.UNSUPPORTED and decoupled else \
        wording.with_request_id(exc.message, request_id)
    return InferError(exc.code, message, exc.retry_after_s)


def error_answer(request: Any | None, exc: Exception) -> Any:
    """A stream's answer to one request that failed: Triton's error_message, with the
    request's id, model and version so the client can match it."""
    got = errors.answer(exc)
    if got is None:
        logger.error("unexpected error in a ModelStreamInfer request", exc_info=exc)
    out = pb.ModelStreamInferResponse(
        error_message=got.message if got is not None else "internal error")
    ir = out.infer_response
    if request is not None:
        ir.id, ir.model_name, ir.model_version = \
            request.id, request.model_name, request.model_version
    ir.parameters[FINAL].bool_param = True
    return out
