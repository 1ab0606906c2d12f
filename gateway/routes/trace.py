"""Triton's trace extension: ``GET|POST /v2/trace/setting`` and
``/v2/models/{name}/trace/setting`` (the broker holds the settings; this process's copy
is gateway/tracing.py's, shared with gRPC's TraceSetting; gateway/facade.py keeps it
the broker's). A POST changes state: the admin rule of gateway/access.py."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from zeroserve.broker.client import ErrorCode, InferError
from zeroserve.gateway.access import require_admin
from zeroserve.gateway.errors import BadRequest
from zeroserve.gateway.facade import Facade
from zeroserve.gateway.http import json_response
from zeroserve.gateway.routes.extensions import json_body
from zeroserve.gateway.tenantgate import key_of
from zeroserve.gateway.tracing import TraceSettingError


class TraceRoutes:
    def __init__(self, facade: Facade, admin_token: str) -> None:
        self.facade = facade
        self.admin_token = admin_token

    def routes(self) -> list[Route]:
        return [Route(path, endpoint, methods=[method])
                for path in ("/v2/trace/setting", "/v2/models/{name}/trace/setting")
                for method, endpoint in (("GET", self.get), ("POST", self.post))]

    async def _model(self, request: Request) -> str | None:
        name = request.path_params.get("name")
        if name is None:
            return None
        try:
            why = await self.facade.model_not_ready(name, None, key_of(request))
        except InferError as exc:
            if exc.code is not ErrorCode.NOT_FOUND:
                raise
            why = "unknown"
        if why is not None:   # Triton's answer, for a model it does not serve
            raise BadRequest(f"Request for unknown model : {name}")
        return name  # type: ignore[no-any-return]

    async def get(self, request: Request) -> Response:
        model = await self._model(request)
        return json_response((await self.facade.trace_settings()).get(model))

    async def post(self, request: Request) -> Response:
        require_admin(request, self.admin_token)
        model = await self._model(request)
        doc = await json_body(request, empty_ok=True)
        try:
            settings = await self.facade.update_trace_settings(model, doc)
        except TraceSettingError as exc:
            raise BadRequest(str(exc)) from None
        return json_response(settings.get(model))
