"""Triton's generate extension: ``POST /v2/models/{m}[/versions/{v}]/generate`` and
``/generate_stream`` (docs/streaming.md; the JSON is gateway/generate.py's).

Both send the request as a stream (``AsyncClient.stream``), so they serve decoupled
models and plain ones alike (a plain model's one reply is its final response).

- ``/generate`` answers one JSON document: the model's last response with outputs (a
  decoupled model that sends increments is read with ``/generate_stream``).
- ``/generate_stream`` answers Server-Sent Events, ``data: {json}\\n\\n`` per response
  (an empty final response sends none). The status is sent with the first event, so
  the first response is awaited before anything is sent: an error before it is a JSON
  error with its status, as for any route; an error after it is an event
  ``data: {"error": "..."}`` and the end of the stream. A client that closes the
  connection cancels the request, which stops the generation at its worker.

Both take the one inference path (gateway/inference.py) as every entry point does; a
request counts in flight until its last event is sent.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Awaitable, Callable

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from zeroserve.broker import wording
from zeroserve.broker.client import AsyncStream, InferError, StreamResponse
from zeroserve.gateway import generate
from zeroserve.gateway.apikey import api_key_of
from zeroserve.gateway.errors import BadRequest
from zeroserve.gateway.http import bounded_int, build_headers, path_version, read_body
from zeroserve.gateway.inference import InferencePath, peer_host, routing_key
from zeroserve.gateway.tracing import Trace

SSE = "text/event-stream; charset=utf-8"


class GenerateRoutes:
    def __init__(self, inference: InferencePath, control: Callable[..., Awaitable[Any]],
                 max_body_bytes: int) -> None:
        self.inference = inference
        self.control = control   # the model's metadata, which maps the JSON to tensors
        self.max_body_bytes = max_body_bytes

    def routes(self) -> list[Route]:
        out = []
        for base in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
            out.append(Route(base + "/generate", self.generate, methods=["POST"]))
            out.append(Route(base + "/generate_stream", self.generate_stream,
                             methods=["POST"]))
        return out

    async def _start(self, request: Request, accepted: float
                     ) -> tuple[AsyncStream, Trace | None]:
        name, version = request.path_params["name"], path_version(request)
        trace = self.inference.trace_stream(name, request.headers, "HTTP_RECV_START")
        try:
            return await self._send(request, name, version, accepted, trace), trace
        except BaseException as exc:
            self.inference.finish_stream(trace, str(exc))
            raise

    async def _send(self, request: Request, name: str, version: int | None, accepted: float,
                    trace: Trace | None) -> AsyncStream:
        inference = self.inference
        await inference.caller(request.headers)   # with tenants: 401 without a key
        api_key = api_key_of(request.headers)
        body = await read_body(request, self.max_body_bytes)
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise BadRequest(wording.bad_json(exc.msg, exc.pos)) from None
        # the caller's key: with tenants, the broker shows it only models it may call
        meta = await self.control("metadata", model=name, version=version, api_key=api_key)
        tensors, params = generate.request_tensors(doc, meta)
        priority = bounded_int(params.get("priority", 0), "priority")
        timeout_us = bounded_int(params.get("timeout", 0), "timeout")
        inference.check_priority(priority, timeout_us > 0)
        # what is left of it: the wire carries a remaining budget
        timeout_ms = inference.budget_ms(timeout_us / 1000.0, accepted) if timeout_us else 0.0
        return inference.stream(name, tensors, version=version, priority=priority,
                                timeout_ms=timeout_ms,
                                api_key=api_key,
                                trace=trace.context if trace is not None else None,
                                routing_key=routing_key(request.headers, params, api_key,
                                                        peer_host(request.scope.get("client"))))

    async def generate(self, request: Request) -> Response:
        inference = self.inference
        accepted = inference.enter()
        try:
            stream, trace = await self._start(request, accepted)
            last: StreamResponse | None = None
            error = ""
            try:
                async with stream:
                    async for response in stream:
                        if response.tensors or last is None:
                            last = response
            except BaseException as exc:
                error = str(exc)
                raise
            finally:
                inference.finish_stream(trace, error)
        finally:
            inference.leave()
        assert last is not None   # a stream ends with a final response or raises
        return Response(generate.response_body(last.model, last.version, last.tensors),
                        headers=build_headers(last.version, last.build),
                        media_type="application/json")

    async def generate_stream(self, request: Request) -> Response:
        inference = self.inference
        accepted = inference.enter()
        try:
            stream, trace = await self._start(request, accepted)
            try:
                first = await stream.__anext__()   # an error now is a plain JSON answer
            except BaseException as exc:
                stream.close()
                inference.finish_stream(trace, str(exc))
                raise
        except BaseException:
            inference.leave()
            raise
        return Events(_events(stream, first, inference, trace), stream, inference,
                      build_headers(first.version, first.build))


class Events(StreamingResponse):
    """The event stream, which holds its request in flight until it ends however it
    ends (its generator may never start when the client leaves first)."""

    def __init__(self, events: AsyncIterator[bytes], stream: AsyncStream,
                 inference: InferencePath, build: dict[str, str]) -> None:
        super().__init__(events, media_type=SSE, headers={"Cache-Control": "no-cache",
                                                          "X-Accel-Buffering": "no", **build})
        self._stream = stream
        self._inference = inference

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._stream.close()
            self._inference.leave()


async def _events(stream: AsyncStream, first: StreamResponse, inference: InferencePath,
                  trace: Trace | None) -> AsyncIterator[bytes]:
    """Each response as an event; an error after the first as an error event. Closing
    the stream (the client left: Starlette cancels this generator) cancels the request."""
    response: StreamResponse | None = first
    error = "the client went away"   # unless the stream ends otherwise
    try:
        while response is not None:
            if response.tensors or not response.final:
                yield generate.event(generate.response_body(response.model, response.version,
                                                            response.tensors))
            response = None if response.final else await stream.__anext__()
        error = ""
    except InferError as exc:
        error = exc.message
        yield generate.event(orjson.dumps({"error": exc.message}))
    except ValueError as exc:   # an output JSON cannot carry (BF16)
        error = str(exc)
        yield generate.event(orjson.dumps({"error": str(exc)}))
    finally:
        stream.close()
        inference.finish_stream(trace, error)
