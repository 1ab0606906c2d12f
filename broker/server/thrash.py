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

from collections import deque
from statistics import median

DEFAULT_LOAD_S = 1.0     # a model's load time before any load was seen
WINDOW_S = 60.0          # the load-share bound sums the loads started in this window
LEARN_WEIGHT = 0.3       # of each new load time in the moving average
# A model stays loaded this many times its load time: what it costs to load it back is
# then at most 1/RESIDENCY_FACTOR of the time it held its slot.
RESIDENCY_FACTOR = 20.0


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

    # -- load share ---------------------------------------------------------------
    @property
    def budget_s(self) -> float:
        """Seconds of loading a window may hold (0: no bound)."""
        return self.max_load_share * WINDOW_S

    def _recent(self, now: float) -> list[tuple[float, float]]:
        return [(t, c) for t, c in self.starts if t + WINDOW_S > now]

    def load_wait_s(self, now: float, cost_s: float) -> float:
        """Seconds until a load predicted to take ``cost_s`` may start (0: now): until
        enough of the window's oldest starts leave it. Asking changes nothing."""
        if not self.max_load_share:
            return 0.0
        recent = self._recent(now)
        used, wait = sum(c for _, c in recent), 0.0
        for t, c in recent:   # oldest first
            if used <= 1e-12 or used + cost_s <= self.budget_s:
                break
            used -= c
            wait = t + WINDOW_S - now
        return wait

    def started(self, now: float, cost_s: float) -> None:
        self.starts.append((now, cost_s))
        while self.starts and self.starts[0][0] + WINDOW_S <= now:
            self.starts.popleft()

    def loads_in_window(self, now: float) -> int:
        return len(self._recent(now))

    def load_s_in_window(self, now: float) -> float:
        """The predicted seconds of the loads started in the window."""
        return sum(c for _, c in self._recent(now))

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

    def may_evict(self, worker_id: str, model: str, now: float) -> bool:
        return now >= self.evictable_at(worker_id, model)
