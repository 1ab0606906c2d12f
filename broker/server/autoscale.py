"""How many replicas (workers holding it) a model needs: pure logic, no sockets, no clock.

The broker feeds each autoscaled model's signals in (:meth:`Controller.observe` at a
fixed sampling period, :meth:`Controller.arrived` per request) and asks
:meth:`Controller.decide` at each step; time always comes in as ``now``, so tests and
the simulation drive it with a clock of their own. The signals, over sliding windows:

- queue time: the age of the oldest queued request, time-weighted over ``window_s``;
- queue depth per serving replica, over the same window;
- utilization: the fraction of replicas with a batch in flight, time-weighted, over
  ``window_s`` (for scaling up) and ``down_window_s`` (for scaling down);
- arrival rate over ``window_s``, and its trend (the later half against the earlier);
- whether the model's circuit breaker is open (or probing), in the latest sample.

With the broker's latency model for the model (``latency(b) = a + c*b``), a replica's
capacity at full batches is ``max_batch / latency(max_batch)``; the demand is the
arrival rate plus the backlog drained over a window, and the replicas it needs
``ceil(demand / (capacity * high_utilization))``. That sets how many replicas one step
adds (at least one) and which removals would overload the rest; without a latency
model yet, one at a time and the measured utilization stand in.

The decision tree, first match wins::

    1  serving + loading < min                      up    below_min  (5d's holds
                                                          when no worker can take it)
    2  serving > max                                down  above_max
    3  a replica is loading                         hold  loading
    4  less than window_s observed yet              hold  warming_up
    4b the model's circuit breaker open or probing  hold  breaker_open  (it fails by
       itself: more replicas would fail too, and its traffic is refused, not gone; a
       worker lost is no breaker's, and scales as before)
    5  queue time > SLO (or depth per replica over its threshold, when set):
       5a serving >= max                            hold  at_max
       5b utilization < low_utilization             hold  queue_not_busy  (the wait is
          not for capacity: max_queue_delay, a version held by few; more replicas idle)
       5c within up_cooldown_s of the last up       hold  cooldown
       5d enough replicas by the latency model, and   hold  draining
          the backlog smaller than a window ago
       5e no worker may take one more               hold  no_memory | no_worker
       5f                                           up    queue_time | queue_depth
                                                          (by the replicas needed)
    6  serving > min, down_window_s since the last change, queue time < SLO / 2, and the replicas
       are underused: utilization < low_utilization, or the needed replicas (with a
       latency model) fewer than serving:
       6a the rest would pass the thresholds' midpoint  hold  would_overload
       6b arrivals rising (later half > 1.5x)       hold  arrivals_rising
       6c within down_cooldown_s of any change      hold  cooldown
       6d                                           down  low_utilization (half the
                                                          excess, at least one)
    7                                               hold  steady

Hysteresis: up above the SLO, down only below half of it, and only while the replicas
left stay under the midpoint of the utilization thresholds (an up sizes for the high
one); a down needs a full ``down_window_s`` with the current replica count. Cool-downs
bound how often each direction may act.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

UP, DOWN, HOLD = "up", "down", "hold"

# why no worker can take one more replica: (reason, detail), e.g. ("no_memory", "worker
# h/1 (cuda:1) has 1.2 GB of its 8.0 GB budget free: 0.8 GB short"), or None: one can
Room = Callable[[], "tuple[str, str] | None"]


@dataclass(frozen=True)
class ScalePolicy:
    """A model's bounds and tuning (``instances`` and ``autoscaling`` in its config)."""

    min_replicas: int = 1
    max_replicas: int = 0            # 0: as many as there are workers to hold it
    queue_slo_s: float = 0.1
    window_s: float = 5.0
    down_window_s: float = 15.0
    up_cooldown_s: float = 5.0
    down_cooldown_s: float = 30.0
    low_utilization: float = 0.3
    high_utilization: float = 0.7
    depth_per_replica: float = 0.0   # 0: queue depth alone never scales up

    @classmethod
    def of(cls, instances: dict[str, Any], tuning: dict[str, Any]) -> "ScalePolicy | None":
        """The policy a config asks for, or None: every eligible worker holds the model
        (all of count, min and max 0) and nothing is autoscaled."""
        count, lo, hi = (int(instances.get(k, 0) or 0) for k in ("count", "min", "max"))
        if count:
            lo = hi = count
        if not (lo or hi):
            return None
        return cls(min_replicas=max(lo, 1), max_replicas=hi,
                   queue_slo_s=float(tuning.get("queue_slo_ms", 100.0)) / 1000.0,
                   **{k: float(tuning[k]) for k in (
                       "window_s", "down_window_s", "up_cooldown_s", "down_cooldown_s",
                       "low_utilization", "high_utilization", "depth_per_replica")
                      if k in tuning})

    @property
    def fixed(self) -> bool:
        return self.max_replicas == self.min_replicas


