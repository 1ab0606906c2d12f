"""The gateway's door: it sheds at once (503, Retry-After) instead of queueing.

The queue belongs in the broker, where priority and deadline order it. The gateway's
own waiting line is its event loop: a request accepted by uvicorn waits there for the
CPU, in arrival order, blind to priority and deadline. So the gateway keeps that line
short and says no at the door when it grows:

- **Loop lag.** A tick every ``TICK_S`` measures how late the loop runs it (the
  lateness of the last tick, or of the next one when it is overdue already): how
  long any callback ready then waits, the queueing delay inside the gateway. A
  request's deadline counts from its arrival estimated that way (its start in the
  gateway less the current lag), so the wait in the gateway's line is spent from its
  budget, as it is. While the lag exceeds ``shed_lag_ms``, a request with a deadline
  below the highest priority (``parameters.priority`` 1) is answered 503 once its
  JSON header is parsed, before its tensors are decoded, as the broker sheds the
  lowest priority first; requests without a deadline and the highest priority go
  on. Past ``FAR`` times ``shed_lag_ms`` every request is answered 503 before its
  body is read (the cheapest answer there is).
- **In flight.** At most ``max_in_flight`` inference requests between the door and
  their answer. The broker bounds what it queues (each model's ``max_queue_size``,
  1,024 by default, shedding the lowest priority first) and the gateway's DEALER
  bounds what waits to reach it (1,000 messages): requests beyond both can only be
  waiting in this process. The default, 2,048, sits above both, so it sheds only
  what the broker could not have taken.

Shed requests count in ``zeroserve_gateway_shed_total{reason}`` (``loop_lag``,
``in_flight``, and ``deadline`` for a request whose budget ran out in the gateway
before it reached the broker).
"""

from __future__ import annotations

import asyncio
import time

from prometheus_client import Counter, Gauge

from zeroserve.broker.client import InferError
from zeroserve.broker.protocol import ErrorCode
from zeroserve.gateway.metrics import REGISTRY

TICK_S = 0.005
HIGHEST = 1         # parameters.priority of the highest priority (0: the model's default)
FAR = 4             # this many times shed_lag_ms behind: every request is shed
RETRY_AFTER_S = 1   # HTTP says whole seconds; the loop catches up well within one

SHED = Counter("gateway_shed", "Inference requests the gateway answered itself with 503 "
               "(loop_lag, in_flight) or 504 (deadline) instead of forwarding them",
               ["reason"], namespace="zeroserve", registry=REGISTRY)
LAG = Gauge("gateway_loop_lag_seconds", "How late the gateway's event loop ran its last "
            "tick: the queueing delay inside the gateway", namespace="zeroserve",
            registry=REGISTRY, multiprocess_mode="max")
IN_FLIGHT = Gauge("gateway_in_flight", "Inference requests between the gateway's door "
                  "and their answer (sampled with the lag)", namespace="zeroserve",
                  registry=REGISTRY, multiprocess_mode="sum")
SHED_LAG = SHED.labels("loop_lag")
SHED_IN_FLIGHT = SHED.labels("in_flight")
SHED_DEADLINE = SHED.labels("deadline")


class Shed(InferError):
    """A request the door turned away: 503 with Retry-After over HTTP, UNAVAILABLE over
    gRPC, as the broker answers a full queue."""

    def __init__(self, why: str) -> None:
        super().__init__(ErrorCode.UNAVAILABLE, why, RETRY_AFTER_S)


class Door:
    """Loop-lag and in-flight admission for one event loop (started in the lifespan).
    The in-flight count is written by :meth:`admit` and :meth:`leave` alone."""

    def __init__(self, shed_lag_ms: float = 50.0, max_in_flight: int = 2048) -> None:
        self.shed_lag_s = shed_lag_ms / 1000.0     # 0: never shed for lag
        self.max_in_flight = max_in_flight          # 0: no bound
        self._in_flight = 0
        self.lag_s = 0.0
        self._due = 0.0
        self._handle: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._schedule()

    def _schedule(self) -> None:
        # due in the loop's own clock (uvloop's is the same monotonic clock, cached
        # per iteration in whole ms), so a timer can never look early
        assert self._loop is not None
        self._due = self._loop.time() + TICK_S
        self._handle = self._loop.call_at(self._due, self._tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _tick(self) -> None:
        now = time.monotonic()
        self.lag_s = max(0.0, now - self._due)
        LAG.set(self.lag_s)
        IN_FLIGHT.set(self._in_flight)
        self._schedule()

    def current_lag_s(self) -> float:
        """The last tick's lateness, or the next tick's, when it is overdue already."""
        if self._handle is None:
            return 0.0
        return max(self.lag_s, time.monotonic() - self._due)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def admit(self) -> float:
        """A request arriving now, let in and counted in flight until its :meth:`leave`:
        its arrival (now less the loop's lag), which its deadline counts from. Shed
        (counted) when the bound is reached or the loop is far behind."""
        now = time.monotonic()
        lag = max(self.lag_s, now - self._due) if self._handle is not None else 0.0
        # decided here with one clock read (current_lag_s and refuse read it again);
        # refuse words and counts a refusal: its later clock finds at least this lag
        if self.max_in_flight and self._in_flight >= self.max_in_flight or \
                self.shed_lag_s and lag > FAR * self.shed_lag_s:
            why = self.refuse()
            if why is not None:
                raise Shed(why)
        self._in_flight += 1
        return now - lag

    def leave(self) -> None:
        self._in_flight -= 1

    def refuse(self) -> str | None:
        """Why a request arriving now is shed (and counted), or None to let it in."""
        if self.max_in_flight and self._in_flight >= self.max_in_flight:
            SHED_IN_FLIGHT.inc()
            return f"the gateway has {self._in_flight} requests in flight (its bound); retry"
        return self._lagging(FAR * self.shed_lag_s)

    def refuse_priority(self, priority: int, deadline: bool) -> str | None:
        """Asked once the header is parsed: a request with a deadline, below the
        highest priority, meets the lag bound itself."""
        if priority == HIGHEST or not deadline:
            return None
        return self._lagging(self.shed_lag_s)

    def _lagging(self, bound_s: float) -> str | None:
        lag = self.current_lag_s() if self.shed_lag_s else 0.0
        if lag > bound_s:
            SHED_LAG.inc()
            return (f"the gateway is {lag * 1000:.0f} ms behind (more than "
                    f"{bound_s * 1000:g} ms); retry")
        return None
