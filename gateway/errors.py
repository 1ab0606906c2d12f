"""One table for every error a client can provoke: its HTTP status and its gRPC status
code, whichever front end answers it.

Errors come three ways: the broker's typed :class:`~zeroserve.broker.protocol.ErrorCode`
(as a client :class:`~zeroserve.broker.client.InferError`), the gateway's own checks
(:class:`BadRequest`, :class:`BodyTooLarge`) and the codecs' (``v2.DecodeError``,
``simple.SimpleError``, ``logsettings.SettingsError``, ``shm.ShmError``; each is a
ValueError, and one that carries a ``code`` attribute takes that code's row). Routes
raise them; HTTP answers through Starlette's ``exception_handlers``
(:func:`http_handlers`), gRPC through :func:`answer` in ``gateway/grpc/server.py``.

gRPC codes follow Triton's mapping of its own errors (invalid argument, not found,
unavailable, internal, ...; server src/grpc/grpc_utils.cc). A model name the server
does not know is INVALID_ARGUMENT over gRPC, as Triton's (core
model_repository_manager.cc FindModelIdentifier answers INVALID_ARG before any
lookup); a known model's missing version stays NOT_FOUND. HTTP keeps 404 for both.

Two are a choice, for gRPC clients' retry rules:
a full queue (``overloaded``) is UNAVAILABLE, transient and server-wide, which is what
Triton answers when its queue is full and what gRPC retry policies retry; a tenant
over its quota is RESOURCE_EXHAUSTED, gRPC's code for "a per-user quota", which a
client retries only after backing off. A body over the size limit is
RESOURCE_EXHAUSTED too, as gRPC itself answers a message over its limit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from zeroserve.broker import wording
from zeroserve.broker.client import InferError
from zeroserve.broker.logsettings import SettingsError
from zeroserve.broker.protocol import ErrorCode
from zeroserve.gateway.simple import SimpleError
from zeroserve.gateway.v2 import DecodeError


class BodyTooLarge(Exception):
    """A request body (or what it inflates to) over its limit (HTTP 413)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"request body exceeds {limit} bytes")
        self.limit = limit


class BadRequest(ValueError):
    """Anything a client sent wrong that is not caught by a codec (HTTP 400)."""


@dataclass(frozen=True)
class Status:
    http: int
    grpc: str   # a grpc.StatusCode's name: this module never imports grpcio


BY_CODE: dict[ErrorCode, Status] = {
    ErrorCode.BAD_INPUT: Status(400, "INVALID_ARGUMENT"),
    ErrorCode.NOT_FOUND: Status(404, "NOT_FOUND"),
    ErrorCode.DEADLINE: Status(504, "DEADLINE_EXCEEDED"),
    ErrorCode.OVERLOADED: Status(429, "UNAVAILABLE"),
    ErrorCode.QUOTA: Status(429, "RESOURCE_EXHAUSTED"),
    ErrorCode.NO_WORKER: Status(503, "UNAVAILABLE"),
    ErrorCode.UNAVAILABLE: Status(503, "UNAVAILABLE"),
    ErrorCode.WORKER_LOST: Status(503, "UNAVAILABLE"),
    ErrorCode.MODEL_ERROR: Status(500, "INTERNAL"),
    ErrorCode.CANCELLED: Status(499, "CANCELLED"),
    ErrorCode.INTERNAL: Status(500, "INTERNAL"),
    ErrorCode.FORBIDDEN: Status(403, "PERMISSION_DENIED"),
    ErrorCode.CONFLICT: Status(409, "ALREADY_EXISTS"),
    ErrorCode.UNAUTHORIZED: Status(401, "UNAUTHENTICATED"),
    # Triton's TRITONSERVER_ERROR_UNSUPPORTED (a unary call to a decoupled model)
    ErrorCode.UNSUPPORTED: Status(501, "UNIMPLEMENTED"),
    ErrorCode.TOO_LARGE: Status(413, "RESOURCE_EXHAUSTED"),
    # no retry helps (507: the server cannot hold it); gRPC's code for "fix it first"
    ErrorCode.TOO_BIG: Status(507, "FAILED_PRECONDITION"),
}
BAD_INPUT = BY_CODE[ErrorCode.BAD_INPUT]
TOO_LARGE = BY_CODE[ErrorCode.TOO_LARGE]
INTERNAL = BY_CODE[ErrorCode.INTERNAL]
UNKNOWN_MODEL = Status(404, "INVALID_ARGUMENT")
# HTTP statuses by code, for the routes that answer one without raising
STATUS = {code: status.http for code, status in BY_CODE.items()}


@dataclass(frozen=True)
class Answer:
    """What either front end tells the client about one error."""

    status: Status
    message: str
    retry_after_s: int | None = None   # whole seconds, rounded up
    bearer: bool = False               # a key or token is missing: say how to send one

    def http_headers(self) -> dict[str, str] | None:
        if self.retry_after_s is not None:
            return {"Retry-After": str(self.retry_after_s)}
        if self.bearer:
            return {"WWW-Authenticate": "Bearer"}
        return None


def infer_answer(err: InferError) -> Answer:
    status = BY_CODE.get(err.code, INTERNAL)
    if err.code is ErrorCode.NOT_FOUND and wording.is_unknown_model(err.message):
        status = UNKNOWN_MODEL
    if err.retry_after_s is not None:   # rounded up: retrying earlier is refused again
        return Answer(status, err.message, max(1, math.ceil(err.retry_after_s)))
    if err.code is ErrorCode.UNAUTHORIZED:
        return Answer(status, err.message, bearer=True)
    if err.code in (ErrorCode.OVERLOADED, ErrorCode.NO_WORKER, ErrorCode.UNAVAILABLE):
        return Answer(status, err.message, 1)
    return Answer(status, err.message)


# the codecs' errors: every one is a client's mistake (a 400 unless it has a code)
CLIENT_ERRORS: tuple[type[Exception], ...] = (BadRequest, DecodeError, SimpleError,
                                              SettingsError)


def answer(exc: BaseException) -> Answer | None:
    """The answer to an error a client provoked; None for anything else (a bug: the
    front end logs it and answers an internal error)."""
    if isinstance(exc, InferError):
        return infer_answer(exc)
    if isinstance(exc, BodyTooLarge):
        return Answer(TOO_LARGE, str(exc))
    if isinstance(exc, CLIENT_ERRORS):
        code = getattr(exc, "code", ErrorCode.BAD_INPUT)
        return Answer(BY_CODE.get(code, BAD_INPUT), str(exc))
    return None


def bad_input(exc: Exception) -> Answer:
    """A client error where any ValueError of a codec counts as one."""
    return answer(exc) or Answer(BAD_INPUT, str(exc))


Handler = Callable[[Request, Exception], Awaitable[Response]]


def http_handlers() -> dict[Any, Handler]:
    """Starlette ``exception_handlers``: each error a route raises, answered as JSON."""
    from zeroserve.gateway.http import error_response

    async def handle(request: Request, exc: Exception) -> Response:
        got = answer(exc)
        assert got is not None   # only registered for the types answer() knows
        return error_response(got.status.http, got.message, got.http_headers())

    return {t: handle for t in (InferError, BodyTooLarge, *CLIENT_ERRORS)}
