"""Which idle models leave a worker to make room for another: one pure function of a
frozen :class:`Snapshot`, the time passed in, nothing read from the broker's objects.

Placement (placement.py) builds the snapshot from what it plans and load on demand's
record (thrash.Tenure), applies the answer (the UNLOADs) and records each eviction
there; load on demand reads the record. Neither asks the other.

The rules, in the order they apply:

* only an *idle* model may go: loaded, nothing queued or running for it;
* not before its residency floor (load on demand keeps a model it loaded at least a
  multiple of its load time: thrash.ThrashGuard);
* the *hot* models, the most wanted of those the worker holds, as many as fit beside
  :data:`TURNS` of the one asking for room, yield to a less wanted one only once that
  one's requests have waited its patience (and no load started for as long): the room
  past the hot models is where the colder ones take turns;
* the least wanted go first (a decayed count of recent requests), then the least
  recently used, then by name (the answer never depends on the order of a set);
* as few as free enough; when all that may go would not free enough, none goes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# The room past the most wanted models (kept) holds this many of the model asking for
# room: one loads while another runs. With one, the turns run in series (evict, load, the
# LOADED back, the batch, its result, evict again) and the less wanted models waited
# 20-30% longer under Zipf(1.1) over 12 models on a 4-model budget.
TURNS = 2


@dataclass(frozen=True)
class Held:
    """A model the worker holds or is loading, other than the one asking for room."""

    model: str
    bytes: int                  # every version held or loading: what it takes of the room
    loaded_bytes: int = 0       # the versions loaded: what evicting it frees
    idle: bool = False          # loaded, with nothing queued or running
    wanted: float = 0.0         # its decayed count of recent requests
    last_used_s: float = 0.0
    resident_until_s: float = -math.inf   # not evicted before (its residency floor)


@dataclass(frozen=True)
class Wait:
    """The model asking for room waits for a load on demand."""

    since_s: float              # its first request began to wait
    last_start_s: float         # the last load on demand started (any model's)
    patience_s: float           # how long it waits before a hot model yields to it


@dataclass(frozen=True)
class Snapshot:
    """One worker's room as it stands at ``now_s``, and the load asking for it."""

    keep: str                   # the model asking for room
    need_bytes: int
    free_bytes: int | None      # None: no limit
    held: tuple[Held, ...]      # every other model the worker holds or loads
    now_s: float
    keep_wanted: float = 0.0
    wait: Wait | None = None    # None: not a load on demand (a new version, a replica)


def hot(s: Snapshot) -> frozenset[str]:
    """The most wanted of the held models, as many as still fit in the room beside
    :data:`TURNS` of the load (what they hold counted back in)."""
    room = s.free_bytes - TURNS * s.need_bytes if s.free_bytes is not None else 0
    room += sum(h.bytes for h in s.held)
    out = set()
    for h in sorted(s.held, key=lambda h: (-h.wanted, h.model)):
        room -= h.bytes
        if room < 0:
            break
        out.add(h.model)
    return frozenset(out)


def _may_go(s: Snapshot, h: Held, hot_models: frozenset[str]) -> bool:
    if not h.idle or s.now_s < h.resident_until_s:
        return False
    if s.wait is None or h.model not in hot_models:
        return True
    return h.wanted <= s.keep_wanted or \
        s.now_s - max(s.wait.since_s, s.wait.last_start_s) >= s.wait.patience_s


def evictable(s: Snapshot) -> list[Held]:
    """The models that may go to make room, in the order they go."""
    if not any(h.idle for h in s.held):
        return []
    hot_models = hot(s)
    return sorted((h for h in s.held if _may_go(s, h, hot_models)),
                  key=lambda h: (h.wanted, h.last_used_s, h.model))


def freeable(s: Snapshot) -> int:
    """The bytes evicting every model that may go would free."""
    return sum(h.loaded_bytes for h in evictable(s))


def choose(s: Snapshot) -> tuple[str, ...] | None:
    """The models to evict, in order, so that the load fits: () when it fits as it is,
    None when it does not fit even with every model that may go evicted."""
    if s.free_bytes is None or s.need_bytes <= s.free_bytes:
        return ()
    short, freed, out = s.need_bytes - s.free_bytes, 0, []
    for h in evictable(s):
        if freed >= short:
            break
        freed += h.loaded_bytes
        out.append(h.model)
    return tuple(out) if freed >= short else None
