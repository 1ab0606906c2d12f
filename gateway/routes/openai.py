"""OpenAI's routes: ``POST /v1/embeddings`` (also under KServe's ``/openai/v1``), so that
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
"""

from __future__ import annotations

import asyncio
import logging
from typing import Sequence
import numpy as np
import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from zeroserve.broker import protocol as p
from zeroserve.broker.client import InferError, RowError
from zeroserve.gateway import openai
from zeroserve.gateway.apikey import api_key_of
from zeroserve.gateway.http import build_headers, header_int, json_response, read_body
from zeroserve.gateway.inference import InferencePath, peer_host, routing_key
from zeroserve.gateway.leaving import Leaving
from zeroserve.gateway.routes.infer import WATCH_AFTER_S
from zeroserve.gateway.tokens import Tokenizers, TooLong
from zeroserve.models.text import EMBEDDING, IDS, MASK

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
        return [Route(f"{prefix}/embeddings", self.embeddings, methods=["POST"])
                for prefix in PREFIXES]

    async def embeddings(self, request: Request) -> Response:
        inference = self.inference
        try:
            accepted = inference.enter()
        except InferError as exc:   # shed at the door
            return _error(exc)
        try:
            return await self._embeddings(request, accepted)
        except Exception as exc:
            return _error(exc)
        finally:
            inference.leave()

    async def _embeddings(self, request: Request, accepted: float) -> Response:
        inference = self.inference
        await inference.caller(request.headers)   # with tenants: 401 without a key
        priority = header_int(request, "x-priority")
        timeout_ms = header_int(request, "x-timeout-ms")
        inference.check_priority(priority, timeout_ms > 0)
        body = await read_body(request, self.max_body_bytes)
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise openai.OpenAIError(f"the body is not valid JSON: {exc}") from None
        req = openai.parse_embeddings(doc)
        key = api_key_of(request.headers)
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
                req.model, [_row(row) for row in slot], priority=priority,
                timeout_ms=inference.budget_ms(timeout_ms, accepted) if timeout_ms else 0.0,
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