@dataclass(frozen=True)
class Sample:
    """What the broker sees of one model at one instant."""

    queue_s: float   # age of the oldest queued request, 0 with an empty queue
    depth: int       # requests queued
    busy: int        # serving replicas with a batch of this model in flight
    replicas: int    # serving replicas
    capacity_rps: float = 0.0   # one replica's requests/s at full batches; 0: unknown
    # the serving replicas' devices as their driver sees them (NVML): the mean share of
    # time a kernel ran, 0..1; None where none reports it (CPU workers, no nvidia-ml-py,
    # MIG slices). An input only: no decision below reads it yet.
    gpu_utilization: float | None = None
    breaker_open: bool = False  # the model's circuit breaker open or half-open


@dataclass(frozen=True)
class Signals:
    queue_s: float = 0.0
    depth_per_replica: float = 0.0
    utilization: float = 0.0        # over window_s
    utilization_down: float = 0.0   # over down_window_s
    arrival_rps: float = 0.0
    arrival_trend: float = 1.0      # later half of the window over the earlier half
    observed_s: float = 0.0         # since the policy was set
    since_change_s: float = 0.0     # since the last change (or the start)
    capacity_rps: float = 0.0       # per replica, the latest sample's
    depth: int = 0                  # queued now
    depth_before: int = 0           # queued a window ago
    recent_rps: float = 0.0         # arrivals over the later half of the window
    gpu_utilization: float | None = None   # over window_s, the samples that carry it
    breaker_open: bool = False      # the latest sample's

    def needed(self, pol: "ScalePolicy", utilization: float) -> int | None:
        """Replicas that would carry the demand (arrivals, and the backlog drained over
        a window) each at ``utilization`` of its capacity, or None without a latency
        model."""
        if self.capacity_rps <= 0:
            return None
        # a rising rate counts at its recent level: the window's mean lags a burst
        rate = max(self.arrival_rps, self.recent_rps)
        demand = rate + self.depth / max(pol.window_s, 1e-9)
        return max(1, math.ceil(demand / (self.capacity_rps * utilization)))

    def brief(self) -> str:
        return (f"queue {self.queue_s * 1000:.0f} ms, depth/replica "
                f"{self.depth_per_replica:.1f}, utilization {self.utilization:.2f}/"
                f"{self.utilization_down:.2f}, {self.arrival_rps:.0f} req/s"
                + ("" if self.gpu_utilization is None
                   else f", GPU busy {self.gpu_utilization:.0%}"))


@dataclass(frozen=True)
class Decision:
    action: str           # UP, DOWN or HOLD
    reason: str
    replicas: int         # serving when decided
    signals: Signals
    detail: str = ""      # e.g. which device lacked how much (no_memory)
    count: int = 1        # replicas to add or remove


@dataclass
class _Model:
    policy: ScalePolicy
    started_s: float                     # when the policy was set
    since_s: float                       # the last change, or the start
    samples: deque[tuple[float, Sample]] = field(default_factory=deque)
    arrivals: deque[tuple[float, int]] = field(default_factory=deque)
    pending_arrivals: int = 0
    last_up_s: float = -1e18
    last_change_s: float = -1e18


