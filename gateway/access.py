"""Who may call the routes that change state (model registration and repository
load/unload, shared-memory regions, log settings), over HTTP and gRPC alike: loopback
clients only, unless an admin token is configured (``ZEROSERVE_ADMIN_TOKEN``), in which
case ``Authorization: Bearer <token>`` (gRPC: ``authorization`` metadata) from anywhere
and nothing without it."""

from __future__ import annotations

import hmac

from starlette.requests import Request

from zeroserve.broker.client import InferError
from zeroserve.broker.protocol import ErrorCode

LOOPBACK = {"127.0.0.1", "::1", "localhost"}


def check_admin(host: str, authorization: str, admin_token: str) -> None:
    """Nothing when the caller may change state; else InferError, unauthorized (no
    token sent) or forbidden."""
    if admin_token:
        if not authorization.startswith("Bearer "):
            raise InferError(ErrorCode.UNAUTHORIZED,
                             "this route needs Authorization: Bearer <token>")
        if not hmac.compare_digest(authorization[7:].encode(), admin_token.encode()):
            raise InferError(ErrorCode.FORBIDDEN, "the admin token is wrong")
        return
    if host not in LOOPBACK:
        raise InferError(ErrorCode.FORBIDDEN, "management answers only on loopback unless "
                         "an admin token is configured")


def require_admin(request: Request, admin_token: str) -> None:
    check_admin(request.client.host if request.client else "",
                request.headers.get("authorization", ""), admin_token)
