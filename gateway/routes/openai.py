"""OpenAI's routes: ``POST /v1/embeddings``, ``/v1/completions`` and
``/v1/chat/completions`` (also under KServe's ``/openai/v1``), so that
``OpenAI(base_url="http://host:port/v1")`` and the tools built on it work unchanged.
``GET /v1/models`` is the registration listing, which answers OpenAI's shape too
(gateway/routes/registration.py).

An embeddings call takes the one inference path as every entry point does (the door,
the tenant gate, the priority shed, the deadline from ``X-Timeout-Ms``), then its texts
become tokens (gateway/tokens.py) and each text becomes a row of the broker's batcher
(``AsyncClient.infer_rows``): batched with other requests' rows by priority and
deadline, answered together, in order. Errors are OpenAI's object (gateway/openai.py).
A client that goes away before its answer takes its inputs out of the broker's queue
(gateway/leaving.py), as on the v2 infer route.

A completion or chat request is one stream to a generating (iterative) model: the prompt
goes in as token ids, a token comes back a step, and the gateway turns tokens back into
text (gateway/chat.py), streamed as server-sent events or answered whole. A stop string
or a client that goes away closes the stream, and the sequence leaves its worker at the
next step.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence
import numpy as np
import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from zeroserve.broker import protocol as p
from zeroserve.broker.client import AsyncStream, InferError, RowError, StreamResponse
from zeroserve.gateway import chat, openai
from zeroserve.gateway.apikey import api_key_of
from zeroserve.gateway.http import build_headers, header_int, json_response, read_body
from zeroserve.gateway.inference import InferencePath, peer_host, routing_key
from zeroserve.gateway.leaving import Leaving
from zeroserve.gateway.routes.generate import Events
from zeroserve.gateway.routes.infer import WATCH_AFTER_S
from zeroserve.gateway.tokens import TextModel, Tokenizers, TooLong
from zeroserve.models.text import EMBEDDING, IDS, MASK, MAX_TOKENS, TOKEN

logger = logging.getLogger(__name__)

PREFIXES = ("/v1", "/openai/v1")   # OpenAI's own base URL, and KServe's


class OpenAIRoutes:
    def __init__(self, inference: InferencePath, tokenizers: Tokenizers,
                 max_body_bytes: int) -> None:
        self.inference = inference
        self.tokenizers = tokenizers
        self.max_body_bytes = max_body_bytes
        self.leaving = Leaving(WATCH_AFTER_S)

    def routes(self) -> list[Route]:
        return [route for prefix in PREFIXES for route in (
            Route(f"{prefix}/embeddings", self.embeddings, methods=["POST"]),
            Route(f"{prefix}/completions", self.completions, methods=["POST"]),
            Route(f"{prefix}/chat/completions", self.chat, methods=["POST"]))]

    async def embeddings(self, request: Request) -> Response:
        return await self._serve(request, self._embeddings)

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, partial(self._generate, is_chat=False))

    async def chat(self, request: Request) -> Response:
        return await self._serve(request, partial(self._generate, is_chat=True))

    async def _serve(self, request: Request,
                     work: Callable[[Request, Any, Call], Awaitable[Response]]) -> Response:
        """The one inference path's door, the tenant gate and the priority shed, then
        the route's work on the JSON body; every client error in OpenAI's shape. A
        streamed answer holds its place in flight until its last event (Events)."""
        inference = self.inference
        try:
            accepted = inference.enter()
        except InferError as exc:   # shed at the door
            return _error(exc)
        streaming = False
        try:
            await inference.caller(request.headers)   # with tenants: 401 without a key
            call = Call(accepted, header_int(request, "x-priority"),
                        header_int(request, "x-timeout-ms"), api_key_of(request.headers))
            inference.check_priority(call.priority, call.timeout_ms > 0)
            body = await read_body(request, self.max_body_bytes)
            try:
                doc = orjson.loads(body)
            except orjson.JSONDecodeError as exc:
                raise openai.OpenAIError(f"the body is not valid JSON: {exc}") from None
            response = await work(request, doc, call)
            streaming = isinstance(response, Events)
            return response
        except Exception as exc:
            return _error(exc)
        finally:
            if not streaming:
                inference.leave()

    async def _embeddings(self, request: Request, doc: Any, call: Call) -> Response:
        inference = self.inference
        req = openai.parse_embeddings(doc)
        key = call.api_key
        model = await self.tokenizers.model(req.model, key)
        if model.text.task != "embeddings":
            raise openai.OpenAIError(f"model {req.model!r} does not answer embeddings",
                                     "model")
        try:
            if req.texts is not None:
                ids = await self.tokenizers.encode(model, req.texts)
            else:
                assert req.ids is not None
                openai.check_ids(req.ids, model.vocab_size)
                ids = model.limit(req.ids)
        except TooLong as exc:
            raise openai.OpenAIError(str(exc), "input", "context_length_exceeded") from None
        logger.debug("embeddings of %d inputs for model %s, user %r", len(ids), req.model,
                     req.user)
        # an input repeated in one request is computed once (across requests, the
        # model's response cache answers repeats)
        slot: dict[tuple[int, ...], int] = {}
        of = [slot.setdefault(tuple(row), len(slot)) for row in ids]
        first = {u: i for i, u in reversed(list(enumerate(of)))}
        task = asyncio.current_task()
        assert task is not None   # the server runs each request in a task of its own
        waiting = self.leaving.add(task, request.receive)
        try:
            replies = await inference.infer_rows(
                req.model, [_row(row) for row in slot], priority=call.priority,
                timeout_ms=call.budget_ms(inference),
                outputs=[EMBEDDING], api_key=key,
                routing_key=routing_key(request.headers, {"routing_key": req.user}, key,
                                        peer_host(request.scope.get("client"))))
        except RowError as exc:   # named by the caller's index, not the one sent
            raise RowError(first[exc.row], exc.cause) from None
        except asyncio.CancelledError:
            if waiting.gone:   # the client left: its inputs were withdrawn from the broker
                task.uncancel()
                return Response(status_code=499)
            raise
        finally:
            self.leaving.remove(waiting)
        self.tokenizers.answered_by(model, replies[0].version)
        computed = [_vector(r) for r in replies]
        vectors = openai.vectors([computed[u] for u in of], req.dimensions,
                                 model.text.matryoshka, model.text.normalize)
        answer = openai.embeddings_answer(req.model, vectors, req.base64, sum(map(len, ids)))
        return json_response(answer, headers=build_headers(replies[0].version,
                                                          replies[0].build))


    async def _generate(self, request: Request, doc: Any, call: Call, is_chat: bool
                        ) -> Response:
        inference = self.inference
        req = chat.parse_chat(doc) if is_chat else chat.parse_completions(doc)
        key = call.api_key
        model = await self.tokenizers.model(req.model, key)
        if model.text.task != "generate":
            raise openai.OpenAIError(f"model {req.model!r} does not generate text (its task "
                                     f"is {model.text.task})", "model")
        prompt = _prompt(model, req)
        room = model.text.max_length - len(prompt)
        max_tokens = req.max_tokens if req.max_tokens is not None else room
        if max_tokens > room or room < 1:
            raise openai.OpenAIError(
                f"this model's maximum context length is {model.text.max_length} tokens; "
                f"the prompt has {len(prompt)} and {max_tokens} more were asked for",
                "max_tokens" if room >= 1 else "messages" if is_chat else "prompt",
                "context_length_exceeded")
        # opentelemetry mode: the gateway's span, parent of the stream's queue and
        # sequence spans (workers/spans.py), ends with its last event
        trace = inference.trace_stream(req.model, request.headers, "HTTP_RECV_START")
        stream = inference.stream(
            req.model, _generation_inputs(model, req, prompt, max_tokens),
            priority=call.priority, timeout_ms=call.budget_ms(inference),
            api_key=key, trace=trace.context if trace is not None else None,
            routing_key=routing_key(request.headers, {"routing_key": req.user},
                                    key, peer_host(request.scope.get("client"))))
        answer = Answer(req, model, len(prompt), max_tokens, call.deadline_s())
        if not req.stream:
            error = ""
            try:
                async with stream:
                    while not answer.ended:
                        answer.add(await answer.next(stream))
            except BaseException as exc:
                error = str(exc)
                raise
            finally:
                inference.finish_stream(trace, error)
            return json_response(answer.whole(), headers=build_headers(answer.version,
                                                                        answer.build))
        try:
            first = await answer.next(stream)   # an error now is a plain JSON answer
        except BaseException as exc:
            stream.close()
            inference.finish_stream(trace, str(exc))
            raise
        return Events(answer.events(stream, first, partial(inference.finish_stream, trace)),
                      stream, inference, build_headers(first.version, first.build))


@dataclass(frozen=True)
class Call:
    """What the door and the headers said of a request: when it was let in, its priority
    (``X-Priority``), its deadline (``X-Timeout-Ms``) and its caller's key."""

    accepted: float
    priority: int
    timeout_ms: int
    api_key: str

    def budget_ms(self, inference: InferencePath) -> float:
        """What is left of the deadline, for the wire (0: none)."""
        return inference.budget_ms(self.timeout_ms, self.accepted) if self.timeout_ms else 0.0

    def deadline_s(self) -> float:
        """When the deadline passes, on the monotonic clock (inf: none)."""
        return self.accepted + self.timeout_ms / 1000.0 if self.timeout_ms else math.inf


