"""Health, server metadata and the per-model read routes of KServe v2: live, ready,
``GET /v2``, ``/v2/models/{m}[/versions/{v}]``, ``.../ready``, ``.../config``."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from zeroserve.gateway.facade import Facade
from zeroserve.gateway.http import error_response, json_response, path_version
from zeroserve.gateway.tenantgate import key_of


class ModelRoutes:
    def __init__(self, facade: Facade) -> None:
        self.facade = facade

    def routes(self) -> list[Route]:
        m = "/v2/models/{name}"
        mv = "/v2/models/{name}/versions/{version}"
        return [
            Route("/v2/health/live", self.live, methods=["GET"]),
            Route("/v2/health/ready", self.ready, methods=["GET"]),
            Route("/healthz", self.live, methods=["GET"]),
            Route("/readyz", self.ready, methods=["GET"]),
            Route("/v2", self.server_metadata, methods=["GET"]),
            Route(m, self.model_metadata, methods=["GET"]),
            Route(mv, self.model_metadata, methods=["GET"]),
            Route(m + "/ready", self.model_ready, methods=["GET"]),
            Route(mv + "/ready", self.model_ready, methods=["GET"]),
            Route(m + "/config", self.model_config, methods=["GET"]),
            Route(mv + "/config", self.model_config, methods=["GET"]),
        ]

    async def live(self, request: Request) -> Response:
        return Response(status_code=200)

    async def ready(self, request: Request) -> Response:
        why = await self.facade.not_ready()
        if why:
            return error_response(503, why)
        return Response(status_code=200)

    async def server_metadata(self, request: Request) -> Response:
        return json_response(self.facade.server_metadata())

    async def model_metadata(self, request: Request) -> Response:
        return json_response(await self.facade.model_metadata(*self._model(request)))

    async def model_config(self, request: Request) -> Response:
        return json_response(await self.facade.model_config(*self._model(request)))

    async def model_ready(self, request: Request) -> Response:
        why = await self.facade.model_not_ready(*self._model(request))
        if why:
            return error_response(503, why)
        return Response(status_code=200)

    @staticmethod
    def _model(request: Request) -> tuple[str, int | None, str | None]:
        name: Any = request.path_params["name"]
        return name, path_version(request), key_of(request)
