"""Load on demand: a model of the repository is *available* (listed, its metadata and
config served) without being loaded anywhere. A request for it queues in its model's
queue as any other and asks for a load (:meth:`OnDemand.want`); the load goes to the
worker where it fits now, after evicting the idle models there that are wanted least
(eviction.py decides, placement applies; a model with work queued or running is never
idle; "wanted" is :class:`thrash.Demand`'s count of recent requests). What on-demand
knows of its models (placed where, loading, waiting since, wanted, resident until) is
its record, :class:`thrash.Tenure`: written here, read by placement, which records there
what it evicted. Every request that comes while it
loads shares that one load. Once the worker says LOADED the
queue dispatches as usual; a load that fails, or a worker lost while loading, is tried
on another worker, else every waiting request is answered once with why.

Admission asks :meth:`OnDemand.admit` first: the predicted load time (learned per model,
thrash.py) counts in the deadline check, and when the load-share bound is spent (the
seconds spent loading in the last minute) a request is refused at once (503, Retry-After)
rather than queued to wait for a load that cannot start. A model loaded on demand stays
at least ``residency_factor`` times its load time (``min_residency_s`` at least) before
it may be evicted; and the models most wanted, as many as the worker holds beside two of
the one asking for room (eviction.TURNS), are evicted for a less wanted one only once
that one has waited its patience: the hot models stay while the cold ones take turns in
the room left. A model is on demand when its config says ``"load_on_demand": true``, or
says nothing and the broker runs with ``--load-on-demand``.

The states it reports (``zeroserve models``, the repository index): AVAILABLE (on
demand, never loaded), LOADING, READY, EVICTED (loaded once, evicted since: the reason
says why and for what).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from zeroserve.broker import protocol as p
from zeroserve.broker.server.catalog import Catalog, CatalogModel
from zeroserve.broker.server.metrics import BrokerMetrics
from zeroserve.broker.server.pool import WorkerPool, WorkerState
from zeroserve.broker.server.scheduler import Scheduler
from zeroserve.broker.server.swap import Placed, placed_on
from zeroserve.broker.server.thrash import RESIDENCY_FACTOR, Load, Tenure, ThrashGuard
from zeroserve.broker.server.types import Clock, ModelVersion
from zeroserve.models.repository import ModelConfig

logger = logging.getLogger(__name__)

AVAILABLE, LOADING, READY, EVICTED = "AVAILABLE", "LOADING", "READY", "EVICTED"
TOO_BIG = "TOO_BIG"   # no worker could hold it even with nothing else loaded
NO_FIT = "the working set does not fit the memory budget"
PENDING_POLL_S = 0.05   # a waiting load looks again this often when no time is known
MIN_POLL_S = 0.001      # nor more often than this

Fail = Callable[[str, p.ErrorCode, str, "float | None"], None]


def never_fits(name: str, why: str) -> str:
    return (f"model {name!r} can never be loaded here: {why}; raise the worker's "
            "--memory-budget (or free its device), or make the model smaller")


@dataclass(frozen=True)
class OnDemandOptions:
    enabled: bool = False            # for models whose config does not say
    min_residency_s: float = 0.005   # the floor of the residency thrash.py scales
    max_load_share: float = 0.5      # of each minute spent loading at most; 0: no bound
    residency_factor: float = RESIDENCY_FACTOR   # x a model's load time it stays at least
    pending_s: float = 30.0          # a load that cannot start for this long gives up

    def tenure(self) -> Tenure:
        """The record load on demand writes and placement reads, with these bounds."""
        return Tenure(ThrashGuard(self.min_residency_s, self.max_load_share,
                                  self.residency_factor))


class Room(Protocol):
    """What load on demand asks of memory placement (placement.Placement): whether a
    version fits a worker now (after evicting what may go), or could with nothing else
    loaded; what the worker has free and holds."""

    def fits(self, worker: WorkerState, name: str, version: int) -> bool: ...

    def too_big(self, worker: WorkerState, name: str, version: int) -> str | None: ...

    def available(self, worker: WorkerState) -> int | None: ...

    def used(self, worker: WorkerState) -> int: ...

    def for_memory(self, error: str) -> bool: ...


class Refused:
    """A request admission must refuse now."""

    __slots__ = ("code", "message", "retry_after_s")

    def __init__(self, code: p.ErrorCode, message: str,
                 retry_after_s: float | None = None) -> None:
        self.code, self.message, self.retry_after_s = code, message, retry_after_s


class OnDemandSets:
    """Which models load on demand (their config says so, or says nothing and the broker
    loads on demand) and, of those, where each is placed (the record's ``assigned``, which
    :class:`OnDemand` writes): a placement strategy (:meth:`placed`) the worker loads
    read, built before the OnDemand that asks them to load."""

    def __init__(self, enabled: bool, tenure: Tenure, default: Placed = placed_on) -> None:
        self.enabled = enabled
        self.default = default   # the workers an on-demand model may go to
        self.assigned = tenure.assigned

    def on(self, cfg: ModelConfig) -> bool:
        return cfg.load_on_demand if cfg.load_on_demand is not None else self.enabled

    def placed(self, cfg: ModelConfig, worker: WorkerState) -> bool:
        """The placement strategy: an on-demand model is held only where it was asked."""
        if not self.default(cfg, worker):
            return False
        return not self.on(cfg) or worker.identity in self.assigned.get(cfg.name, ())


class OnDemand:
    """Reads the catalog, the pool, the scheduler's queues and the ``room`` memory
    placement sees; writes its record ``tenure`` (the one its options built, whose
    placements ``sets`` reads); asks ``load_placed(worker, model)`` to load a model now
    placed on a worker, and ``fail(model, code, message, retry_after_s)`` to answer every
    request queued for a model."""

    def __init__(self, catalog: Catalog, pool: WorkerPool, scheduler: Scheduler,
                 room: Room, metrics: BrokerMetrics, clock: Clock, options: OnDemandOptions,
                 sets: OnDemandSets, *, load_placed: Callable[[WorkerState, str], None],
                 fail: Fail, tenure: Tenure) -> None:
        self.catalog = catalog
        self.pool = pool
        self.scheduler = scheduler
        self.room = room
        self.metrics = metrics
        self.clock = clock
        self.opts = options
        self.sets = sets
        self._load_placed = load_placed
        self._fail = fail
        self._default = sets.default
        self.tenure = tenure
        # the record's tables, written here (placement reads them through the record)
        self.times, self.costs, self.demand = tenure.times, tenure.costs, tenure.demand
        self.guard, self.assigned = tenure.guard, tenure.assigned
        self.loads, self.wanted, self.evicted = tenure.loads, tenure.wanted, tenure.evicted
        # the waiting models are tried again when the pool changed since (room may have
        # opened) or at this time (a residency, a patience or the load share ends)
        self._tried_at_changes = -1
        self._retry_at = math.inf

    # -- the broker's calls -----------------------------------------------------------
    def on(self, cfg: ModelConfig) -> bool:
        """Whether ``cfg``'s model loads on demand (admission asks)."""
        return self.sets.on(cfg)

    def asked(self, name: str, now: float) -> None:
        """A request for ``name`` came (any model of the catalog: eviction weighs them all)."""
        self.demand.asked(name, now)

    # -- admission ----------------------------------------------------------------------
    def admit(self, model: CatalogModel, now: float) -> float | Refused:
        """For a request to an on-demand model no worker holds: the seconds its load is
        predicted to take from now, or why it is refused now."""
        name = model.config.name
        load = self.loads.get(name)
        predicted = self.times.predict(name)
        if load is not None:
            return max(0.0, load.started_s + predicted - now)
        if not self._candidates(name):
            return Refused(p.ErrorCode.NO_WORKER, f"no worker can load model {name!r}")
        if name not in self.wanted:
            cost_s = self.costs.predict(name)
            wait_s = self.guard.load_wait_s(now, cost_s)
            if wait_s > 0:
                return Refused(p.ErrorCode.UNAVAILABLE, (
                    f"model {name!r} is not loaded (about {cost_s:.3g} s to load) and "
                    f"the {self.guard.loads_in_window(now)} loads of the last minute took "
                    f"{self.guard.load_s_in_window(now):.3g} s, the bound of "
                    f"{self.guard.budget_s:g} s (--load-on-demand-max-load-share "
                    f"{self.opts.max_load_share:g}): {NO_FIT}"),
                    max(1.0, math.ceil(wait_s)))
            why = self._never_fits(name)
            if why is not None:   # no wait helps: not retryable, and says what would
                return Refused(p.ErrorCode.TOO_BIG, never_fits(name, why))
        return predicted

    def want(self, name: str, now: float) -> None:
        """A request for ``name`` was queued: load it if nothing holds or loads it. One
        already waiting is tried again by :meth:`settle`, when room may have opened."""
        if name in self.loads or name in self.wanted or self.pool.holders(name):
            return
        self.wanted[name] = now
        if not self._start(name, now):
            self._retry_at = min(self._retry_at, self._next_try(now))

    # -- loads ------------------------------------------------------------------------
    def _candidates(self, name: str) -> list[WorkerState]:
        model = self.catalog.get(name)
        if model is None:
            return []
        return [w for w in self.pool.workers.values()
                if not w.draining and self._default(model.config, w)]

    def _never_fits(self, name: str) -> str | None:
        """Why no worker could hold the model even with nothing else loaded (None: one
        could)."""
        model = self.catalog.get(name)
        whys = []
        for w in self._candidates(name):
            fits = True
            for v in model.versions if model is not None else ():
                why = self.room.too_big(w, name, v)
                if why is not None:
                    whys.append(why)
                    fits = False
                    break
            if fits:
                return None
        return "; ".join(whys[:2]) or None

    def _choose(self, name: str, tried: set[bytes]) -> WorkerState | None:
        """The worker to load ``name`` on now: one where it fits after evicting what may
        go, where it fits without eviction first, then the least busy."""
        model = self.catalog.get(name)
        if model is None:
            return None
        fits = []
        for w in self._candidates(name):
            if w.identity in tried:
                continue
            if all(self.room.fits(w, name, v) for v in model.versions):
                free = self.room.available(w)
                fits.append((free is not None and free < 0, len(w.inflight),
                             self.room.used(w), w.worker_id, w))
        return min(fits)[-1] if fits else None

    def _start(self, name: str, now: float, tried: set[bytes] | None = None) -> bool:
        cost_s = self.costs.predict(name)
        if self.guard.load_wait_s(now, cost_s) > 0:
            return False
        worker = self._choose(name, tried or set())
        if worker is None:
            return False
        model = self.catalog.models[name]
        since = self.wanted.pop(name, now)
        self.loads[name] = Load(worker.identity, now, since,
                                (tried or set()) | {worker.identity})
        self.assigned.setdefault(name, set()).add(worker.identity)
        self.guard.started(now, cost_s)
        self.metrics.loads.inc((name, "retry" if tried else "request"))
        # debug: a host that churns through its working set loads many a second, and
        # the metrics count them (the eviction that made room is logged by placement)
        logger.debug("model %s: loading on demand on worker %s (%d request(s) waiting)",
                    name, worker.worker_id, self.scheduler.depth(name))
        self._load_placed(worker, name)
        self.tenure.last_start_s = now   # after: its own eviction counts the turns before it
        for key in (ModelVersion(name, v) for v in model.versions):
            if key in worker.loading:   # sent: an earlier failure is not this load's
                self.pool.begin_load(worker, key)
        return True

    def settle(self, now: float) -> None:
        """Loads that ended (loaded, failed, or their worker lost), and waiting models
        whose load may start now or must give up."""
        for name, load in list(self.loads.items()):
            model = self.catalog.get(name)
            worker = self.pool.get(load.worker)
            if model is None:
                del self.loads[name]
            elif worker is None:
                self._failed(name, load, now, f"worker {load.worker.decode(errors='replace')} "
                             f"was lost while loading model {name!r} on demand",
                             p.ErrorCode.WORKER_LOST)
            elif all(worker.holds(name, v) for v in model.versions):
                self._done(name, load, worker, now)
            elif not any((name, v) in worker.loading for v in model.versions):
                error = next((e for k, e in worker.load_errors.items() if k.name == name),
                             "it was not loaded")
                if self.room.for_memory(error) and self.scheduler.depth(name):
                    self._wait_for_room(name, load, worker, error)
                    continue
                self._failed(name, load, now, f"loading model {name!r} on demand on worker "
                             f"{worker.worker_id} failed: {error}", p.ErrorCode.UNAVAILABLE)
        for name in [n for n in self.assigned if n not in self.catalog.models] \
                if self.assigned else ():   # every turn: a comprehension costs ~1 us here
            del self.assigned[name]   # removed: if it comes back, it is asked for anew
            self.evicted.pop(name, None)
            self.times.forget(name)
            self.costs.forget(name)
        if len(self.demand) > len(self.catalog.models):
            for name in self.demand.names() - self.catalog.models.keys():
                self.demand.forget(name)
        if self.wanted and (self.pool.changes != self._tried_at_changes
                            or now >= self._retry_at):
            self._retry(now)

    def _retry(self, now: float) -> None:
        """Start what may start of the models waiting for room, or give up on those that
        waited ``pending_s``."""
        # the most requests waiting first: a free slot serves the most it can
        for name, since in sorted(self.wanted.items(),
                                  key=lambda kv: (-self.scheduler.depth(kv[0]), kv[1])):
            if not self.scheduler.depth(name) or name not in self.catalog.models \
                    or self.pool.holders(name):
                del self.wanted[name]
            elif not self._start(name, now) and now - since >= self.opts.pending_s:
                del self.wanted[name]
                self._fail(name, p.ErrorCode.UNAVAILABLE, (
                    f"model {name!r} could not be loaded within {self.opts.pending_s:g} s: "
                    f"the models loaded are busy or were loaded too recently to evict; "
                    f"{NO_FIT}"), max(1.0, math.ceil(self._residency_s(name))))
        self._tried_at_changes = self.pool.changes
        self._retry_at = self._next_try(now) if self.wanted else math.inf

    def _done(self, name: str, load: Load, worker: WorkerState, now: float) -> None:
        del self.loads[name]
        took = now - load.started_s
        self.times.observe(name, took)
        # what the load cost the worker (it says; 0 from an older worker: the wait)
        cost_s = max((worker.load_s.get(ModelVersion(name, v), 0.0)
                      for v in self.catalog.models[name].versions), default=0.0) or took
        self.costs.observe(name, cost_s)
        self.guard.resident(worker.worker_id, name, now, self.costs.latest(name))
        self.evicted.pop(name, None)
        self.catalog.clear_failure(name)
        wait = self.metrics.load_wait.labels(name)
        for entry in self.scheduler.queued(name):
            wait.observe(now - entry.arrival_s)
        logger.debug("model %s: loaded on demand on worker %s in %.3f s", name,
                    worker.worker_id, took)

    def _wait_for_room(self, name: str, load: Load, worker: WorkerState, why: str) -> None:
        """Its footprint measured more than the room left while the others were busy: its
        requests wait for room as before it started (within ``pending_s`` of then)."""
        del self.loads[name]
        self.assigned.get(name, set()).discard(load.worker)
        self.catalog.clear_failure(name)   # for now only: not a failure to report
        self.wanted[name] = load.since_s
        self._tried_at_changes = -1   # tried again at once, elsewhere or here
        logger.info("model %s: waits for room on worker %s: %s", name, worker.worker_id, why)

    def _failed(self, name: str, load: Load, now: float, why: str,
                code: p.ErrorCode) -> None:
        del self.loads[name]
        self.assigned.get(name, set()).discard(load.worker)
        self.metrics.loads_failed.inc((name,))
        logger.error("%s", why)
        if self.scheduler.depth(name) and self._start(name, now, load.tried):
            return   # another worker takes it; the requests keep waiting
        self._fail(name, code, why, None)

    def adopt(self, worker: WorkerState) -> None:
        """A worker joins holding models (it outlived a broker restart): those on demand
        stay where they are, resident from now."""
        for name in sorted({m for m, _ in worker.loaded}):
            model = self.catalog.get(name)
            if model is not None and self.on(model.config):
                self.assigned.setdefault(name, set()).add(worker.identity)
                self.guard.resident(worker.worker_id, name, self.clock(),
                                    self.costs.predict(name))

    def worker_lost(self, worker: WorkerState) -> None:
        for ids in self.assigned.values():
            ids.discard(worker.identity)
        self.guard.gone(worker.worker_id)
        self.settle(self.clock())

    def next_due(self, now: float) -> float | None:
        # a load's end is settled as its LOADED arrives
        return self._retry_at if self.wanted else None

    def _next_try(self, now: float) -> float:
        """When the waiting models may start though the pool did not change, or must give
        up (``wanted`` is not empty)."""
        wait_s = min(self.guard.load_wait_s(now, self.costs.predict(n)) for n in self.wanted)
        if wait_s > 0:
            start = now + wait_s
        else:   # room may open when a residency or a waiting model's patience ends (a
            # queue that empties comes with a message, and every message ticks)
            ends = [t for t in (self.guard.next_evictable(now),
                                *(max(s, self.tenure.last_start_s) + self.tenure.patience_s(n)
                                  for n, s in self.wanted.items()))
                    if t is not None and t > now]
            start = min(ends, default=now + PENDING_POLL_S)
        return min(max(start, now + MIN_POLL_S), min(self.wanted.values()) + self.opts.pending_s)

    def _residency_s(self, name: str) -> float:
        return self.guard.residency_s(self.costs.latest(name))

    # -- telling ------------------------------------------------------------------------
    def state(self, name: str) -> tuple[str, str] | None:
        """(state, reason) of an on-demand model; None for any other."""
        model = self.catalog.get(name)
        if model is None or not self.on(model.config):
            return None
        if model.ready:
            return READY, ""
        if name in self.loads:
            return LOADING, "loading on demand"
        if name in self.evicted:
            return EVICTED, self.evicted[name] + "; loads again on the next request"
        why = self._never_fits(name)
        if why is not None:
            return TOO_BIG, never_fits(name, why)
        return AVAILABLE, "not loaded: loads on the first request"

    def describe(self, name: str) -> dict[str, Any]:
        """``zeroserve models``' part for one model."""
        got = self.state(name)
        if got is None:
            return {}
        out: dict[str, Any] = {"on_demand": True, "state": got[0].lower(),
                               "loadable": got[0] != TOO_BIG and bool(self._candidates(name)),
                               "predicted_load_s": round(self.times.predict(name), 4),
                               "load_cost_s": round(self.costs.predict(name), 4),
                               "demand_rps": round(self.demand.rate(name, self.clock()), 3),
                               "residency_s": round(self._residency_s(name), 3)}
        if got[1]:
            out["reason"] = got[1]
        return out

    def summary(self, now: float) -> dict[str, Any]:
        """``zeroserve status``' part."""
        return {"enabled": self.opts.enabled, "loading": sorted(self.loads),
                "waiting": sorted(self.wanted),
                "loads_last_minute": self.guard.loads_in_window(now),
                "load_s_last_minute": round(self.guard.load_s_in_window(now), 3),
                "max_load_s_per_minute": self.guard.budget_s,
                "max_load_share": self.opts.max_load_share,
                "min_residency_s": self.opts.min_residency_s,
                "residency_factor": self.opts.residency_factor}
