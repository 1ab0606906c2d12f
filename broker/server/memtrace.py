"""What the broker's Python memory is made of, for finding what grows under a soak: the
``memory`` control verb, off unless the broker starts with ``ZEROSERVE_TRACEMALLOC=N``
(``tracemalloc`` keeping N frames of each allocation; it costs CPU on every allocation,
so never by default).

Each call answers the live objects counted by type and the allocations grouped by
traceback, largest first; after a call with ``mark``, each figure also says how much it
grew since that mark. Walking every object pauses the broker's loop (tens of
milliseconds), so the verb is an admin's (control socket, admin token).
"""

from __future__ import annotations

import collections
import gc
import tracemalloc
from typing import Any, Mapping

from zeroserve.broker.server.control import ControlError, ControlTable

ENV = "ZEROSERVE_TRACEMALLOC"
MAX_FRAMES = 100
# tracemalloc's own bookkeeping and this module's walk are not the broker's memory
_SKIP = (tracemalloc.Filter(False, tracemalloc.__file__),
         tracemalloc.Filter(False, __file__))


def start(environ: Mapping[str, str]) -> int:
    """Trace allocations with the frames ``environ`` asks (0: off, nothing started); a
    value that is no count of frames is refused, for the broker to exit on."""
    raw = environ.get(ENV, "").strip() or "0"
    try:
        frames = int(raw)
    except ValueError:
        frames = -1
    if not 0 <= frames <= MAX_FRAMES:
        raise ValueError(f"{ENV}={raw!r}: the frames kept of each allocation, 1 to "
                         f"{MAX_FRAMES} (0 or unset: off)")
    if frames and not tracemalloc.is_tracing():
        tracemalloc.start(frames)
    return frames


def type_counts() -> collections.Counter[str]:
    """Live objects the collector tracks, by type (containers and instances: what a
    leak of structures is made of; strings and numbers are untracked and show in the
    allocations instead)."""
    gc.collect()
    return collections.Counter(f"{type(o).__module__}.{type(o).__qualname__}"
                               for o in gc.get_objects())


class MemoryTrace:
    """The ``memory`` verb over this process's tracemalloc (started by :func:`start`)."""

    def __init__(self) -> None:
        self._snapshot: tracemalloc.Snapshot | None = None
        self._types: collections.Counter[str] = collections.Counter()

    def add_verbs(self, c: ControlTable) -> None:
        c.add("memory", self.report, mutates=True)

    def report(self, args: dict[str, Any]) -> dict[str, Any]:
        """``top`` (default 20) types and tracebacks, grown since the last ``mark`` when
        there was one; ``mark``: this call's figures are the next calls' base."""
        if not tracemalloc.is_tracing():
            raise ControlError("unavailable", f"memory tracing is off: start the broker "
                               f"with {ENV}=25 (frames kept of each allocation)")
        top = int(args.get("top", 20))
        if top < 1:
            raise ValueError(f"top must be >= 1, got {top}")
        types = type_counts()
        snapshot = tracemalloc.take_snapshot().filter_traces(_SKIP)
        base = self._snapshot
        if base is not None:
            stats = snapshot.compare_to(base, "traceback")
        else:   # no base: sizes alone, as grown from nothing
            stats = [tracemalloc.StatisticDiff(s.traceback, s.size, s.size, s.count, s.count)
                     for s in snapshot.statistics("traceback")]
        grown = {t: n - self._types.get(t, 0) for t, n in types.items()}
        out = {"frames": tracemalloc.get_traceback_limit(), "marked": base is not None,
               "traced_kb": round(tracemalloc.get_traced_memory()[0] / 1024, 1),
               "objects": [{"type": t, "count": types[t], "grown": grown[t]}
                           for t in sorted(types, key=lambda t: (-grown[t], -types[t]))[:top]],
               "allocations": [allocation(s) for s in stats[:top]]}
        if args.get("mark"):
            self._snapshot, self._types = snapshot, types
        return out


def allocation(s: tracemalloc.StatisticDiff) -> dict[str, Any]:
    """One traceback's live blocks: its frames innermost last, as a traceback reads."""
    return {"kb": round(s.size / 1024, 2), "grown_kb": round(s.size_diff / 1024, 2),
            "blocks": s.count, "grown_blocks": s.count_diff,
            "traceback": [f"{f.filename}:{f.lineno}" for f in s.traceback]}
