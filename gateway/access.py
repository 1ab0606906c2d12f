"""Who may call the routes that change state (model registration, shared-memory
regions, log settings): loopback clients only, unless an admin token is configured
(``ZEROSERVE_ADMIN_TOKEN``), in which case ``Authorization: Bearer <token>`` from
anywhere and nothing without it."""

from __future__ import annotations

import hmac

from starlette.requests import Request
from starlette.responses import Response

from zeroserve.gateway.http import error_response

LOOPBACK = {"127.0.0.1", "::1", "localhost"}


def refused(request: Request, admin_token: str) -> Response | None:
    """None when the caller may change state; else the 401/403 answer."""
    if admin_token:
        given = request.headers.get("authorization", "")
        if not given.startswith("Bearer "):
            return error_response(401, "this route needs Authorization: Bearer <token>",
                                  {"WWW-Authenticate": "Bearer"})
        if not hmac.compare_digest(given[7:].encode(), admin_token.encode()):
            return error_response(403, "the admin token is wrong")
        return None
    host = request.client.host if request.client else ""
    if host not in LOOPBACK:
        return error_response(403, "management answers only on loopback unless an admin "
                              "token is configured")
    return None
