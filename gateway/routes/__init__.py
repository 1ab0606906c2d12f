"""Every HTTP route of the gateway, in one table (:func:`routes`). Routes raise the
errors of gateway/errors.py; the app's exception handlers answer them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from zeroserve.gateway import metrics, openapi
from zeroserve.gateway.facade import Facade
from zeroserve.gateway.inference import InferencePath
from zeroserve.gateway.routes import predict
from zeroserve.gateway.routes.extensions import Extensions
from zeroserve.gateway.routes.generate import GenerateRoutes
from zeroserve.gateway.routes.infer import InferEndpoint
from zeroserve.gateway.routes.models import ModelRoutes
from zeroserve.gateway.routes.openai import OpenAIRoutes
from zeroserve.gateway.routes.registration import Registration
from zeroserve.gateway.routes.repository import RepositoryRoutes
from zeroserve.gateway.routes.trace import TraceRoutes
from zeroserve.gateway.shm import SharedMemory
from zeroserve.gateway.tenantgate import TenantGate
from zeroserve.gateway.tokens import Tokenizers


@dataclass(frozen=True)
class Parts:
    """What the table hands out: each route object takes the few of these it uses."""

    facade: Facade
    inference: InferencePath
    infer: InferEndpoint
    shm: SharedMemory
    gate: TenantGate
    max_body_bytes: int
    admin_token: str
    tokenizers: Tokenizers


def scrape(control: Callable[..., Awaitable[Any]],
           gate: TenantGate) -> Callable[[Request], Awaitable[Response]]:
    """``GET /metrics``, which with tenants only the operator and --metrics-allow see."""
    merged = metrics.Scrape(control)

    async def endpoint(request: Request) -> Response:
        await gate.may_scrape(request.headers, request.client.host if request.client
                              else "")
        return await merged.endpoint(request)
    return endpoint


def routes(parts: Parts) -> list[BaseRoute]:
    m = "/v2/models/{name}"
    mv = "/v2/models/{name}/versions/{version}"
    facade, token, limit = parts.facade, parts.admin_token, parts.max_body_bytes
    repository = RepositoryRoutes(facade, token, limit)
    table: list[BaseRoute] = [
        *repository.stats_routes(),   # before m: "/v2/models/stats" is no model's metadata
        *ModelRoutes(facade).routes(),
        Route(m + "/infer", parts.infer, methods=["POST"]),
        Route(mv + "/infer", parts.infer, methods=["POST"]),
        *GenerateRoutes(parts.inference, facade.control, limit).routes(),
        *predict.routes(parts.inference, facade, limit),
        Route("/metrics", scrape(facade.control, parts.gate), methods=["GET"]),
        *Registration(facade.control, facade.admin, token).routes(),
        *OpenAIRoutes(parts.inference, parts.tokenizers, limit).routes(),
        *Extensions(parts.shm, facade, token).routes(),
        *TraceRoutes(facade, token).routes(),
        *repository.routes(),
    ]
    table.append(openapi.route(table))
    return table