def _mean(samples: deque[tuple[float, Sample]], start: float, now: float,
          value: Callable[[Sample], float]) -> float:
    """Time-weighted mean over [start, now]: each sample holds until the next one."""
    total = weight = 0.0
    items = list(samples)
    for i, (t, s) in enumerate(items):
        end = items[i + 1][0] if i + 1 < len(items) else now
        lo, hi = max(t, start), min(end, now)
        if hi > lo:
            total += value(s) * (hi - lo)
            weight += hi - lo
    return total / weight if weight > 0 else 0.0


def _gpu_mean(samples: deque[tuple[float, Sample]], start: float, now: float
              ) -> float | None:
    """The time-weighted GPU utilization over the samples that carry one, or None."""
    known: deque[tuple[float, Sample]] = deque(
        (t, s) for t, s in samples if s.gpu_utilization is not None)
    if not known:
        return None
    return _mean(known, max(start, known[0][0]), now, lambda s: s.gpu_utilization or 0.0)


class Controller:
    """Per model: sliding windows of samples and arrivals, and the decision tree."""

    def __init__(self) -> None:
        self._models: dict[str, _Model] = {}

    def models(self) -> list[str]:
        return list(self._models)

    def policy(self, model: str) -> ScalePolicy | None:
        m = self._models.get(model)
        return m.policy if m is not None else None

    def set_policy(self, model: str, policy: ScalePolicy, now: float) -> None:
        m = self._models.get(model)
        if m is None:
            self._models[model] = _Model(policy, now, now)
        elif m.policy != policy:
            m.policy = policy

    def forget(self, model: str) -> None:
        self._models.pop(model, None)

    # -- feeding ------------------------------------------------------------
    def arrived(self, model: str, n: int = 1) -> None:
        m = self._models.get(model)
        if m is not None:
            m.pending_arrivals += n

    def observe(self, model: str, now: float, sample: Sample) -> None:
        m = self._models.get(model)
        if m is None:
            return
        m.samples.append((now, sample))
        m.arrivals.append((now, m.pending_arrivals))
        m.pending_arrivals = 0
        keep = now - max(m.policy.window_s, m.policy.down_window_s)
        # the newest sample older than the horizon still covers its start
        while len(m.samples) > 1 and m.samples[1][0] <= keep:
            m.samples.popleft()
        while m.arrivals and m.arrivals[0][0] <= keep:
            m.arrivals.popleft()

    def signals(self, model: str, now: float) -> Signals:
        m = self._models[model]
        pol = m.policy
        first = m.samples[0][0] if m.samples else now
        start = max(now - pol.window_s, m.started_s)
        # utilization for scaling down counts only since the last change: it must be
        # seen low with the replicas there are now
        down_start = max(now - pol.down_window_s, m.since_s)
        before = next((s for t, s in reversed(m.samples) if t <= start), None)

        def util(s: Sample) -> float:
            return s.busy / s.replicas if s.replicas else 0.0

        last = m.samples[-1][1] if m.samples else None
        span = max(now - start, 1e-9)
        mid = start + span / 2
        early = sum(n for t, n in m.arrivals if start < t <= mid)
        late = sum(n for t, n in m.arrivals if t > mid)
        return Signals(
            queue_s=_mean(m.samples, start, now, lambda s: s.queue_s),
            depth_per_replica=_mean(m.samples, start, now,
                                    lambda s: s.depth / max(s.replicas, 1)),
            utilization=_mean(m.samples, start, now, util),
            utilization_down=_mean(m.samples, down_start, now, util),
            arrival_rps=(early + late) / span,
            arrival_trend=late / early if early else (2.0 if late else 1.0),
            observed_s=max(now - max(m.started_s, first), 0.0),
            since_change_s=max(now - max(m.since_s, first), 0.0),
            capacity_rps=last.capacity_rps if last is not None else 0.0,
            depth=last.depth if last is not None else 0,
            depth_before=before.depth if before is not None else 0,
            recent_rps=late / max(now - mid, 1e-9),
            gpu_utilization=_gpu_mean(m.samples, start, now),
            breaker_open=last.breaker_open if last is not None else False)

    # -- deciding -----------------------------------------------------------
    def decide(self, model: str, now: float, serving: int, loading: int,
               room: Room) -> Decision:
        """One step of the tree (see the module's docstring). ``room()`` says why no
        worker can take one more replica, or None when one can; it is asked only when
        the tree gets that far."""
        m = self._models[model]
        pol = m.policy
        sig = self.signals(model, now)

        def out(action: str, reason: str, detail: str = "", count: int = 1) -> Decision:
            return Decision(action, reason, serving, sig, detail, count)

        if serving + loading < pol.min_replicas:
            why = room()
            return out(UP, "below_min") if why is None else out(HOLD, *why)
        if pol.max_replicas and serving > pol.max_replicas:
            return out(DOWN, "above_max", count=serving - pol.max_replicas)
        if loading:
            return out(HOLD, "loading")
        if sig.observed_s < pol.window_s:
            return out(HOLD, "warming_up")
        if sig.breaker_open:
            return out(HOLD, "breaker_open")
        deep = pol.depth_per_replica > 0 and sig.depth_per_replica > pol.depth_per_replica
        if sig.queue_s > pol.queue_slo_s or deep:
            return self._pressure(m, now, serving, sig, room, out,
                                  "queue_time" if sig.queue_s > pol.queue_slo_s
                                  else "queue_depth")
        if serving > pol.min_replicas and sig.since_change_s >= pol.down_window_s \
                and sig.queue_s < pol.queue_slo_s / 2:
            down = self._slack(m, now, serving, sig, out)
            if down is not None:
                return down
        return out(HOLD, "steady")

    @staticmethod
    def _slack(m: _Model, now: float, serving: int, sig: Signals,
               out: Callable[..., Decision]) -> Decision | None:
        pol = m.policy
        # the replicas left run at most midway between the thresholds (hysteresis: an
        # up sizes for high_utilization, so a down never undoes it at once)
        needed = sig.needed(pol, (pol.low_utilization + pol.high_utilization) / 2)
        if sig.utilization_down >= pol.low_utilization and (needed is None
                                                            or needed >= serving):
            return None
        if needed is not None:
            target = max(needed, pol.min_replicas, serving - max(1, (serving - needed) // 2))
            if target >= serving:
                return out(HOLD, "would_overload")
        elif sig.utilization_down * serving / (serving - 1) >= pol.high_utilization:
            return out(HOLD, "would_overload")
        else:
            target = serving - 1
        if sig.arrival_trend > 1.5 and sig.arrival_rps > 0:
            return out(HOLD, "arrivals_rising")
        if now < m.last_change_s + pol.down_cooldown_s:
            return out(HOLD, "cooldown")
        return out(DOWN, "low_utilization", count=serving - target)

    @staticmethod
    def _pressure(m: _Model, now: float, serving: int, sig: Signals,
                  room: Room, out: Callable[..., Decision],
                  reason: str) -> Decision:
        pol = m.policy
        if pol.max_replicas and serving >= pol.max_replicas:
            return out(HOLD, "at_max")
        if sig.utilization < pol.low_utilization:
            return out(HOLD, "queue_not_busy")
        if now < m.last_up_s + pol.up_cooldown_s:
            return out(HOLD, "cooldown")
        needed = sig.needed(pol, pol.high_utilization)
        if needed is not None and needed <= serving and sig.depth < sig.depth_before:
            return out(HOLD, "draining")   # enough replicas: the backlog shrinks
        why = room()
        if why is not None:
            return out(HOLD, *why)
        count = max(1, needed - serving) if needed is not None else 1
        if pol.max_replicas:
            count = min(count, pol.max_replicas - serving)
        return out(UP, reason, count=count)

    def applied(self, model: str, now: float, action: str) -> None:
        """A change was made: the cool-downs start and the windows restart from now."""
        m = self._models.get(model)
        if m is None or action == HOLD:
            return
        m.since_s = m.last_change_s = now
        if action == UP:
            m.last_up_s = now
