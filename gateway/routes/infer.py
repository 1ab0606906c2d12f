"""``POST /v2/models/{m}[/versions/{v}]/infer``: the one implementation of inference
over HTTP, a plain ASGI endpoint.

It is reached two ways with the same code: :class:`~zeroserve.gateway.fastpath.
InferFastPath` calls it straight from uvicorn (around Starlette's middleware and
router, which cost about 40% of the gateway's CPU per inference when measured with
py-spy), and the Starlette route calls it for an app used without the fast path
(tests, embedding). The body is read once, with one size check; the answer is
written with two ``send`` calls and no Response object.

The deadline counts from the door: ``parameters.timeout`` is turned into what is
left of it when the request is handed to the broker (the wire carries a remaining
budget), counted from the request's arrival (its start here less the event loop's
current lag, the wait in the gateway's line), and a request whose budget ran out
inside the gateway is answered 504 here without reaching the broker. A request that
arrives while the gateway is behind is shed with 503 before its body is decoded (see
:mod:`zeroserve.gateway.door`).

A request whose HTTP client went away is withdrawn: once it has waited for the broker
a while, a task waits for ``http.disconnect`` and cancels the handler, and cancelling
the client call sends the broker a CANCEL, so the queued request leaves the queue
(gateway/leaving.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, Iterable

import orjson
from starlette.types import Receive, Scope, Send

from zeroserve.broker import protocol as p
from zeroserve.broker import wording
from zeroserve.broker.client import ErrorCode, InferError
from zeroserve.gateway import v2
from zeroserve.gateway.apikey import api_key_of
from zeroserve.gateway.door import RETRY_AFTER_S, SHED_DEADLINE
from zeroserve.gateway import errors
from zeroserve.gateway.errors import STATUS, BadRequest, BodyTooLarge
from zeroserve.gateway.tracing import Trace
from zeroserve.gateway.leaving import Leaving
from zeroserve.gateway.http import bounded_int, compress, decompress, encoding_of, \
    parse_version

if TYPE_CHECKING:
    from zeroserve.gateway.app import Gateway

logger = logging.getLogger(__name__)

# the request headers this route reads; everything else is never decoded
WANTED = frozenset({b"content-length", b"content-encoding", b"accept-encoding",
                    b"authorization", b"x-api-key", v2.HEADER_LENGTH.encode(),
                    b"traceparent", b"tracestate"})
JSON = b"application/json"
OCTETS = b"application/octet-stream"
STATUS_KEY = "zeroserve.status"   # where the endpoint leaves its status for the metrics
# A request still unanswered after this long starts watching for its client to leave
# (then it is withdrawn from the broker's queue). Watching costs a task per request,
# created and cancelled, which most requests, answered sooner, never need.
WATCH_AFTER_S = 0.05


class Disconnected(Exception):
    """The HTTP client went away before its answer (499 in the metrics)."""


def wanted_headers(raw: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
    """The few headers this route reads, first occurrence of each, names lowercase
    (ASGI servers lowercase them already)."""
    out: dict[str, str] = {}
    for name, value in raw:
        if name in WANTED:
            key = name.decode("latin-1")
            if key not in out:
                out[key] = value.decode("latin-1")
    return out


async def send_answer(send: Send, status: int, body: bytes, content_type: bytes = JSON,
                      headers: dict[str, str] | None = None) -> None:
    head = [(b"content-type", content_type), (b"content-length", b"%d" % len(body))]
    if headers:
        head += [(k.lower().encode(), v.encode("latin-1")) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})


async def send_error(send: Send, status: int, message: str,
                     headers: dict[str, str] | None = None) -> int:
    await send_answer(send, status, orjson.dumps({"error": message}), JSON, headers)
    return status


async def send_answer_of(send: Send, answer: errors.Answer) -> int:
    """An error of the table (gateway/errors.py), answered as every other route does."""
    return await send_error(send, answer.status.http, answer.message, answer.http_headers())


async def read_all(receive: Receive, declared: str | None, limit: int) -> bytes:
    """The raw body; BodyTooLarge past ``limit``, Disconnected if the client left."""
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(limit)
    chunks: list[bytes] = []
    size = 0
    while True:
        message: Any = await receive()
        if message["type"] == "http.disconnect":
            raise Disconnected()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class InferEndpoint:
    """The ASGI endpoint; ``scope["path_params"]`` names the model (and version)."""

    def __init__(self, gateway: "Gateway") -> None:
        self.gw = gateway
        self.leaving = Leaving(WATCH_AFTER_S)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        door = self.gw.door
        # the request arrived about one loop lag ago: its deadline counts from then
        accepted = time.monotonic() - door.current_lag_s()
        status = 500
        why = door.refuse()
        if why is not None:
            scope[STATUS_KEY] = await send_error(send, 503, why,
                                                 {"Retry-After": str(RETRY_AFTER_S)})
            return
        door.in_flight += 1
        try:
            status = await self._infer(scope, receive, send, accepted)
        except Disconnected:
            status = 499
        except Exception:  # a bug: answer JSON, log the traceback, keep serving
            logger.exception("unexpected error on POST %s", scope.get("path"))
            status = await send_error(send, 500, "internal error")
        finally:
            door.in_flight -= 1
            scope[STATUS_KEY] = status

    async def _infer(self, scope: Scope, receive: Receive, send: Send,
                     accepted: float) -> int:
        gw, limit = self.gw, self.gw.settings.max_body_bytes
        headers = wanted_headers(scope["headers"])
        path = scope["path_params"]
        try:   # with tenants, a caller without a key learns nothing, not even a 400
            await gw.gate.caller(headers)
        except InferError as exc:
            return await send_answer_of(send, errors.infer_answer(exc))
        trace = gw.tracer.begin(path["name"], headers.get("traceparent"),
                                headers.get("tracestate")) if gw.tracer.active else None
        try:
            version = parse_version(path.get("version"))
            body = await read_all(receive, headers.get("content-length"), limit)
            if trace is not None:
                trace.stamp("HTTP_RECV_END")
            encoding = headers.get("content-encoding", "identity").strip().lower()
            if encoding not in ("", "identity"):
                body = decompress(body, encoding, limit)
            hlen = headers.get(v2.HEADER_LENGTH)
            doc, binary = v2.parse_document(body, int(hlen) if hlen is not None and
                                            hlen.isdigit() else None if hlen is None else -1)
            params = v2.parameters_of(doc)
            priority = bounded_int(params.get("priority", 0), "priority")
            timeout_us = bounded_int(params.get("timeout", 0), "timeout")
            # before the costly part: the tensors
            why = gw.door.refuse_priority(priority, timeout_us > 0)
            if why is not None:
                return await send_error(send, 503, why, {"Retry-After": str(RETRY_AFTER_S)})
            req = v2.decode_document(doc, binary, gw.shm.read if gw.shm.enabled else None)
            if req.parameters.get("sequence_id"):
                raise BadRequest("sequence batching is not supported")
        except (BodyTooLarge, ValueError) as exc:   # a ValueError of a codec: bad input
            return await send_answer_of(send, errors.bad_input(exc))
        timeout_ms = 0.0
        if timeout_us:   # what is left of the budget: the wire carries a remaining time
            timeout_ms = timeout_us / 1000.0 - (time.monotonic() - accepted) * 1000.0
            if timeout_ms <= 0:
                SHED_DEADLINE.inc()
                return await send_error(send, STATUS[ErrorCode.DEADLINE], "deadline exceeded "
                                        "in the gateway, before the request reached the broker")
        sent_ns = time.monotonic_ns() if trace is not None else 0
        got = await self._forward(receive, path["name"], req, version, priority,
                                  timeout_ms, api_key_of(headers),
                                  trace.context if trace is not None else None)
        if trace is not None:
            return await self._traced(send, req, got, headers, trace, sent_ns)
        if isinstance(got, InferError):
            answer = errors.infer_answer(got)
            message = wording.DECOUPLED_HTTP if got.code is ErrorCode.UNSUPPORTED \
                else wording.with_request_id(got.message, req.id)
            return await send_error(send, answer.status.http, message, answer.http_headers())
        return await self._answer(send, req, *got, headers.get("accept-encoding"))

    async def _traced(self, send: Send, req: v2.V2Request,
                      got: tuple[p.InferReply, list[p.Tensor]] | InferError,
                      headers: dict[str, str], trace: Trace, sent_ns: int) -> int:
        """The answer of a traced request, stamped, then its trace record."""
        received_ns = time.monotonic_ns()
        trace.stamp("HTTP_SEND_START")
        outputs: list[p.Tensor]
        if isinstance(got, InferError):
            answer = errors.infer_answer(got)
            status = await send_error(send, answer.status.http,
                                      wording.with_request_id(got.message, req.id),
                                      answer.http_headers())
            reply, outputs, error = None, [], got.message
        else:
            status = await self._answer(send, req, *got, headers.get("accept-encoding"))
            (reply, outputs), error = got, ""
        trace.stamp("HTTP_SEND_END")
        self.gw.tracer.finish(trace, reply, sent_ns, received_ns, req.id or "",
                              req.tensors, outputs, error)
        return status

    async def _forward(self, receive: Receive, name: str, req: v2.V2Request,
                       version: int | None, priority: int, timeout_ms: float, api_key: str,
                       trace: dict[str, str] | None = None
                       ) -> tuple[p.InferReply, list[p.Tensor]] | InferError:
        """The broker's reply (and its tensors, classified where asked), or its error;
        Disconnected when the client leaves meanwhile (the request is withdrawn)."""
        task = asyncio.current_task()
        assert task is not None   # uvicorn runs each request in a task of its own
        waiting = self.leaving.add(task, receive)
        try:
            reply = await self.gw.client.infer_tensors(
                name, req.tensors, version=version, priority=priority, timeout_ms=timeout_ms,
                outputs=req.output_names, api_key=api_key, trace=trace)
            tensors = list(reply.tensors)
            if req.classified:
                tensors = await self.gw.classify(reply.model, reply.version, tensors,
                                                 req.classified, api_key)
            return reply, tensors
        except InferError as exc:
            return exc
        except asyncio.CancelledError:
            if waiting.gone:
                task.uncancel()
                raise Disconnected() from None
            raise
        finally:
            self.leaving.remove(waiting)

    async def _answer(self, send: Send, req: v2.V2Request, reply: p.InferReply,
                      tensors: list[p.Tensor], accept: str | None) -> int:
        try:
            body, json_len = v2.encode_response(reply.model, reply.version, req.id, tensors,
                                                req, self.gw.shm.write, clamped(reply.stats))
        except v2.DecodeError as exc:
            return await send_answer_of(send, errors.bad_input(exc))
        ctype, extra = JSON, None
        if json_len is not None:
            ctype, extra = OCTETS, {"Inference-Header-Content-Length": str(json_len)}
        encoding = encoding_of(accept)
        if encoding is not None:
            body = compress(body, encoding)
            extra = {**(extra or {}), "Content-Encoding": encoding, "Vary": "Accept-Encoding"}
        await send_answer(send, 200, body, ctype, extra)
        return 200


def clamped(stats: dict[str, float]) -> dict[str, Any] | None:
    """What the broker changed of the request (a tenant's class caps its priority and
    timeout), said in the response's parameters as the effective values."""
    out: dict[str, Any] = {}
    if stats.get("priority_clamped"):
        out.update(priority_clamped=True, priority=int(stats.get("priority", 0)))
    if stats.get("timeout_clamped"):
        out.update(timeout_clamped=True, timeout=int(stats.get("timeout_ms", 0) * 1000))
    return out or None
