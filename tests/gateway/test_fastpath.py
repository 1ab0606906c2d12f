"""gateway/fastpath.py applies uvicorn's proxy headers itself (``serve`` turns uvicorn's
off): every route sees the client and scheme uvicorn's middleware would have given it,
and an infer request without those headers sees the connection's own."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from zeroserve.gateway.fastpath import InferFastPath
from zeroserve.gateway.routes.infer import STATUS_KEY

TRUSTED = "127.0.0.1,::1"
PROXY = ("127.0.0.1", 5000)
CALLER = ("203.0.113.7", 0)


class Seen:
    """What the endpoint (or the app, for other routes) found in its scope."""

    def __init__(self) -> None:
        self.scopes: list[dict[str, Any]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.scopes.append({k: scope.get(k) for k in ("client", "scheme", "path_params")})
        scope[STATUS_KEY] = 200


class _State:
    infer: Any


class _App:   # what InferFastPath reads of the Starlette app: state.infer; also the app
    def __init__(self, endpoint: Seen, other: Seen) -> None:
        self.state = _State()
        self.state.infer = endpoint
        self.other = other

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.other(scope, receive, send)


def call(path: str, client: tuple[str, int], headers: list[tuple[bytes, bytes]],
         trusted: str | None = TRUSTED, method: str = "POST") -> tuple[Seen, Seen]:
    endpoint, other = Seen(), Seen()
    fast = InferFastPath(_App(endpoint, other), trusted)  # type: ignore[arg-type]
    scope = {"type": "http", "method": method, "path": path, "client": client,
             "scheme": "http", "headers": [(b"host", b"x"), *headers]}

    async def nothing() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    async def send(message: Any) -> None:
        pass

    asyncio.run(fast(scope, nothing, send))
    return endpoint, other


FORWARDED = [(b"x-forwarded-for", b"203.0.113.7"), (b"x-forwarded-proto", b"https")]


@pytest.mark.parametrize("path, name", [("/v2/models/m/infer", "endpoint"),
                                        ("/v2/models/m/versions/2/infer", "endpoint"),
                                        ("/v2/models/m", "other")])
def test_a_trusted_proxy_names_the_caller_on_every_route(path: str, name: str) -> None:
    endpoint, other = call(path, PROXY, FORWARDED)
    seen = (endpoint if name == "endpoint" else other).scopes
    assert len(seen) == 1 and not (other if name == "endpoint" else endpoint).scopes
    assert seen[0]["client"] == CALLER and seen[0]["scheme"] == "https"


def test_an_untrusted_peer_is_taken_at_its_address() -> None:
    peer = ("198.51.100.9", 4000)
    endpoint, _ = call("/v2/models/m/infer", peer, FORWARDED)
    assert endpoint.scopes[0]["client"] == peer and endpoint.scopes[0]["scheme"] == "http"


def test_an_infer_request_without_proxy_headers_keeps_its_connection() -> None:
    endpoint, _ = call("/v2/models/m/versions/3/infer", PROXY, [(b"x-api-key", b"k")])
    assert endpoint.scopes == [{"client": PROXY, "scheme": "http",
                                "path_params": {"name": "m", "version": "3"}}]


def test_without_trusted_hosts_no_header_is_applied() -> None:
    """An app served by a server that applies them itself (or by none: tests)."""
    endpoint, other = call("/v2/models/m/infer", PROXY, FORWARDED, trusted=None)
    assert endpoint.scopes[0]["client"] == PROXY
    _, other = call("/v2/models/m", PROXY, FORWARDED, trusted=None)
    assert other.scopes[0]["client"] == PROXY
