"""Load on demand's pure decisions, time and load costs passed in: how long a model
takes to load (learned per model), whether a loaded model has stayed long enough to be
evicted (a minimum residency that scales with its load time), and whether another load
may start now (the seconds spent loading in a minute bounded to a share of it).
Nothing here reads the broker's objects: :mod:`ondemand` asks and applies, and
:class:`Tenure` is the record it writes and placement reads to choose what to evict
(eviction.py).

Both bounds scale with what a load costs because a load is not one price: a move back
from the worker's host-memory tier takes milliseconds and a cold load from disk of a
large model seconds. Fixed bounds sized for the dear loads starve the cheap ones (a
working set that churns through cheap loads is not thrashing the host), and bounds sized
for the cheap ones let the dear ones eat it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from statistics import median

from zeroserve.broker.server.eviction import Wait

DEFAULT_LOAD_S = 1.0     # a model's load time before any load was seen
WINDOW_S = 60.0          # the load-share bound sums the loads started in this window
LEARN_WEIGHT = 0.3       # of each new load time in the moving average
# A model stays loaded this many times its load time: what it costs to load it back is
# then at most 1/RESIDENCY_FACTOR of the time it held its slot. Not more: the most wanted
# models are kept by the patience (ondemand.py), not by this, and under Zipf(1.1) over 12
# models on a 4-model budget the room past them turned over 20% faster at 5 than at 20
# (77-79% of the all-loaded throughput against 64-67%, same runs).
RESIDENCY_FACTOR = 5.0
# How fast a model's demand forgets: a request counts half after this long. Long beside
# the gaps between requests of the models that churn (tens of milliseconds), so their
# order is stable; short enough that a shift of traffic reorders them within seconds.
DEMAND_HALF_LIFE_S = 10.0


class LoadTimes:
    """Seconds from asking for a load to the model serving, per model: the first load
    sets it, later ones move it by :data:`LEARN_WEIGHT`. Before a model's first load, the
    median of the models seen (models of a repository tend to be alike), else
    :data:`DEFAULT_LOAD_S`. :meth:`latest` is the last load's time alone: what loading
    the model back is likely to cost, now that the worker parks what it unloads (the
    first load, from disk, weighs on the average for many loads back from the park)."""

    def __init__(self) -> None:
        self.learned: dict[str, float] = {}
        self.last: dict[str, float] = {}

    def observe(self, model: str, seconds: float) -> None:
        self.last[model] = seconds
        old = self.learned.get(model)
        self.learned[model] = seconds if old is None else \
            (1 - LEARN_WEIGHT) * old + LEARN_WEIGHT * seconds

    def predict(self, model: str) -> float:
        got = self.learned.get(model)
        if got is not None:
            return got
        return median(self.learned.values()) if self.learned else DEFAULT_LOAD_S

    def latest(self, model: str) -> float:
        got = self.last.get(model)
        return self.predict(model) if got is None else got

    def forget(self, model: str) -> None:
        self.learned.pop(model, None)
        self.last.pop(model, None)


class Demand:
    """Requests per model, each counting less as it ages (halved every ``half_life_s``):
    which loaded model is wanted least, and so goes first when room is needed. A model
    asked for 200 times a second outranks one asked for 20, whichever ran last: least
    recently used alone evicts a hot model in the instant its queue is empty, and under
    a skewed load that is most of the loads there are."""

    def __init__(self, half_life_s: float = DEMAND_HALF_LIFE_S) -> None:
        self._decay = math.log(2) / half_life_s
        self._count: dict[str, tuple[float, float]] = {}   # model -> (count, at)

    def asked(self, model: str, now: float, n: int = 1) -> None:
        self._count[model] = (self.count(model, now) + n, now)

    def count(self, model: str, now: float) -> float:
        """The model's decayed count of requests at ``now``: its requests a second times
        ``half_life_s / ln 2`` in a steady state."""
        got = self._count.get(model)
        if got is None:
            return 0.0
        count, at = got
        return count * math.exp(-self._decay * max(0.0, now - at))

    def rate(self, model: str, now: float) -> float:
        """Requests a second, in the steady state the decayed count stands for."""
        return self.count(model, now) * self._decay

    def forget(self, model: str) -> None:
        self._count.pop(model, None)

    def names(self) -> set[str]:
        return set(self._count)

    def __len__(self) -> int:
        return len(self._count)


class ThrashGuard:
    """The two thrash bounds. Residency: a model loaded on demand is not evicted before
    it has been loaded ``max(min_residency_s, residency_factor x its load time)``.
    Load share: the load starts of any :data:`WINDOW_S`, each counted at its predicted
    load time, sum to at most ``max_load_share`` of the window (0: no bound); a load
    dearer than the whole share may still start in a window with no other load."""

    def __init__(self, min_residency_s: float, max_load_share: float,
                 residency_factor: float = RESIDENCY_FACTOR) -> None:
        self.min_residency_s = min_residency_s
        self.residency_factor = residency_factor
        self.max_load_share = max_load_share
        self.evictable: dict[tuple[str, str], float] = {}   # (worker id, model) -> at
        self.starts: deque[tuple[float, float]] = deque()     # (started at, cost s)
        self._used_s = 0.0                                    # their costs' sum

    # -- load share ---------------------------------------------------------------
    @property
    def budget_s(self) -> float:
        """Seconds of loading a window may hold (0: no bound)."""
        return self.max_load_share * WINDOW_S

    def _window(self, now: float) -> tuple[int, float]:
        """(how many of the oldest starts left the window by ``now``, the predicted
        seconds of those still in it). The sum is kept as starts come and go, so asking
        walks only the starts that left since the last one: a host that churns through
        cheap loads starts thousands a minute, and every request for a model not loaded
        asks. Asking changes nothing."""
        gone, used = 0, self._used_s
        for t, c in self.starts:   # oldest first
            if t + WINDOW_S > now:
                break
            gone, used = gone + 1, used - c
        return gone, max(0.0, used)

    def load_wait_s(self, now: float, cost_s: float) -> float:
        """Seconds until a load predicted to take ``cost_s`` may start (0: now): until
        enough of the window's oldest starts leave it."""
        if not self.max_load_share:
            return 0.0
        gone, used = self._window(now)
        wait = 0.0
        for i in range(gone, len(self.starts)):
            if used <= 1e-12 or used + cost_s <= self.budget_s:
                break
            t, c = self.starts[i]
            used -= c
            wait = t + WINDOW_S - now
        return wait

    def started(self, now: float, cost_s: float) -> None:
        gone, used = self._window(now)
        for _ in range(gone):
            self.starts.popleft()
        self.starts.append((now, cost_s))
        # summed afresh when the window empties: no drift from the subtractions stays
        self._used_s = used + cost_s if len(self.starts) > 1 else cost_s

    def loads_in_window(self, now: float) -> int:
        return len(self.starts) - self._window(now)[0]

    def load_s_in_window(self, now: float) -> float:
        """The predicted seconds of the loads started in the window."""
        return self._window(now)[1]

    # -- residency ----------------------------------------------------------------
    def residency_s(self, load_s: float) -> float:
        return max(self.min_residency_s, self.residency_factor * load_s)

    def resident(self, worker_id: str, model: str, now: float, load_s: float) -> None:
        """The model is loaded on the worker from ``now``; loading it took (is predicted
        to take) ``load_s``."""
        self.evictable[(worker_id, model)] = now + self.residency_s(load_s)

    def gone(self, worker_id: str, model: str | None = None) -> None:
        """The model (every model, when None) left the worker."""
        for key in [k for k in self.evictable if k[0] == worker_id
                    and (model is None or k[1] == model)]:
            del self.evictable[key]

    def evictable_at(self, worker_id: str, model: str) -> float:
        """When the model may be evicted from the worker (-inf: any time)."""
        return self.evictable.get((worker_id, model), -float("inf"))

    def next_evictable(self, now: float) -> float | None:
        """When the next residency now running ends (None: none runs)."""
        return min((t for t in self.evictable.values() if t > now), default=None)

    def may_evict(self, worker_id: str, model: str, now: float) -> bool:
        return now >= self.evictable_at(worker_id, model)


