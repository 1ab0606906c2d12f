"""Load on demand's pure decisions, time passed in: how long a model takes to load
(learned per model), whether a loaded model has stayed long enough to be evicted (a
minimum residency), and whether another load may start now (loads per minute bounded).
Nothing here reads the broker's objects: :mod:`ondemand` asks and applies.
"""

from __future__ import annotations

from collections import deque
from statistics import median

DEFAULT_LOAD_S = 1.0     # a model's load time before any load was seen
WINDOW_S = 60.0          # the loads-per-minute bound counts the starts in this window
LEARN_WEIGHT = 0.3       # of each new load time in the moving average


class LoadTimes:
    """Seconds from asking for a load to the model serving, per model: the first load
    sets it, later ones move it by :data:`LEARN_WEIGHT`. Before a model's first load, the
    median of the models seen (models of a repository tend to be alike), else
    :data:`DEFAULT_LOAD_S`."""

    def __init__(self) -> None:
        self.learned: dict[str, float] = {}

    def observe(self, model: str, seconds: float) -> None:
        old = self.learned.get(model)
        self.learned[model] = seconds if old is None else \
            (1 - LEARN_WEIGHT) * old + LEARN_WEIGHT * seconds

    def predict(self, model: str) -> float:
        got = self.learned.get(model)
        if got is not None:
            return got
        return median(self.learned.values()) if self.learned else DEFAULT_LOAD_S

    def forget(self, model: str) -> None:
        self.learned.pop(model, None)


class ThrashGuard:
    """The two thrash bounds. ``min_residency_s``: a model loaded on demand is not
    evicted before it has been loaded this long. ``max_loads_per_minute``: no more load
    starts than this in any :data:`WINDOW_S` (0: no bound)."""

    def __init__(self, min_residency_s: float, max_loads_per_minute: int) -> None:
        self.min_residency_s = min_residency_s
        self.max_loads_per_minute = max_loads_per_minute
        self.since: dict[tuple[str, str], float] = {}   # (worker id, model) -> loaded at
        self.starts: deque[float] = deque()

    # -- loads per minute --------------------------------------------------------
    def _trim(self, now: float) -> None:
        while self.starts and self.starts[0] + WINDOW_S <= now:
            self.starts.popleft()

    def load_wait_s(self, now: float) -> float:
        """Seconds until another load may start (0: now). Asking changes nothing."""
        if not self.max_loads_per_minute:
            return 0.0
        recent = [s for s in self.starts if s + WINDOW_S > now]
        if len(recent) < self.max_loads_per_minute:
            return 0.0
        return recent[-self.max_loads_per_minute] + WINDOW_S - now

    def started(self, now: float) -> None:
        self.starts.append(now)
        self._trim(now)

    def loads_in_window(self, now: float) -> int:
        return sum(1 for s in self.starts if s + WINDOW_S > now)

    # -- residency ----------------------------------------------------------------
    def resident(self, worker_id: str, model: str, now: float) -> None:
        self.since[(worker_id, model)] = now

    def gone(self, worker_id: str, model: str | None = None) -> None:
        """The model (every model, when None) left the worker."""
        for key in [k for k in self.since if k[0] == worker_id
                    and (model is None or k[1] == model)]:
            del self.since[key]

    def evictable_at(self, worker_id: str, model: str) -> float:
        """When the model may be evicted from the worker (-inf: any time)."""
        since = self.since.get((worker_id, model))
        return -float("inf") if since is None else since + self.min_residency_s

    def may_evict(self, worker_id: str, model: str, now: float) -> bool:
        return now >= self.evictable_at(worker_id, model)
