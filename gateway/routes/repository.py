"""Routes of the statistics and model repository extensions (Triton's JSON).

Statistics are read-only (the broker's ``stats`` verb). Load and unload change state:
the admin rule of every state-changing route (gateway/access.py), and the verbs go
to the broker's control socket with the admin token (the facade's ``admin``). A load answers
once the broker has loaded the model or failed to (Triton's load call blocks too);
the gRPC service calls the same :class:`~zeroserve.gateway.facade.Facade` methods.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from zeroserve.gateway.access import require_admin
from zeroserve.gateway.facade import Facade
from zeroserve.gateway.http import BadRequest, json_response, path_version, read_body
from zeroserve.gateway.tenantgate import key_of

REPO = "/v2/repository"


class RepositoryRoutes:
    def __init__(self, facade: Facade, admin_token: str, max_body_bytes: int) -> None:
        self.facade = facade
        self.admin_token = admin_token
        self.max_body_bytes = max_body_bytes

    def stats_routes(self) -> list[Route]:
        """Before ``/v2/models/{name}``, which would take ``stats`` for a model name."""
        return [
            Route("/v2/models/stats", self.stats, methods=["GET"]),
            Route("/v2/models/{name}/stats", self.stats, methods=["GET"]),
            Route("/v2/models/{name}/versions/{version}/stats", self.stats, methods=["GET"]),
        ]

    def routes(self) -> list[Route]:
        return [
            Route(REPO + "/index", self.index, methods=["POST"]),
            Route(REPO + "/models/{name}/load", self.load, methods=["POST"]),
            Route(REPO + "/models/{name}/unload", self.unload, methods=["POST"]),
        ]

    async def _body(self, request: Request) -> dict[str, Any]:
        body = await read_body(request, self.max_body_bytes)
        if not body.strip():
            return {}
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise BadRequest(f"body is not valid JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise BadRequest("the body must be a JSON object")
        return doc

    # -- statistics ------------------------------------------------------------
    async def stats(self, request: Request) -> Response:
        name = request.path_params.get("name")
        version = path_version(request)
        return json_response(await self.facade.stats(name, version, key_of(request)))

    # -- repository ------------------------------------------------------------
    async def index(self, request: Request) -> Response:
        doc = await self._body(request)
        ready = doc.get("ready", False)
        if not isinstance(ready, bool):
            raise BadRequest(f"'ready' must be true or false, got {ready!r}")
        return json_response(await self.facade.repository_index(ready, key_of(request)))

    async def load(self, request: Request) -> Response:
        require_admin(request, self.admin_token)
        config, files = load_parameters(await self._body(request))
        await self.facade.load_model(request.path_params["name"], config, files)
        return Response(status_code=200)

    async def unload(self, request: Request) -> Response:
        require_admin(request, self.admin_token)
        await self._body(request)   # unload_dependents: there are no dependents here
        await self.facade.unload_model(request.path_params["name"])
        return Response(status_code=200)


def load_parameters(doc: dict[str, Any]) -> tuple[str | None, dict[str, bytes]]:
    """Triton's load parameters: ``config`` (a JSON string) and ``file:<path>`` (base64
    contents, the path relative to the model folder, such as ``file:1/model.pt``)."""
    params = doc.get("parameters") or {}
    if not isinstance(params, dict):
        raise BadRequest("'parameters' must be a JSON object")
    config = params.get("config")
    if config is not None and not isinstance(config, str):
        raise BadRequest("parameter 'config' must be a string of JSON")
    files: dict[str, bytes] = {}
    for key, value in params.items():
        if not key.startswith("file:"):
            continue
        path = file_path(key)
        if not isinstance(value, str):
            raise BadRequest(f"parameter {key!r} must be base64 file contents")
        try:
            files[path] = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise BadRequest(f"parameter {key!r} is not valid base64") from None
    return config, files


def file_path(key: str) -> str:
    """The model-folder path of a ``file:<path>`` parameter (gRPC sends raw bytes)."""
    path = key[5:]
    if not path or path.startswith("/") or ".." in path.split("/"):
        raise BadRequest(f"parameter {key!r}: the path must stay inside the model folder")
    return path