@dataclass
class Load:
    """A load on demand in progress."""

    worker: bytes
    started_s: float
    since_s: float          # when its first request began to wait
    tried: set[bytes] = field(default_factory=set)


class Tenure:
    """Load on demand's record of its models: where each is placed, which load now and
    which wait for room (since when), how wanted each model is, how long each must stay,
    and why one was evicted. :class:`ondemand.OnDemand` writes it as requests come and
    loads start and end; placement reads it to choose what to evict (an
    :class:`eviction.Snapshot`) and records here what it evicted, before its next
    decision: neither asks the other. Worker identities and ids only."""

    def __init__(self, guard: ThrashGuard | None = None) -> None:
        self.guard = guard or ThrashGuard(0.0, 0.0)
        self.times = LoadTimes()   # a request's wait for a load, for admission
        self.costs = LoadTimes()   # the worker's time loading, for the thrash bounds
        self.demand = Demand()     # requests per model, recent ones weighing most
        self.assigned: dict[str, set[bytes]] = {}     # on-demand models: placed where
        self.loads: dict[str, Load] = {}              # loading now
        self.wanted: dict[str, float] = {}            # waiting for a load to start, since
        self.evicted: dict[str, str] = {}             # model -> why (until loaded again)
        self.last_start_s = -math.inf                 # when a load last started

    def loading(self, name: str) -> bool:
        """Whether a load on demand of ``name`` runs now."""
        return name in self.loads

    def wanted_level(self, name: str, now: float) -> float:
        """How much ``name`` is wanted at ``now``: eviction takes the lowest first."""
        return self.demand.count(name, now)

    def resident_until(self, worker_id: str, model: str) -> float:
        """When ``model`` may leave the worker (-inf: any time)."""
        return self.guard.evictable_at(worker_id, model)

    def waiting_since(self, name: str) -> float | None:
        load = self.loads.get(name)
        return load.since_s if load is not None else self.wanted.get(name)

    def patience_s(self, name: str) -> float:
        """How long ``name``'s requests wait before a hot model yields its room: the
        residency rule applied to what its load takes from a request's view (the round
        trips and the batches ahead, not only the worker's time). The room past the hot
        models turns over within a few loads, so a colder model waits its turn there
        and takes a hot model's room only when that turn is long overdue."""
        return self.guard.residency_s(self.times.predict(name))

    def wait(self, name: str) -> Wait | None:
        """``name``'s wait for a load on demand (None: it waits for none)."""
        since = self.waiting_since(name)
        return None if since is None else Wait(since, self.last_start_s, self.patience_s(name))

    def record_eviction(self, identity: bytes, worker_id: str, model: str, why: str) -> None:
        """``model`` left the worker: it is not placed there any more."""
        self.assigned.get(model, set()).discard(identity)
        self.guard.gone(worker_id, model)
        self.evicted[model] = why
