"""Tenancy at admission, the broker's side of tenants: who a request is, whether it may
queue, what it is counted as (the tenants file and its types are :mod:`tenants`). The
request path asks :meth:`Tenancy.identify` at the door and
:meth:`Tenancy.admit` once the request is known to be well formed, and tells
:meth:`Tenancy.release` when its one answer goes out. Without a tenants file every
request is the anonymous tenant and nothing is refused here.

Metrics carry a ``tenant`` label bounded to the configured names plus ``anonymous``
(no tenants file) and ``unknown`` (a key that matched no tenant).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Hashable, NamedTuple, Sequence

import msgspec
from prometheus_client import CollectorRegistry, Counter

from zeroserve.broker import protocol as p
from zeroserve.broker.server.control import ControlError
from zeroserve.broker.server.metrics import Children, LoopCounter, LoopHistogram
from zeroserve.broker.server.tenants import ANONYMOUS, DEFAULT_QOS, UNKNOWN, Tenant, \
    TenantsError, TenantSet, TokenBucket, load

logger = logging.getLogger(__name__)

_ANON = Tenant(ANONYMOUS, DEFAULT_QOS["guaranteed"])
RATE_TAU_S = 10.0   # the observed rate shown by `zeroserve tenants` is averaged over ~this
_PER = {"tokens": "tokens per minute (prompt and completion tokens)",
        "compute": "compute time per minute"}
_BUCKETS = (.0005, .001, .002, .005, .01, .02, .05, .1, .2, .5, 1, 2, 5, 10, 30)


@dataclass(frozen=True)
class Refusal:
    code: p.ErrorCode
    message: str
    tenant: str
    retry_after_s: float | None = None


class Grant(NamedTuple):
    """What an admitted request runs as (a tuple: one is made for every request, and a
    frozen dataclass costs a setattr call a field)."""

    request: p.InferRequest        # priority and timeout clamped
    tenant: str
    weight: float
    shed_rank: int
    notes: dict[str, float]        # for the reply's stats (what was clamped)
    by_time: bool = False          # its fair share counts compute time (share = "compute")


class _State:
    """What the broker counts per tenant; survives reloads by name."""

    __slots__ = ("bucket", "samples", "tokens", "inflight", "admitted", "rejected", "rate",
                 "stamp", "compute", "compute_s")

    def __init__(self) -> None:
        self.bucket: TokenBucket | None = None
        self.samples: TokenBucket | None = None
        self.tokens: TokenBucket | None = None
        self.inflight = 0
        self.admitted = 0
        self.rejected: dict[str, int] = {}
        self.rate = 0.0   # exponentially decayed requests/s
        self.stamp = 0.0
        self.compute: TokenBucket | None = None   # worker seconds, spent once measured
        self.compute_s = 0.0                       # worker seconds its rows used

    def observed_rate(self, now: float) -> float:
        return self.rate * math.exp(-max(0.0, now - self.stamp) / RATE_TAU_S)

    def count(self, now: float) -> None:
        self.admitted += 1
        self.rate = self.observed_rate(now) + 1.0 / RATE_TAU_S
        self.stamp = now


def _bucket(old: TokenBucket | None, rate: float, burst: float, now: float) -> TokenBucket | None:
    if rate <= 0:
        return None
    return old.resized(rate, burst, now) if old is not None else TokenBucket(rate, burst, now)


class Tenancy:
    def __init__(self, path: Path | None, registry: CollectorRegistry,
                 clock: Callable[[], float]) -> None:
        self.path = path
        self.clock = clock
        self.set = TenantSet()
        self._state: dict[str, _State] = {}
        self._open: dict[Hashable, str] = {}        # admitted request key -> tenant
        ns = "zeroserve"
        self.m_requests = LoopCounter("tenant_requests", "Requests admitted, by tenant",
                                      ["tenant"], registry)
        self.m_rejected = Counter("tenant_rejections", "Requests refused or dropped, by "
                                  "tenant and reason", ["tenant", "reason"], namespace=ns,
                                  registry=registry)
        self.m_queue = LoopHistogram("tenant_queue_seconds", "Time queued before dispatch, "
                                     "by tenant", ["tenant"], registry, _BUCKETS)
        self.m_compute = Counter("tenant_compute_seconds", "Worker seconds used, by "
                                 "tenant (each batch's time split over its rows by units)",
                                 ["tenant"], namespace=ns, registry=registry)
        self._child = Children()
        if path is not None:
            self._install(load(path))   # a bad file at startup: TenantsError to the caller

    @property
    def enabled(self) -> bool:
        return self.path is not None

    # -- configuration ---------------------------------------------------------
    def reload(self) -> dict[str, Any]:
        """Read the file again; on any error the old tenants stay (TenantsError raised).
        Requests in flight keep their tenant's name, and so their counts."""
        if self.path is None:
            raise TenantsError("the broker runs without a tenants file (--tenants FILE)")
        self._install(load(self.path))
        logger.info("tenants reloaded from %s: %d tenant(s)", self.path, len(self.set.tenants))
        return {"file": str(self.path), "tenants": sorted(self.set.tenants)}

    def reload_quietly(self) -> None:
        """SIGHUP: a broken file is logged, not fatal."""
        if self.path is None:
            return
        try:
            self.reload()
        except TenantsError as exc:
            logger.error("tenants not reloaded, the old ones stay in force: %s", exc)

    def _install(self, tset: TenantSet) -> None:
        now = self.clock()
        for name, t in tset.tenants.items():
            st = self._state.setdefault(name, _State())
            st.bucket = _bucket(st.bucket, t.rate, t.burst, now)
            st.samples = _bucket(st.samples, t.samples_rate, t.samples_burst, now)
            st.tokens = _bucket(st.tokens, t.tokens_per_minute / 60.0, t.tokens_burst, now)
            st.compute = _bucket(st.compute, t.compute_per_minute / 60.0, t.compute_burst, now)
        # tenants that left keep their state only while requests of theirs are open
        for name in list(self._state):
            if name not in tset.tenants and not self._state[name].inflight:
                del self._state[name]
        self.set = tset

    # -- the door ------------------------------------------------------------
    def identify(self, req: p.InferRequest) -> Tenant | Refusal:
        """Who calls, and whether it may call the model, before anything of the request
        is checked against the model (a tenant learns nothing of another's models)."""
        who = self.caller(req.api_key)
        if isinstance(who, Refusal):
            self.rejected(who.tenant, who.code)
        elif not who.allows(req.model):
            return self._refuse(who.name, p.ErrorCode.FORBIDDEN,
                                f"tenant {who.name!r} may not call model {req.model!r}")
        return who

    def caller(self, api_key: str) -> Tenant | Refusal:
        """The tenant of a key (requests and the frontend's control calls alike);
        nothing is counted here."""
        if not self.enabled:
            return _ANON
        if not api_key:
            return Refusal(p.ErrorCode.UNAUTHORIZED, "an API key is required (Authorization: "
                           "Bearer <key>, X-API-Key, or api_key=)", UNKNOWN)
        name = self.set.identify(api_key)
        if name is None:
            return Refusal(p.ErrorCode.UNAUTHORIZED, "unknown API key", UNKNOWN)
        return self.set.tenants[name]

    def admit(self, t: Tenant, key: Hashable, req: p.InferRequest, samples: int,
              now: float, tokens: int = 0) -> Grant | Refusal:
        """Model allowed, rate and concurrency within limits: then the request holds an
        in-flight place until :meth:`release`, and its tokens are spent. An input of a
        request of several (``req.row`` > 0, the texts of one embeddings call) is not a
        request of its own: it spends samples and tokens, not a request or a place."""
        if t is _ANON:  # nothing to count against: no tenants file
            return Grant(req, ANONYMOUS, 1.0, 0, {})
        if not t.allows(req.model):
            return self._refuse(t.name, p.ErrorCode.FORBIDDEN,
                                f"tenant {t.name!r} may not call model {req.model!r}")
        st = self._state[t.name]
        whole = req.row == 0
        if whole and t.max_inflight and st.inflight >= t.max_inflight:
            return self._refuse(t.name, p.ErrorCode.QUOTA, f"tenant {t.name!r} has "
                                f"{st.inflight} request(s) in flight, its maximum", 1.0)
        spend = [(what, b, n) for what, b, n in (
            ("requests", st.bucket, 1 if whole else 0), ("samples", st.samples, samples),
            ("tokens", st.tokens, tokens)) if b is not None and n]
        wait, what, n = max(((b.retry_after(n, now), what, n) for what, b, n in spend),
                            default=(0.0, "", 0))
        if st.compute is not None:   # spent after the fact: admitted while not in debt
            wait, what, n = max((wait, what, n), (st.compute.retry_after(0.0, now), "compute",
                                                  0))
        if wait > 0:
            if math.isinf(wait):
                return self._refuse(t.name, p.ErrorCode.QUOTA, f"a request of {n} {what} "
                                    f"is more than tenant {t.name!r}'s burst", None)
            per = _PER.get(what, f"{what} rate")
            return self._refuse(t.name, p.ErrorCode.QUOTA, f"tenant {t.name!r} is over its "
                                f"{per}", wait)
        for _, b, n in spend:
            b.take(n, now)
        priority, p_clamped = t.clamp_priority(req.priority)
        timeout_ms, t_clamped = t.clamp_timeout(req.timeout_ms)
        notes: dict[str, float] = {}
        if p_clamped:
            notes["priority_clamped"] = 1
            notes["priority"] = priority
        if t_clamped:
            notes["timeout_clamped"] = 1
            notes["timeout_ms"] = timeout_ms
        if whole:
            st.inflight += 1
            st.count(now)
            self._open[key] = t.name
            self.m_requests.inc((t.name,))
        return Grant(msgspec.structs.replace(req, priority=priority, timeout_ms=timeout_ms),
                     t.name, t.weight, t.qos.rank, notes, self.set.share == "compute")

    def completion_tokens(self, tenant: str, n: int, now: float) -> None:
        """Tokens a generating model made for one of the tenant's requests, charged to its
        ``tokens_per_minute`` as they come (the prompt's were at admission): past its
        quota a stream runs on, and the tenant's next requests wait for the refill."""
        st = self._state.get(tenant)
        if st is not None and st.tokens is not None:
            st.tokens.spend(n, now)

    def open_count(self) -> int:
        """Requests holding an in-flight place (the census: 0 once all are answered)."""
        return len(self._open)

    def release(self, key: Hashable) -> None:
        """The request's one answer went out (or it was refused after admission)."""
        name = self._open.pop(key, None)
        st = self._state.get(name) if name is not None else None
        if name is not None and st is not None:
            st.inflight -= 1
            if st.inflight == 0 and name not in self.set.tenants:
                del self._state[name]

    # -- compute time ------------------------------------------------------------
    def used(self, shares: Sequence[tuple[str, float]], now: float) -> None:
        """A batch's measured time, split over its rows: (tenant, seconds) each; spent
        from the tenant's compute quota and counted."""
        for name, seconds in shares:
            st = self._state.get(name)
            if st is None:
                continue
            st.compute_s += seconds
            self._child(self.m_compute, self._label(name)).inc(seconds)
            if st.compute is not None:
                st.compute.spend(seconds, now)

    # -- counting --------------------------------------------------------------
    def _refuse(self, tenant: str, code: p.ErrorCode, message: str,
                retry_after_s: float | None = None) -> Refusal:
        self.rejected(tenant, code)
        return Refusal(code, message, tenant, retry_after_s)

    def rejected(self, tenant: str, code: p.ErrorCode) -> None:
        tenant = self._label(tenant)
        self._child(self.m_rejected, tenant, code.value).inc()
        st = self._state.get(tenant)
        if st is not None:
            st.rejected[code.value] = st.rejected.get(code.value, 0) + 1

    def queued(self, waits: Sequence[tuple[str, float]]) -> None:
        """A batch's requests left the queue: (tenant, seconds queued) of each."""
        last, observe = None, None
        for tenant, queue_s in waits:
            if tenant != last or observe is None:
                last, observe = tenant, self.m_queue.labels(self._label(tenant)).observe
            observe(queue_s)

    def _label(self, tenant: str) -> str:
        if not self.enabled:
            return ANONYMOUS
        return tenant if tenant in self.set.tenants else UNKNOWN

    # -- the `tenants` verb ------------------------------------------------------
    def describe(self, _: dict[str, Any] | None = None) -> dict[str, Any]:
        now = self.clock()
        out: dict[str, Any] = {}
        for name, t in sorted(self.set.tenants.items()):
            st = self._state.get(name) or _State()
            out[name] = {
                "qos": t.qos.name, "weight": t.weight, "rate_limit": t.rate,
                "burst": t.burst, "tokens": st.bucket.available(now) if st.bucket else None,
                "samples_rate_limit": t.samples_rate,
                "tokens_per_minute_limit": t.tokens_per_minute,
                "compute_per_minute_limit": t.compute_per_minute,
                "compute_s": round(st.compute_s, 6),
                "compute_available_s": st.compute.available(now) if st.compute else None,
                "rate": round(st.observed_rate(now), 3), "inflight": st.inflight,
                "max_inflight": t.max_inflight, "admitted": st.admitted,
                "rejected": dict(st.rejected),
                "models": sorted(t.models) if t.models is not None else "*",
                "max_timeout_ms": t.max_timeout_ms, "keys": len(t.keys)}
        return {"enabled": self.enabled, "file": str(self.path) if self.path else None,
                "share": self.set.share, "tenants": out}

    def summary(self) -> dict[str, dict[str, Any]]:
        """For ``status``: per tenant its observed rate, in-flight and rejections."""
        full = self.describe()["tenants"]
        return {n: {k: t[k] for k in ("rate", "inflight", "rejected", "compute_s")}
                for n, t in full.items()}

    def reload_verb(self, _: dict[str, Any]) -> dict[str, Any]:
        try:
            return self.reload()
        except TenantsError as exc:
            raise ControlError("bad_input", str(exc)) from None
