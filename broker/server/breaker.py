"""Circuit breaking per model: past an error rate of failures the model itself caused (it
raised; not the caller's input, not a deadline, not a lost worker), a model's requests are
answered at once with 503 and Retry-After instead of queueing for a batch that will fail;
after ``open_s`` a few probe requests go through (half-open); they close it, or one
failing opens it again for twice as long (up to ``max_open_s``). A new build of the model
committed closes it: the fix is what an operator does. While it is open, a request the
model still holds another ready version for (one that did not trip it) is routed there
instead of refused (:meth:`Breakers.route`).

Pure: the counts and the clock come in (:meth:`Breakers.answered`, :meth:`failed`,
:meth:`admit`), the state goes out; the request path's results (results.py) feed it and
its intake (intake.py) answers its refusals. A swap's first minutes are watched by a
rollout instead (releases.py): the results feed the breaker only for models with no
rollout running.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable

CLOSED, HALF_OPEN, OPEN = "closed", "half_open", "open"
# a batch fails whole, so one input the model chokes on fails every request batched with
# it: that is one event, not the model failing; two batches failed in the window are
MIN_FAILED_BATCHES = 2


@dataclass(frozen=True)
class BreakerOptions:
    error_rate: float = 0.5        # of the requests answered in the window (0: no breaker)
    min_failures: int = 5          # failed requests in the window before it may open
    window_s: float = 2.0
    open_s: float = 5.0            # the first wait before probing
    max_open_s: float = 60.0
    probes: int = 3                # successes in a row that close it
    watch_s: float = 120.0         # after a swap: the new build against the one before


@dataclass
class _Model:
    state: str = CLOSED
    # per batch answered in the window: when, its requests, how many of them failed
    events: deque[tuple[float, int, int]] = field(default_factory=deque)
    requests: int = 0              # in the window
    failures: int = 0
    failed_batches: int = 0
    until_s: float = 0.0           # open: when the probes may start
    open_s: float = 0.0            # the wait that opened it last
    probing: int = 0               # half-open: probes admitted, not yet answered
    probe_s: float = 0.0           # half-open: when the last probe was let through
    passed: int = 0                # half-open: probes answered well
    trips: int = 0
    reason: str = ""
    version: int | None = None     # the version whose failure opened it last


def refusal(model: str, wait_s: float) -> str:
    return (f"model {model!r} is failing: its circuit breaker is open (the model's own "
            f"errors passed its threshold); try again in {wait_s:.1f} s")


class Breakers:
    def __init__(self, options: BreakerOptions | None = None) -> None:
        self.opts = options or BreakerOptions()
        self._models: dict[str, _Model] = {}

    @property
    def enabled(self) -> bool:
        return self.opts.error_rate > 0

    def state(self, model: str, now: float) -> str:
        """The state as shown (``zeroserve models``, the metric, the replica controller):
        half-open once the open time has passed. The stored state moves to half-open at
        the next request (:meth:`admit`), which may be long in coming for a model whose
        callers back off: shown lazily, an idle model's breaker read "open" for good, and
        an operator waited for a probe that was already due."""
        m = self._models.get(model)
        if m is None:
            return CLOSED
        return HALF_OPEN if m.state == OPEN and now >= m.until_s else m.state

    def failing(self, model: str) -> bool:
        """Open or probing: what autoscaling holds a model's replicas still for."""
        m = self._models.get(model)
        return m is not None and m.state != CLOSED

    def admit(self, model: str, now: float) -> float | None:
        """None to let a request through; else the seconds after which to try again."""
        m = self._models.get(model)
        if m is None or m.state == CLOSED:
            return None
        if m.state == OPEN:
            if now < m.until_s:
                return m.until_s - now
            m.state, m.probing, m.passed = HALF_OPEN, 0, 0
        if now - m.probe_s > m.open_s:   # probes that never answered (refused on the way)
            m.probing = 0
        if m.probing + m.passed < self.opts.probes:
            m.probing += 1
            m.probe_s = now
            return None
        return max(1.0, m.open_s / 2)   # the probes run: their answers decide soon

    def answered(self, model: str, requests: int, now: float) -> None:
        m = self._models.get(model)
        if m is None:
            if not self.enabled:
                return
            m = self._models[model] = _Model()
        if m.state == HALF_OPEN:
            m.probing = max(0, m.probing - requests)
            m.passed += requests
            if m.passed >= self.opts.probes:
                self._close(m)
            return
        self._add(m, now, requests, 0)

    def route(self, model: str, asked: int | None, held: Iterable[int]) -> int | None:
        """Where a request the breaker holds back may go instead: the version it names
        if that is not the one that failed, else the newest of ``held`` (versions ready
        on some worker) that is not; None: nowhere, refuse it."""
        m = self._models.get(model)
        bad = m.version if m is not None else None
        if bad is None:
            return None
        if asked is not None:
            return asked if asked != bad else None
        return max((v for v in held if v != bad), default=None)

    def failed(self, model: str, requests: int, now: float, why: str,
               version: int | None = None) -> bool:
        """Requests the model failed by itself (on ``version``); whether this opened the
        breaker."""
        if not self.enabled:
            return False
        m = self._models.setdefault(model, _Model())
        if m.state == HALF_OPEN:
            if version is not None and version != m.version:
                return False   # a request routed to another version: not a probe
            self._open(m, now, min(self.opts.max_open_s, 2 * m.open_s),
                       f"a probe failed: {why}")
            return True
        if m.state == OPEN:
            return False
        self._add(m, now, requests, requests)
        if m.failures >= self.opts.min_failures and m.failed_batches >= MIN_FAILED_BATCHES \
                and m.failures >= self.opts.error_rate * m.requests:
            m.version = version
            self._open(m, now, self.opts.open_s,
                       f"{m.failures} of {m.requests} requests failed in "
                       f"{self.opts.window_s:g} s: {why}")
            return True
        return False

    def reset(self, model: str) -> None:
        """A new build committed, or the model removed: what the old one did is moot."""
        self._models.pop(model, None)

    def _add(self, m: _Model, now: float, requests: int, failures: int) -> None:
        m.events.append((now, requests, failures))
        m.requests += requests
        m.failures += failures
        m.failed_batches += failures > 0
        horizon = now - self.opts.window_s
        while m.events and m.events[0][0] < horizon:
            _, r, f = m.events.popleft()
            m.requests -= r
            m.failures -= f
            m.failed_batches -= f > 0

    def _open(self, m: _Model, now: float, wait_s: float, reason: str) -> None:
        m.state, m.until_s, m.open_s, m.reason = OPEN, now + wait_s, wait_s, reason
        m.trips += 1
        m.events.clear()
        m.requests = m.failures = m.failed_batches = m.probing = m.passed = 0

    def _close(self, m: _Model) -> None:
        m.state, m.probing, m.passed = CLOSED, 0, 0

    def describe(self, model: str, now: float) -> dict[str, Any]:
        m = self._models.get(model)
        if m is None or (m.state == CLOSED and not m.trips):
            return {}
        state = self.state(model, now)
        out: dict[str, Any] = {"state": state, "trips": m.trips, "reason": m.reason}
        if m.version is not None and state != CLOSED:
            out["version"] = m.version
        if state == OPEN:
            out["probe_in_s"] = round(m.until_s - now, 3)
        return {"breaker": out}
