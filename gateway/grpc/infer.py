"""ModelInfer and ModelStreamInfer: a gRPC request becomes the same broker request as an
HTTP one (the door, the deadline rule, priority, the caller's key, cancellation).

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
from typing import TYPE_CHECKING, Any, AsyncIterator, Sequence

from zeroserve.broker import wording
from zeroserve.broker.client import InferError
from zeroserve.broker.protocol import ErrorCode
from zeroserve.gateway import errors
from zeroserve.gateway.apikey import api_key_of
from zeroserve.gateway.door import SHED_DEADLINE
from zeroserve.gateway.grpc import tensors
from zeroserve.models.proto import grpc_service_pb2 as pb
from zeroserve.gateway.routes.infer import clamped

if TYPE_CHECKING:
    from zeroserve.gateway.app import Gateway

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


def budget_ms(timeout_us: int, remaining_s: float | None, accepted: float) -> float:
    """What is left of the request's budget, 0 for none; InferError(deadline) when it
    ran out in the gateway."""
    limits = [timeout_us / 1000.0] if timeout_us else []
    if remaining_s is not None:   # the call's deadline, counted from now: move it back
        limits.append(remaining_s * 1000.0 + (time.monotonic() - accepted) * 1000.0)
    if not limits:
        return 0.0
    left = min(limits) - (time.monotonic() - accepted) * 1000.0
    if left <= 0:
        SHED_DEADLINE.inc()
        raise InferError(ErrorCode.DEADLINE, "deadline exceeded in the gateway, before the "
                         "request reached the broker")
    return left


class Malformed:
    """A request whose bytes do not parse as its message: a unary call is answered
    INVALID_ARGUMENT, a stream answers it with an error and goes on."""

    def __init__(self, name: str, error: str) -> None:
        self.message = f"malformed {name}: {error}"


class Inference:
    def __init__(self, gateway: "Gateway") -> None:
        self.gw = gateway

    async def _admit(self, request: Any, context: Any,
                     metadata: dict[str, str]) -> tuple[tensors.GrpcRequest, float]:
        """The request decoded and let through the door, with what is left of its
        budget; raises the errors of the table (gateway/errors.py). With tenants, a
        caller without a key learns nothing, not even what is wrong with its request."""
        door = self.gw.door
        accepted = time.monotonic() - door.current_lag_s()
        why = door.refuse()
        if why is not None:
            raise InferError(ErrorCode.UNAVAILABLE, why)
        await self.gw.gate.caller(metadata)
        req = tensors.decode(request, self.gw.shm.read if self.gw.shm.enabled else None)
        why = door.refuse_priority(req.priority, req.timeout_us > 0)
        if why is not None:
            raise InferError(ErrorCode.UNAVAILABLE, why)
        return req, budget_ms(req.timeout_us, context.time_remaining(), accepted)

    async def _encode(self, req: tensors.GrpcRequest, model: str, version: int,
                      out: Sequence[Any], stats: dict[str, float], api_key: str) -> Any:
        if req.classified and out:
            out = await self.gw.classify(model, version, list(out), req.classified, api_key)
        return tensors.encode(model, version, req, out,
                              self.gw.shm.write if self.gw.shm.enabled else None,
                              clamped(stats))

    async def ModelInfer(self, request: Any, context: Any) -> Any:
        gw = self.gw
        gw.door.in_flight += 1
        try:
            metadata = metadata_of(context)
            trace = gw.tracer.begin(request.model_name, metadata.get("traceparent"),
                                    metadata.get("tracestate"), "GRPC_WAITREAD_END") \
                if gw.tracer.active else None
            req, timeout_ms = await self._admit(request, context, metadata)
            api_key = api_key_of(metadata)
            sent_ns = time.monotonic_ns() if trace is not None else 0
            try:
                reply = await gw.client.infer_tensors(
                    req.model, req.tensors, version=req.version, priority=req.priority,
                    timeout_ms=timeout_ms, outputs=req.output_names, api_key=api_key,
                    trace=trace.context if trace is not None else None)
            except InferError as exc:
                if trace is not None:
                    gw.tracer.finish(trace, None, sent_ns, time.monotonic_ns(), req.id or "",
                                     error=exc.message)
                raise tritons(exc, req.id, wording.DECOUPLED_GRPC) from None
            if trace is None:
                return await self._encode(req, reply.model, reply.version, reply.tensors,
                                          reply.stats, api_key)
            received_ns = time.monotonic_ns()
            trace.stamp("GRPC_SEND_START")
            out = await self._encode(req, reply.model, reply.version, reply.tensors,
                                     reply.stats, api_key)
            trace.stamp("GRPC_SEND_END")   # handed to gRPC, which sends it after we return
            gw.tracer.finish(trace, reply, sent_ns, received_ns, req.id or "", req.tensors,
                             list(reply.tensors))
            return out
        finally:
            gw.door.in_flight -= 1

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
        gw = self.gw
        if isinstance(request, Malformed):
            await answers.put(error_answer(None, errors.BadRequest(request.message)))
            return
        gw.door.in_flight += 1
        req = None
        metadata = metadata_of(context)
        trace = gw.tracer.begin_stream(request.model_name, metadata.get("traceparent"),
                                       metadata.get("tracestate"), "GRPC_WAITREAD_END")
        error = "cancelled"   # unless it ends otherwise
        try:
            req, timeout_ms = await self._admit(request, context, metadata)
            empty_final = bool(req.parameters.get(EMPTY_FINAL))
            api_key = api_key_of(metadata)
            async with gw.client.stream(req.model, req.tensors, version=req.version,
                                        priority=req.priority, timeout_ms=timeout_ms,
                                        outputs=req.output_names, api_key=api_key,
                                        trace=trace.context if trace else None) as stream:
                async for part in stream:
                    if not part.tensors and part.final and not empty_final:
                        continue
                    resp = await self._encode(req, part.model, part.version, part.tensors,
                                              part.stats, api_key)
                    resp.parameters[FINAL].bool_param = part.final
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
            gw.door.in_flight -= 1
            if trace is not None:
                gw.tracer.finish_stream(trace, error)


_ENDED = object()   # a stream request's task has put its last answer


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
