"""Load on demand's pure decisions, time and load costs passed in: how long a model
takes to load (learned per model), whether a loaded model has stayed long enough to be
evicted (a minimum residency that scales with its load time), and whether another load
may start now (the seconds spent loading in a minute bounded to a share of it).
Nothing here reads the broker's objects: :mod:`ondemand` asks and applies.

Both bounds scale with what a load costs because a load is not one price: a move back
from the worker's host-memory tier takes milliseconds and a cold load from disk of a
large model seconds. Fixed bounds sized for the dear loads starve the cheap ones (a
working set that churns through cheap loads is not thrashing the host), and bounds sized
for the cheap ones let the dear ones eat it.
"""

from __future__ import annotations

import math
from collections import deque
from statistics import median

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