class Answer:
    """One generation's answer as it comes: tokens to text, stop strings, the finish."""

    def __init__(self, req: chat.GenerationRequest, model: TextModel, prompt_tokens: int,
                 max_tokens: int, deadline_s: float = math.inf) -> None:
        self.req = req
        self.deadline_s = deadline_s
        self.ids = chat.Ids(req.chat)
        self.detok = chat.Detokenizer(model.decode, req.stop)
        self.end = model.end_token()
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.text: list[str] = []
        self.finish: str | None = None
        self.version, self.build = 0, ""
        self._tokens = 0

    @property
    def ended(self) -> bool:
        return self.finish is not None

    def add(self, response: StreamResponse) -> str:
        """A response's tokens; the text they add that may be sent."""
        self.version, self.build = response.version, response.build
        got = response.outputs.get(TOKEN)
        tokens = [int(t) for t in got.reshape(-1)] if got is not None else []
        self._tokens += len(tokens)
        piece = self.detok.add(tokens)
        if self.detok.stopped:
            self.finish = "stop"
        elif response.final:
            piece += self.detok.rest()
            self.finish = "stop" if tokens and tokens[-1] == self.end else "length"
        self.text.append(piece)
        return piece

    async def next(self, stream: AsyncStream) -> StreamResponse:
        """The stream's next response, within the request's deadline (``X-Timeout-Ms``,
        which bounds the whole answer): past it the sequence is withdrawn, closing the
        stream, and the answer is a deadline error, never a silent end."""
        if self.deadline_s == math.inf:
            return await stream.__anext__()
        try:
            return await asyncio.wait_for(stream.__anext__(),
                                          self.deadline_s - time.monotonic())
        except TimeoutError:
            stream.close()
            raise InferError(p.ErrorCode.DEADLINE, f"the deadline passed after "
                             f"{self._tokens} of at most {self.max_tokens} tokens") from None

    def counts(self) -> dict[str, int]:
        return chat.usage(self.prompt_tokens, self._tokens)

    def whole(self) -> dict[str, Any]:
        if self.finish is None:   # the stream ended without a final response
            raise InferError(p.ErrorCode.INTERNAL, "the model's stream ended early")
        return chat.completion(self.ids, self.req.model, "".join(self.text), self.finish,
                               self.counts())

    async def events(self, stream: AsyncStream, first: StreamResponse,
                     done: Callable[[str], None] = lambda error: None
                     ) -> AsyncIterator[bytes]:
        """Server-sent events: the role (chat), the text as it comes, the finish, the
        usage when asked, ``[DONE]``. An error after the first is an error event that
        ends the stream (the openai client raises it); a stop string, or the client
        going away, withdraws the sequence (Events closes the stream). ``done`` is
        told how it ended ('' when whole) once the last event is sent."""
        model = self.req.model
        error = "the client went away"   # unless the stream ends otherwise
        try:
            if self.req.chat:
                yield _sse(chat.chunk(self.ids, model, None, None, first=True))
            response: StreamResponse | None = first
            try:
                while response is not None:
                    piece = self.add(response)
                    if piece:
                        yield _sse(chat.chunk(self.ids, model, piece, None))
                    response = None if self.ended or response.final else \
                        await self.next(stream)
            except InferError as exc:
                error = exc.message
                got = openai.error_of(exc)
                assert got is not None
                yield _sse(got[1])
                return
            yield _sse(chat.chunk(self.ids, model, None, self.finish or "length"))
            if self.req.include_usage:
                yield _sse(chat.usage_chunk(self.ids, model, self.counts()))
            yield b"data: [DONE]\n\n"
            error = ""
        finally:
            done(error)


