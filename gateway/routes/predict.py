"""The seed's path-prefix predict routes and TorchServe-compatible routes.

    POST /models/{name}/predict, POST /models/{name}/{version}/predict (the version
    written "2" or, as the seed writes it, "v2")
    POST /predictions/{name}, POST /predictions/{name}/{version}, GET /ping

Both take simple JSON (see gateway/simple.py); the datatypes come from the model's
metadata, cached briefly so a request costs no extra round trip. Headers
``X-Priority`` (1 is highest) and ``X-Timeout-Ms`` carry what v2 puts in parameters.
Both take the one inference path (gateway/inference.py) as every entry point does: the
door, the tenant gate, the lag shed by priority and the deadline counted from the door.
"""

from __future__ import annotations

import time
from typing import Any, Awaitable, Callable

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from zeroserve.broker import protocol as p
from zeroserve.gateway import simple
from zeroserve.gateway.apikey import api_key_of
from zeroserve.gateway.facade import Facade
from zeroserve.gateway.http import MAX_INT, BadRequest, build_headers, compressed, \
    header_int, json_response, read_body
from zeroserve.gateway.inference import InferencePath, peer_host, routing_key

METADATA_TTL_S = 2.0


class ModelInfoCache:
    """Model metadata by (name, version), kept ``ttl_s``: datatypes change only with a
    new config, and the broker re-validates every request anyway."""

    def __init__(self, control: Callable[..., Awaitable[Any]],
                 ttl_s: float = METADATA_TTL_S) -> None:
        self.control = control
        self.ttl_s = ttl_s
        # by caller too: with tenants, what a key may see is the broker's to say
        self._cache: dict[tuple[str, int | None, str], tuple[float, simple.ModelInfo]] = {}

    async def get(self, name: str, version: int | None, api_key: str) -> simple.ModelInfo:
        now = time.monotonic()
        hit = self._cache.get((name, version, api_key))
        if hit is not None and now - hit[0] < self.ttl_s:
            return hit[1]
        meta = await self.control("metadata", model=name, version=version,
                                     api_key=api_key)
        info = simple.ModelInfo.from_metadata(meta)
        if len(self._cache) > 4096:  # unknown names are not cached, so this is a bound
            self._cache.clear()
        self._cache[(name, version, api_key)] = (now, info)
        return info


def _version(raw: str | None, prefix: str = "") -> int | None:
    """A path version: "3", TorchServe's "3.0", or with ``prefix`` "v" the seed's "v3"."""
    if raw is None:
        return None
    text = raw[len(prefix):] if prefix and raw.startswith(prefix) else raw
    text = text[:-2] if text.endswith(".0") else text
    if not text.isdigit() or not 1 <= int(text) <= MAX_INT:
        raise BadRequest(f"version must be a positive integer, got {raw!r}")
    return int(text)


Handler = Callable[[Request, Any, simple.ModelInfo, int | None, float], Awaitable[Response]]


class SimpleRoutes:
    def __init__(self, inference: InferencePath, facade: Facade, max_body_bytes: int) -> None:
        self.inference = inference
        self.facade = facade
        self.max_body_bytes = max_body_bytes
        self.infos = ModelInfoCache(facade.control)

    async def _serve(self, request: Request, handler: Handler, prefix: str = "") -> Response:
        """Everything the two route families share: the door, body, JSON, metadata."""
        inference = self.inference
        accepted = inference.enter()
        try:
            await inference.caller(request.headers)   # with tenants: 401 without a key
            inference.check_priority(header_int(request, "x-priority"),
                                     header_int(request, "x-timeout-ms") > 0)
            name = request.path_params["name"]
            version = _version(request.path_params.get("version"), prefix)
            body = await read_body(request, self.max_body_bytes)
            try:
                doc = orjson.loads(body)
            except orjson.JSONDecodeError as exc:
                raise BadRequest(f"malformed JSON: {exc}") from None
            info = await self.infos.get(name, version, api_key_of(request.headers))
            return await handler(request, doc, info, version, accepted)
        finally:
            inference.leave()

    async def _infer(self, request: Request, tensors: list[p.Tensor], version: int | None,
                     accepted: float, outputs: list[str] | None = None) -> p.InferReply:
        timeout_ms = header_int(request, "x-timeout-ms")
        return await self.inference.infer(
            request.path_params["name"], tensors, version=version,
            priority=header_int(request, "x-priority"),
            timeout_ms=self.inference.budget_ms(timeout_ms, accepted) if timeout_ms else 0.0,
            outputs=outputs, api_key=api_key_of(request.headers),
            routing_key=routing_key(request.headers, {}, api_key_of(request.headers),
                                    peer_host(request.scope.get("client"))))

    async def predict(self, request: Request) -> Response:
        return await self._serve(request, self._predict, prefix="v")

    async def _predict(self, request: Request, doc: Any, info: simple.ModelInfo,
                       version: int | None, accepted: float) -> Response:
        tensors, single, outputs, rid = simple.decode_seed(doc, info)
        reply = await self._infer(request, tensors, version, accepted, outputs)
        out = simple.encode_seed(reply.model, reply.version, rid, reply.tensors, single)
        return compressed(request, orjson.dumps(out),
                          headers=build_headers(reply.version, reply.build))

    async def predictions(self, request: Request) -> Response:
        return await self._serve(request, self._predictions)

    async def _predictions(self, request: Request, doc: Any, info: simple.ModelInfo,
                           version: int | None, accepted: float) -> Response:
        tensors, single = simple.decode_torchserve(doc, info)
        reply = await self._infer(request, tensors, version, accepted)
        return compressed(request, orjson.dumps(simple.encode_torchserve(reply.tensors, single)),
                          headers=build_headers(reply.version, reply.build))

    async def ping(self, request: Request) -> Response:
        """TorchServe's health check; not ready answers 503 with the reason."""
        why = await self.facade.not_ready()
        if why:
            return json_response({"status": "Unhealthy", "error": why}, 503)
        return json_response({"status": "Healthy"})


def routes(inference: InferencePath, facade: Facade, max_body_bytes: int) -> list[Route]:
    r = SimpleRoutes(inference, facade, max_body_bytes)
    return [
        Route("/models/{name}/predict", r.predict, methods=["POST"]),
        Route("/models/{name}/{version}/predict", r.predict, methods=["POST"]),
        Route("/predictions/{name}", r.predictions, methods=["POST"]),
        Route("/predictions/{name}/{version}", r.predictions, methods=["POST"]),
        Route("/ping", r.ping, methods=["GET"]),
    ]
