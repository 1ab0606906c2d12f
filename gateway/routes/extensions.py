"""Routes of the system shared-memory and logging extensions. Writes follow the admin
rule of every state-changing route (gateway/access.py)."""

from __future__ import annotations

import logging
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from zeroserve.broker import wording
from zeroserve.broker.client import InferError
from zeroserve.broker.protocol import ErrorCode
from zeroserve.gateway.access import require_admin
from zeroserve.gateway.facade import Facade
from zeroserve.gateway.http import BodyTooLarge, BadRequest, json_response, read_body
from zeroserve.gateway.shm import SharedMemory

logger = logging.getLogger(__name__)

SHM = "/v2/systemsharedmemory"
CUDA_SHM = "/v2/cudasharedmemory"
MAX_BODY = 64 << 10


async def json_body(request: Request, empty_ok: bool = False) -> Any:
    try:
        body = await read_body(request, MAX_BODY)
    except BodyTooLarge:
        raise BadRequest(f"the body exceeds {MAX_BODY} bytes") from None
    if not body.strip() and empty_ok:
        return {}
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"body is not valid JSON: {exc}") from None


class Extensions:
    def __init__(self, shm: SharedMemory, facade: Facade, admin_token: str) -> None:
        self.shm = shm
        self.facade = facade
        self.admin_token = admin_token

    def routes(self) -> list[Route]:
        return [
            Route(SHM + "/status", self.shm_status, methods=["GET"]),
            Route(SHM + "/region/{region}/status", self.shm_status, methods=["GET"]),
            Route(SHM + "/region/{region}/register", self.shm_register, methods=["POST"]),
            Route(SHM + "/unregister", self.shm_unregister, methods=["POST"]),
            Route(SHM + "/region/{region}/unregister", self.shm_unregister,
                  methods=["POST"]),
            Route(CUDA_SHM + "/status", self.cuda_status, methods=["GET"]),
            Route(CUDA_SHM + "/region/{region}/status", self.cuda_status, methods=["GET"]),
            Route(CUDA_SHM + "/region/{region}/register", self.cuda_register,
                  methods=["POST"]),
            Route(CUDA_SHM + "/unregister", self.cuda_unregister, methods=["POST"]),
            Route(CUDA_SHM + "/region/{region}/unregister", self.cuda_unregister,
                  methods=["POST"]),
            Route("/v2/logging", self.log_settings, methods=["GET"]),
            Route("/v2/logging", self.change_log_settings, methods=["POST"]),
        ]

    # -- system shared memory ------------------------------------------------
    async def shm_status(self, request: Request) -> Response:
        return json_response(self.shm.status(request.path_params.get("region")))

    async def shm_register(self, request: Request) -> Response:
        require_admin(request, self.admin_token)
        name = request.path_params["region"]
        self.shm.check_enabled()
        doc = await json_body(request)
        if not isinstance(doc, dict) or "key" not in doc or "byte_size" not in doc:
            raise BadRequest("the body must be {\"key\": ..., \"offset\": ..., "
                             "\"byte_size\": ...}")
        self.shm.register(name, doc["key"], doc.get("offset", 0), doc["byte_size"])
        logger.info("shared-memory region %r registered (key %r)", name, doc["key"])
        return Response(status_code=200)

    async def shm_unregister(self, request: Request) -> Response:
        require_admin(request, self.admin_token)
        self.shm.unregister(request.path_params.get("region"))
        return Response(status_code=200)

    # -- CUDA shared memory: answered as a Triton built without GPUs answers ----
    # Tensors reach a worker's GPU from the gateway's host memory, so no region is
    # ever registered: the status is empty, unregistering succeeds (Triton's unregister
    # of a region it does not hold does too), registering says why it cannot.
    async def cuda_status(self, request: Request) -> Response:
        region = request.path_params.get("region")
        if region is not None:
            raise InferError(ErrorCode.NOT_FOUND, wording.cuda_shm_unknown(region))
        return json_response([])

    async def cuda_register(self, request: Request) -> Response:
        require_admin(request, self.admin_token)
        raise BadRequest(wording.cuda_shm_unsupported(request.path_params["region"]))

    async def cuda_unregister(self, request: Request) -> Response:
        require_admin(request, self.admin_token)
        return Response(status_code=200)

    # -- logging ---------------------------------------------------------------
    async def log_settings(self, request: Request) -> Response:
        return json_response(await self.facade.log_settings())

    async def change_log_settings(self, request: Request) -> Response:
        require_admin(request, self.admin_token)
        doc = await json_body(request, empty_ok=True)
        return json_response(await self.facade.change_log_settings(doc))