def _sse(doc: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(doc) + b"\n\n"


def _prompt(model: TextModel, req: chat.GenerationRequest) -> list[int]:
    """The prompt's token ids: chat messages through the model's chat template, a text
    with the tokenizer's own special tokens, or ids as given."""
    if req.messages is not None:
        rendered = chat.render_chat(model.chat_template, req.messages, model.special)
        return model.prompt(rendered, special_tokens=False)
    if req.prompt is not None:
        return model.prompt(req.prompt, special_tokens=True)
    assert req.prompt_ids is not None
    openai.check_ids([req.prompt_ids], model.vocab_size)
    return list(req.prompt_ids)


def _generation_inputs(model: TextModel, req: chat.GenerationRequest, prompt: list[int],
                       max_tokens: int) -> list[p.Tensor]:
    """The prompt, the bound and the sampling settings the model takes (every input it
    declares is sent: left out, OpenAI's defaults, temperature 1 and top_p 1, and a seed
    drawn here). A model that decodes greedily refuses sampling rather than answer what
    was not asked."""
    out = [p.Tensor(p.TensorMeta(IDS, "INT64", (1, len(prompt))),
                    np.asarray(prompt, np.int64).data),
           _scalar(MAX_TOKENS, model.inputs.get(MAX_TOKENS, "INT32"), max_tokens)]
    for name, value, neutral, default in (
            ("temperature", req.temperature, 0.0, 1.0), ("top_p", req.top_p, 1.0, 1.0),
            ("seed", req.seed, None, None)):
        datatype = model.inputs.get(name)
        if datatype is not None:
            if value is None:
                value = default if default is not None else secrets.randbelow(1 << 62)
            out.append(_scalar(name, datatype, value))
        elif value is not None and neutral is not None and value != neutral:
            raise openai.OpenAIError(f"this model decodes greedily: '{name}' {value:g} is not "
                                     f"supported (leave it out, or {neutral:g})", name)
    return out


_NUMPY = {"INT32": np.int32, "INT64": np.int64, "FP32": np.float32, "FP64": np.float64}


def _scalar(name: str, datatype: str, value: float) -> p.Tensor:
    arr = np.asarray([[value]], _NUMPY.get(datatype, np.float32))
    return p.Tensor(p.TensorMeta(name, datatype, (1, 1)), arr.data)


def _row(ids: Sequence[int]) -> list[p.Tensor]:
    """One text's tensors: its ids and a mask of ones (the batch pads both)."""
    shape = (1, len(ids))
    return [p.Tensor(p.TensorMeta(IDS, "INT64", shape), np.asarray(ids, np.int64).data),
            p.Tensor(p.TensorMeta(MASK, "INT64", shape), np.ones(shape, np.int64).data)]


def _vector(reply: p.InferReply) -> np.ndarray:
    for t in reply.tensors:
        if t.meta.name == EMBEDDING:
            return p.to_numpy(t).reshape(-1)
    raise InferError(p.ErrorCode.INTERNAL, f"the model answered no {EMBEDDING!r}")


def _error(exc: Exception) -> Response:
    """A client's error in OpenAI's shape; anything else is a bug, raised again for the
    app's handler to log and answer 500."""
    got = openai.error_of(exc)
    if got is None:
        raise exc
    status, body, headers = got
    return json_response(body, status, headers)

