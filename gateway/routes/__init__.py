"""Every HTTP route of the gateway, in one table (:func:`routes`). Routes raise the
errors of gateway/errors.py; the app's exception handlers answer them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from zeroserve.gateway import metrics, openapi
from zeroserve.gateway.routes import predict
from zeroserve.gateway.routes.extensions import Extensions
from zeroserve.gateway.routes.generate import GenerateRoutes
from zeroserve.gateway.routes.infer import InferEndpoint
from zeroserve.gateway.routes.models import ModelRoutes
from zeroserve.gateway.routes.registration import Registration
from zeroserve.gateway.routes.repository import RepositoryRoutes
from zeroserve.gateway.routes.trace import TraceRoutes

if TYPE_CHECKING:
    from zeroserve.gateway.app import Gateway


def scrape(gw: "Gateway") -> Callable[[Request], Awaitable[Response]]:
    """``GET /metrics``, which with tenants only the operator and --metrics-allow see."""
    merged = metrics.Scrape(gw.control)

    async def endpoint(request: Request) -> Response:
        await gw.gate.may_scrape(request.headers, request.client.host if request.client
                                 else "")
        return await merged.endpoint(request)
    return endpoint


def routes(gw: "Gateway", infer: InferEndpoint) -> list[BaseRoute]:
    m = "/v2/models/{name}"
    mv = "/v2/models/{name}/versions/{version}"
    repository = RepositoryRoutes(gw)
    table: list[BaseRoute] = [
        *repository.stats_routes(),   # before m: "/v2/models/stats" is no model's metadata
        *ModelRoutes(gw).routes(),
        Route(m + "/infer", infer, methods=["POST"]),
        Route(mv + "/infer", infer, methods=["POST"]),
        *GenerateRoutes(gw).routes(),
        *predict.routes(gw),
        Route("/metrics", scrape(gw), methods=["GET"]),
        *Registration(gw).routes(),
        *Extensions(gw).routes(),
        *TraceRoutes(gw).routes(),
        *repository.routes(),
    ]
    table.append(openapi.route(table))
    return table
