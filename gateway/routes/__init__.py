"""Every HTTP route of the gateway, in one table (:func:`routes`). Routes raise the
errors of gateway/errors.py; the app's exception handlers answer them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.routing import BaseRoute, Route

from zeroserve.gateway import metrics, openapi
from zeroserve.gateway.routes import predict
from zeroserve.gateway.routes.extensions import Extensions
from zeroserve.gateway.routes.generate import GenerateRoutes
from zeroserve.gateway.routes.infer import InferEndpoint
from zeroserve.gateway.routes.models import ModelRoutes
from zeroserve.gateway.routes.registration import Registration
from zeroserve.gateway.routes.repository import RepositoryRoutes

if TYPE_CHECKING:
    from zeroserve.gateway.app import Gateway


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
        Route("/metrics", metrics.Scrape(gw.control).endpoint, methods=["GET"]),
        *Registration(gw).routes(),
        *Extensions(gw).routes(),
        *repository.routes(),
    ]
    table.append(openapi.route(table))
    return table
