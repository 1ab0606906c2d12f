"""``POST /v2/models/{m}[/versions/{v}]/infer``: the one implementation of inference
over HTTP, a plain ASGI endpoint.

It is reached two ways with the same code: :class:`~zeroserve.gateway.fastpath.
InferFastPath` calls it straight from uvicorn (around Starlette's middleware and
router, which cost about 40% of the gateway's CPU per inference when measured with
py-spy), and the Starlette route calls it for an app used without the fast path
(tests, embedding). The body is read once, with one size check; the answer is
written with no Response object: under the gateway's own uvicorn protocol
(gateway/http1.py) the body is taken and the answer written in one call each, without
ASGI messages; elsewhere with two ``send`` calls.

It takes the one inference path (gateway/inference.py) as every entry point does: the
door before the body is read (503 with Retry-After past the in-flight bound or far
behind), the tenant gate, the lag shed of the lower priorities once the JSON header is
parsed and before the tensors are decoded, then the deadline: ``parameters.timeout``
becomes what is left of it when the request is handed to the broker (the wire carries
a remaining budget), counted from the request's arrival, and a request whose budget
ran out inside the gateway is answered 504 here without reaching the broker.

A request whose HTTP client went away is withdrawn: once it has waited for the broker
a while, a task waits for ``http.disconnect`` and cancels the handler, and cancelling
the client call sends the broker a CANCEL, so the queued request leaves the queue
(gateway/leaving.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Iterable, TypeAlias, Union

import orjson
from starlette.types import Receive, Scope, Send

from zeroserve.broker import protocol as p
from zeroserve.broker import wording
from zeroserve.broker.client import ErrorCode, InferError
from zeroserve.gateway import v2
from zeroserve.gateway.apikey import api_key_of
from zeroserve.gateway import errors
from zeroserve.gateway.errors import BadRequest, BodyTooLarge
from zeroserve.gateway.http1 import ONE_WRITE, OneWrite
from zeroserve.gateway.inference import ROUTING_HEADER, InferencePath, peer_host, routing_key
from zeroserve.gateway.shm import SharedMemory
from zeroserve.gateway.tracing import Trace
from zeroserve.gateway.leaving import Leaving
from zeroserve.gateway.http import BUILD_HEADER, bounded_int, compress, decompress, \
    encoding_of, parse_version

logger = logging.getLogger(__name__)

# the request headers this route reads; everything else is never decoded
WANTED = frozenset({b"content-length", b"content-encoding", b"accept-encoding",
                    b"authorization", b"x-api-key", v2.HEADER_LENGTH.encode(),
                    b"traceparent", b"tracestate", ROUTING_HEADER.encode()})
JSON = b"application/json"
OCTETS = b"application/octet-stream"
BUILD = BUILD_HEADER.lower().encode()
HEADER_LENGTH = b"inference-header-content-length"
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


# where an answer goes: the request's OneWrite under the gateway's protocol, else ASGI's send
To: TypeAlias = Union[Send, OneWrite]


async def send_answer(to: To, status: int, body: bytes, content_type: bytes = JSON,
                      headers: dict[str, str] | None = None) -> None:
    extra = [(k.lower().encode(), v.encode("latin-1")) for k, v in headers.items()] \
        if headers else []
    if isinstance(to, OneWrite):
        to.answer(status, content_type, body, extra)
        return
    await send_asgi(to, status, body, content_type, extra)


async def send_asgi(send: Send, status: int, body: bytes, content_type: bytes,
                    extra: list[tuple[bytes, bytes]]) -> None:
    head = [(b"content-type", content_type), (b"content-length", b"%d" % len(body)), *extra]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})


def build_header_bytes(version: int, build: str) -> list[tuple[bytes, bytes]]:
    """:func:`~zeroserve.gateway.http.build_headers` as the answer writes it, without
    a dict of text to lower and encode on each answer."""
    return [(BUILD, b"%d/%s" % (version, build.encode("latin-1")))] if build else []


async def send_error(to: To, status: int, message: str,
                     headers: dict[str, str] | None = None) -> int:
    await send_answer(to, status, orjson.dumps({"error": message}), JSON, headers)
    return status


async def send_answer_of(to: To, answer: errors.Answer) -> int:
    """An error of the table (gateway/errors.py), answered as every other route does."""
    return await send_error(to, answer.status.http, answer.message, answer.http_headers())


async def read_all(receive: Receive, declared: str | None, limit: int) -> bytes:
    """The raw body through ASGI's messages; BodyTooLarge past ``limit``, Disconnected
    if the client left."""
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

    def __init__(self, inference: InferencePath, shm: SharedMemory,
                 max_body_bytes: int) -> None:
        self.inference = inference
        self.shm = shm
        self.max_body_bytes = max_body_bytes
        self.leaving = Leaving(WATCH_AFTER_S)

    async def __call__(self, scope: Scope, receive: Receive, asgi_send: Send) -> None:
        inference = self.inference
        # taken out of the scope at once: scope -> OneWrite -> uvicorn's cycle -> scope is
        # a reference cycle, which left each request's cycle, scope, headers and event
        # (11 objects) to the cyclic collector: 11 us a request at C=64 (HTTP JSON, mlp)
        send: To = scope.pop(ONE_WRITE, None) or asgi_send
        try:
            accepted = inference.enter()
        except InferError as exc:   # shed at the door
            scope[STATUS_KEY] = await send_answer_of(send, errors.infer_answer(exc))
            return
        status = 500
        try:
            status = await self._infer(scope, receive, send, accepted)
        except Disconnected:
            status = 499
        except Exception:  # a bug: answer JSON, log the traceback, keep serving
            logger.exception("unexpected error on POST %s", scope.get("path"))
            status = await send_error(send, 500, "internal error")
        finally:
            inference.leave()
            scope[STATUS_KEY] = status

    async def _infer(self, scope: Scope, receive: Receive, send: To,
                     accepted: float) -> int:
        inference, limit = self.inference, self.max_body_bytes
        headers = wanted_headers(scope["headers"])
        path = scope["path_params"]
        api_key = api_key_of(headers)
        # the gate's coroutine only where it may refuse or must ask the broker: a caller
        # with a key is let through, and so is one without while tenants are known off
        if not api_key and not inference.open_now():
            try:   # with tenants, a caller without a key learns nothing, not even a 400
                await inference.caller(headers)
            except InferError as exc:
                return await send_answer_of(send, errors.infer_answer(exc))
        trace = inference.trace(path["name"], headers)
        try:
            version = parse_version(path.get("version"))
            # the whole body at hand (the usual case under the gateway's protocol) is
            # taken without read_all's coroutine
            body = send.body() if isinstance(send, OneWrite) else None
            if body is None:
                body = await read_all(receive, headers.get("content-length"), limit)
            elif len(body) > limit:
                raise BodyTooLarge(limit)
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
            inference.check_priority(priority, timeout_us > 0)
            req = v2.decode_document(doc, binary, self.shm.read if self.shm.enabled else None)
            if req.parameters.get("sequence_id"):
                raise BadRequest("sequence batching is not supported")
            # what is left of the budget: the wire carries a remaining time
            timeout_ms = inference.budget_ms(timeout_us / 1000.0, accepted) if timeout_us \
                else 0.0
        except (BodyTooLarge, ValueError) as exc:   # a ValueError of a codec: bad input
            return await send_answer_of(send, errors.bad_input(exc))
        except InferError as exc:   # shed behind, or the deadline spent in the gateway
            return await send_answer_of(send, errors.infer_answer(exc))
        sent_ns = time.monotonic_ns() if trace is not None else 0
        got = await self._forward(receive, send.loop if isinstance(send, OneWrite) else None,
                                  path["name"], req, version, priority, timeout_ms, api_key,
                                  trace.context if trace is not None else None,
                                  routing_key(headers, params, api_key,
                                              peer_host(scope.get("client"))))
        if trace is not None:
            return await self._traced(send, req, got, headers, trace, sent_ns)
        if isinstance(got, InferError):
            answer = errors.infer_answer(got)
            message = wording.DECOUPLED_HTTP if got.code is ErrorCode.UNSUPPORTED \
                else wording.with_request_id(got.message, req.id)
            return await send_error(send, answer.status.http, message, answer.http_headers())
        return await self._answer(send, req, *got, headers.get("accept-encoding"))

    async def _traced(self, send: To, req: v2.V2Request,
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
        self.inference.finish(trace, reply, sent_ns, received_ns, req.id or "",
                              req.tensors, outputs, error)
        return status

    async def _forward(self, receive: Receive, loop: asyncio.AbstractEventLoop | None,
                       name: str, req: v2.V2Request,
                       version: int | None, priority: int, timeout_ms: float, api_key: str,
                       trace: dict[str, str] | None = None, key: str = ""
                       ) -> tuple[p.InferReply, list[p.Tensor]] | InferError:
        """The broker's reply (and its tensors, classified where asked), or its error;
        Disconnected when the client leaves meanwhile (the request is withdrawn).
        ``loop``, where known, spares asyncio's search for the running one (a system call)."""
        task = asyncio.current_task(loop)
        assert task is not None   # uvicorn runs each request in a task of its own
        waiting = self.leaving.add(task, receive)
        try:
            reply = await self.inference.infer(
                name, req.tensors, version=version, priority=priority, timeout_ms=timeout_ms,
                outputs=req.output_names, api_key=api_key, trace=trace, routing_key=key)
            tensors = list(reply.tensors)
            if req.outputs is not None and req.classified:
                tensors = await self.inference.classify(reply.model, reply.version, tensors,
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

    async def _answer(self, send: To, req: v2.V2Request, reply: p.InferReply,
                      tensors: list[p.Tensor], accept: str | None) -> int:
        try:
            body, json_len = v2.encode_response(reply.model, reply.version, req.id, tensors,
                                                req, self.shm.write, clamped(reply.stats))
        except v2.DecodeError as exc:
            return await send_answer_of(send, errors.bad_input(exc))
        ctype, extra = JSON, build_header_bytes(reply.version, reply.build)
        if json_len is not None:
            ctype = OCTETS
            extra.append((HEADER_LENGTH, b"%d" % json_len))
        if accept is not None:
            encoding = encoding_of(accept)
            if encoding is not None:
                body = compress(body, encoding)
                extra += ((b"content-encoding", encoding.encode()),
                          (b"vary", b"Accept-Encoding"))
        if isinstance(send, OneWrite):   # no coroutine: the answer is one call
            send.answer(200, ctype, body, extra)
        else:
            await send_asgi(send, 200, body, ctype, extra)
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
