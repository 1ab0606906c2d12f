"""With a tenants file, every ``/v2`` route but health needs a key, checked before
anything of the request is read or validated; what a key may see is the broker's to
say (broker/server/scope.py), so the gateway passes each caller's key on.

The gateway learns whether the broker has tenants from its ``access`` verb (asked at
most once a second). The admin token (``Authorization: Bearer <token>``) passes as
the operator's, who sees everything. A caller's key goes to the broker with every
call made for it (``api_key``, "" when it gave none), so the broker refuses a caller
without one even while the gateway's own client holds the admin token. Routes the
broker never sees (``GET /v2``, log settings, shared-memory status) check the key with
the broker's ``whoami``.

``/metrics`` is not a tenant's: with tenants it answers the admin token, or an address
in ``--metrics-allow`` (CIDRs, default loopback: a Prometheus on the host, or the
pod's own sidecar; add the scraper's network for one elsewhere). Its series name every
model and tenant, which a tenant must not learn.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import re
import time
from typing import Any, Awaitable, Callable, Mapping, Sequence

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from zeroserve.broker.client import InferError
from zeroserve.broker.options import METRICS_ALLOW
from zeroserve.broker.protocol import ErrorCode
from zeroserve.gateway.apikey import api_key_of

ACCESS_TTL_S = 1.0
DEFAULT_METRICS_ALLOW = METRICS_ALLOW
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
NEEDS_KEY = "an API key is required (Authorization: Bearer <key>, or X-API-Key)"
# the inference routes, which ask the gate themselves on the inference path
# (gateway/inference.py), after its door
INFERENCE = re.compile(r"^/v2/models/[^/]+(?:/versions/[^/]+)?/(?:infer|generate|generate_stream)$")


def _retrieved(asked: "asyncio.Future[bool]") -> None:
    """An error nobody waited for (every asker left) is not logged as unretrieved."""
    if not asked.cancelled():
        asked.exception()


def networks(spec: str) -> list[Network]:
    """``--metrics-allow``: comma-separated addresses or CIDRs; ValueError naming a bad
    one."""
    out = []
    for part in (p.strip() for p in spec.split(",")):
        if part:
            try:
                out.append(ipaddress.ip_network(part, strict=False))
            except ValueError:
                raise ValueError(f"--metrics-allow: {part!r} is not an address or a CIDR "
                                 "such as 10.0.0.0/8") from None
    return out


class TenantGate:
    def __init__(self, control: Callable[..., Awaitable[Any]], admin_token: str,
                 metrics_allow: Sequence[Network],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._control = control
        self._clock = clock
        self._token = admin_token
        self._metrics_allow = list(metrics_allow)
        self._tenants = False
        self._known = False
        self._asked_s = -ACCESS_TTL_S
        self._asking: asyncio.Future[bool] | None = None

    async def enabled(self) -> bool:
        """Whether the broker has a tenants file (its answer of the last second). A
        broker that cannot say keeps its last answer; one never heard from is the
        caller's error (unavailable): with tenants unknown, nothing is let through."""
        now = self._clock()
        if now - self._asked_s < ACCESS_TTL_S:
            return self._tenants
        # one question at a time: at C=64 every request that found the answer old asked
        # the broker its own (4% of the gateway's CPU in py-spy); a caller that leaves
        # (its client hung up) must not cancel the others' question
        if self._asking is None:
            self._asking = asyncio.ensure_future(self._ask(now))
            self._asking.add_done_callback(_retrieved)
        return await asyncio.shield(self._asking)

    async def _ask(self, now: float) -> bool:
        try:
            got = await self._control("access")
        except InferError as exc:
            if exc.code is ErrorCode.BAD_INPUT and "unknown control verb" in exc.message:
                got = {"tenants": False}   # a broker older than scoping scopes nothing
            elif self._known:
                return self._tenants
            else:
                raise
        finally:
            self._asking = None
        self._tenants, self._asked_s, self._known = bool(got.get("tenants")), now, True
        return self._tenants

    def is_admin(self, headers: Mapping[str, str]) -> bool:
        given = headers.get("authorization", "")
        return bool(self._token) and given.startswith("Bearer ") and \
            hmac.compare_digest(given[7:].strip().encode(), self._token.encode())

    async def caller(self, headers: Mapping[str, str]) -> str | None:
        """The key the broker judges the caller by ("" for none; None for the operator);
        unauthorized at once where tenants need a key and none was given."""
        if self.is_admin(headers):
            return None
        key = api_key_of(headers)
        if not key and await self.enabled():
            raise InferError(ErrorCode.UNAUTHORIZED, NEEDS_KEY)
        return key

    def open_now(self) -> bool:
        """Whether the broker said within the last second that it has no tenants file:
        then :meth:`caller` lets a caller without a key through without asking, and an
        entry point may skip its coroutine (as one with a key may: it is let through)."""
        return not self._tenants and self._clock() - self._asked_s < ACCESS_TTL_S

    async def admit(self, headers: Mapping[str, str]) -> str | None:
        """:meth:`caller`, and with tenants the key checked by the broker too."""
        key = await self.caller(headers)
        if key and await self.enabled():
            await self._control("whoami", api_key=key)
        return key

    async def may_scrape(self, headers: Mapping[str, str], host: str) -> None:
        if not await self.enabled() or self.is_admin(headers):
            return
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            address = None
        if address is None or not any(address in n for n in self._metrics_allow):
            raise InferError(ErrorCode.FORBIDDEN, "with tenants, /metrics answers the admin "
                             "token or an address in --metrics-allow")


def key_of(request: Request) -> str | None:
    """The key a route passes to the broker for its caller: what the middleware found
    on a /v2 route (None: the operator), else the caller's own."""
    state = request.scope.get("state", {})
    return state["api_key"] if "api_key" in state else api_key_of(request.headers)


class GateMiddleware:
    """Every ``/v2`` route but health and inference (which asks the gate itself on the
    inference path, after the door; the fast path reaches infer without this
    middleware): 401 before the route runs."""

    def __init__(self, app: ASGIApp, gate: TenantGate,
                 refuse: Callable[[Scope, Receive, Send, InferError], Awaitable[None]]) -> None:
        self.app = app
        self.gate = gate
        self.refuse = refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path.startswith("/v2") and not path.startswith("/v2/health/") and \
                INFERENCE.match(path) is None:
            try:
                scope.setdefault("state", {})["api_key"] = \
                    await self.gate.admit(Headers(scope=scope))
            except InferError as exc:
                await self.refuse(scope, receive, send, exc)
                return
        await self.app(scope, receive, send)
