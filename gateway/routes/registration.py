"""The registration API (the seed's): ``POST /v1/models``, ``GET /v1/models``,
``GET|DELETE /v1/models/{name}``, ``DELETE /v1/models/{name}/versions/{v}``, and
config changes: ``PATCH /v1/models/{name}/config`` (broker/server/configwrite.py), and
pushes: ``POST /v1/models/{name}/versions`` adds a version (JSON ``{"model_path": ...,
"version": N}``, or the model file itself as ``application/octet-stream`` with
``?version=N``; the next version when left out).

The broker owns the repository: these routes only forward to its control verbs.
Both answer once the model is servable (a request for it no longer gets 404 or waits on
a load that has not started): they wait up to ``?wait=SECONDS`` (30 by default) after
the publish for the watcher to pick the folder up and a worker to load it. ``"ready":
false`` in the 201 says the wait ran out first; ``GET /v2/models/{name}/ready`` tells
when it is. A worker not yet connected is a 503 with Retry-After, not a fault of the
model.

Routes that change state answer only to loopback clients, unless an admin token is
configured (``ZEROSERVE_ADMIN_TOKEN``), in which case they need
``Authorization: Bearer <token>`` from anywhere.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from zeroserve.broker import wording
from zeroserve.broker.client import AsyncClient, InferError
from zeroserve.broker.protocol import ErrorCode
from zeroserve.gateway import readiness
from zeroserve.gateway.access import require_admin
from zeroserve.gateway.openai import model_entry
from zeroserve.gateway.http import MAX_INT, BadRequest, error_response, json_response, \
    parse_version, path_version, read_body

logger = logging.getLogger(__name__)

REGISTER_TIMEOUT_S = 300.0
MAX_BODY_BYTES = 1 << 20
PUSH_MAX_BYTES = 256 << 20   # an uploaded model file; larger ones come by model_path
PUSH_FIELDS = frozenset({"model_path", "version", "metadata"})
STATUS_POLL_S = 0.05
DEFAULT_WAIT_S = 30.0
NO_WORKER_RETRY_S = 1
# how a failed job's kind answers; anything else is the body's fault (400)
FAILED_STATUS = {"load": 422, "conflict": 409, "publish": 409, "no_worker": 503}


class Registration:
    def __init__(self, control: Callable[..., Awaitable[Any]], admin: AsyncClient,
                 admin_token: str) -> None:
        self.control = control   # read-only verbs, on the frontend
        self.admin = admin       # what changes state, on the control socket
        self.admin_token = admin_token

    def routes(self) -> list[Route]:
        return [
            Route("/v1/models", self.create, methods=["POST"]),
            Route("/v1/models", self.list, methods=["GET"]),
            Route("/openai/v1/models", self.list, methods=["GET"]),
            Route("/v1/models/{name}", self.get, methods=["GET"]),
            Route("/v1/models/{name}", self.delete, methods=["DELETE"]),
            Route("/v1/models/{name}/versions/{version}", self.delete, methods=["DELETE"]),
            Route("/v1/models/{name}/versions", self.push, methods=["POST"]),
            Route("/v1/models/{name}/config", self.configure, methods=["PATCH"]),
        ]

    async def create(self, request: Request) -> Response:
        require_admin(request, self.admin_token)
        try:
            doc = orjson.loads(await read_body(request, MAX_BODY_BYTES))
        except orjson.JSONDecodeError as exc:
            raise BadRequest(f"body is not valid JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise BadRequest("body must be a JSON object with name, platform, "
                             "model_path, inputs (or input_shape) and optionally outputs")
        wait_s = _wait_s(request)
        job = await self.admin.control("register", body=doc)
        status = await self._follow(str(job["token"]))
        if status["state"] != "published":
            return _failed(status, "registration failed")
        name = status["name"]
        # inputs and outputs as published: what a trial load found, where the body
        # left them out
        return json_response({"name": name, "versions": status["versions"],
                              "state": "published", "inputs": status.get("inputs", []),
                              "outputs": status.get("outputs", []),
                              **await self._servable(name, None, wait_s)}, 201,
                             {"Location": f"/v1/models/{name}"})

    async def push(self, request: Request) -> Response:
        require_admin(request, self.admin_token)
        name = request.path_params["name"]
        wait_s = _wait_s(request)
        args = await self._push_args(request)
        job = await self.admin.control("push", model=name, **args)
        status = await self._follow(str(job["token"]))
        if status["state"] != "published":
            return _failed(status, "push failed")
        same, version = status["kind"] == "same", status["versions"][0]
        return json_response({"name": name, "version": version, "sha256": status["sha256"],
                              "state": "unchanged" if same else "published",
                              **await self._servable(name, version, wait_s)},
                             200 if same else 201, {"Location": f"/v1/models/{name}"})

    async def configure(self, request: Request) -> Response:
        """The fields given replace the config's (null: back to the default), validated
        and applied by the watcher's swap; answered once the model serves under it (up to
        ``?wait=``), or with ``"applied": false`` and why not yet."""
        require_admin(request, self.admin_token)
        name = request.path_params["name"]
        wait_s = _wait_s(request)
        try:
            doc = orjson.loads(await read_body(request, MAX_BODY_BYTES))
        except orjson.JSONDecodeError as exc:
            raise BadRequest(f"body is not valid JSON: {exc}") from None
        done = await self.admin.control("configure", model=name, changes=doc)
        deadline = time.monotonic() + wait_s
        while True:
            models = await self.control("models")
            if name in models["errors"]:
                return json_response({"name": name, "config": done["config"],
                                      "applied": False, "detail": models["errors"][name]})
            config = await self.control("config", model=name)
            if config == done["config"]:
                return json_response({"name": name, "config": config, "applied": True})
            if time.monotonic() >= deadline:
                return json_response({"name": name, "config": done["config"],
                                      "applied": False, "detail": (
                                          "written, not applied yet (the swap is under way): "
                                          f"GET /v1/models/{name} shows the config served")})
            await asyncio.sleep(STATUS_POLL_S)  # the catalog changes without telling us

    async def _servable(self, name: str, version: int | None,
                        wait_s: float) -> dict[str, Any]:
        """``{"ready": true}`` once the model (or the pushed version) serves, polled up to
        ``wait_s``; else ``ready`` false and what to do."""
        deadline = time.monotonic() + wait_s
        while True:
            doc = await self.control("models")
            entry = doc["models"].get(name)
            if entry is not None and readiness.serving(entry) and (
                    version is None or version in entry["ready"] or entry.get("on_demand")
                    and version in entry["versions"]):
                return {"ready": True}
            error = doc["errors"].get(name)
            if error:
                return {"ready": False, "detail": f"published, but loading it failed: {error}"}
            if time.monotonic() >= deadline:
                return {"ready": False, "detail": (
                    f"published, not servable yet: GET /v2/models/{name}/ready answers 200 "
                    f"when it is, or ask again with ?wait=SECONDS to block until then")}
            await asyncio.sleep(STATUS_POLL_S)  # the catalog changes without telling us

    async def _push_args(self, request: Request) -> dict[str, Any]:
        """The push's files and version, from an upload or a JSON body."""
        raw = request.query_params.get("version")
        version = parse_version(raw) if raw is not None else None
        if request.headers.get("content-type", "").startswith("application/octet-stream"):
            data = await read_body(request, PUSH_MAX_BYTES)
            if not data:
                raise BadRequest("the body is empty: upload the model file")
            return {"data": data, "version": version}
        try:
            doc = orjson.loads(await read_body(request, MAX_BODY_BYTES))
        except orjson.JSONDecodeError as exc:
            raise BadRequest(f"body is not valid JSON: {exc}") from None
        if not isinstance(doc, dict) or set(doc) - PUSH_FIELDS:
            raise BadRequest("body must be a JSON object with model_path and optionally "
                             "version and metadata (a push takes the model's config as "
                             "it is)")
        got = doc.get("version", version)
        if got is not None and (isinstance(got, bool) or not isinstance(got, int)
                                or not 0 < got <= MAX_INT):
            raise BadRequest(f"version must be an integer in [1, {MAX_INT}]")
        meta = {"metadata": doc["metadata"]} if doc.get("metadata") is not None else {}
        return {"model_path": doc.get("model_path"), "version": got, **meta}

    async def _follow(self, token: str) -> dict[str, Any]:
        deadline = time.monotonic() + REGISTER_TIMEOUT_S
        while True:
            status: dict[str, Any] = await self.admin.control("register_status",
                                                                  token=token)
            if status["state"] in ("published", "failed") or time.monotonic() > deadline:
                return status
            await asyncio.sleep(STATUS_POLL_S)  # the broker answers at once: poll the job

    async def list(self, request: Request) -> Response:
        doc = await self.control("models")
        # OpenAI's shape beside the registration's, so OpenAI(base_url=".../v1") lists
        # the served models: its clients read "data" and leave the rest
        return json_response({"object": "list",
                              "data": [model_entry(n) for n in doc["models"]],
                              "models": [_summary(n, m) for n, m in doc["models"].items()],
                              "errors": doc["errors"]})

    async def get(self, request: Request) -> Response:
        name = request.path_params["name"]
        doc = await self.control("models")
        if name not in doc["models"]:
            error = doc["errors"].get(name)
            raise InferError(ErrorCode.NOT_FOUND, wording.unknown_model(name) +
                             (f": {error}" if error else ""))
        config = await self.control("config", model=name)
        return json_response({**model_entry(name), **_summary(name, doc["models"][name]),
                              "config": config})

    async def delete(self, request: Request) -> Response:
        require_admin(request, self.admin_token)
        doc = await self.admin.control("unregister", model=request.path_params["name"],
                                          version=path_version(request))
        return json_response(doc)


def _wait_s(request: Request) -> float:
    raw = request.query_params.get("wait")
    if raw is None:
        return DEFAULT_WAIT_S
    try:
        wait_s = float(raw)
    except ValueError:
        wait_s = -1.0
    if not 0 <= wait_s <= REGISTER_TIMEOUT_S:
        raise BadRequest(f"wait must be a number of seconds in [0, {REGISTER_TIMEOUT_S:g}], "
                         f"got {raw!r}")
    return wait_s


def _failed(status: dict[str, Any], what: str) -> Response:
    code = FAILED_STATUS.get(status["kind"], 400)
    headers = {"Retry-After": str(NO_WORKER_RETRY_S)} if code == 503 else None
    return error_response(code, status["error"] or what, headers)


def _summary(name: str, m: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "platform": m["platform"], "versions": m["versions"],
            "ready": m["ready"], "default_version": m["default_version"],
            "workers": m["workers"],
            **{k: m[k] for k in ("last_failure", "provenance") if k in m}}
