"""Memory placement: whether a model version fits on a worker's device, decided before
the worker is asked to load it, and checked again with what it measured.

Before a LOAD the broker looks up the version's footprint in the memory plan
(memplan.py: measured, else predicted from its files) and the room the worker's device
has (its free memory or budget, less the headroom and what is held or loading).

A version that does not fit evicts idle models on the worker (nothing queued or
running), the least wanted first (fewest recent requests, then least recently used),
when that makes room, else it is refused without loading: which models go is one pure
function of a snapshot of the worker (eviction.py), which this module builds and
applies, recording each eviction in load on demand's record (thrash.Tenure). The
refusal reaches the swap as a failed LOADED (the old version keeps serving) and names
the device and the bytes. After warm-up the worker's measurement replaces the
prediction; on a budget, a measured footprint that does not fit is evicted for or
refused as before.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import msgspec

from zeroserve.broker import protocol as p
from zeroserve.broker import wording
from zeroserve.broker.process import RateLimitedLog
from zeroserve.broker.server import eviction
from zeroserve.broker.server.catalog import Catalog
from zeroserve.broker.server.memplan import TRIAL, MemoryPlan, device_kind
from zeroserve.broker.server.metrics import BrokerMetrics
from zeroserve.broker.server.pool import WorkerPool, WorkerState
from zeroserve.broker.server.thrash import Tenure
from zeroserve.broker.server.types import Clock, ModelVersion
from zeroserve.models.footprint import size_text
from zeroserve.models.repository import ConfigError, ModelConfig, parse_config

logger = logging.getLogger(__name__)


class Placement:
    """Reads the catalog, the pool and the memory plan; asks ``queued(model)`` (requests
    waiting) and ``last_used(model)`` (when it last ran), and reads load on demand's
    record ``tenure`` (how wanted each model is, its residency, the waits) to build the
    snapshot eviction decides on; records there what it evicted."""

    def __init__(self, catalog: Catalog, pool: WorkerPool, plan: MemoryPlan,
                 metrics: BrokerMetrics, clock: Clock, *, queued: Callable[[str], int],
                 last_used: Callable[[str], float], tenure: Tenure | None = None) -> None:
        self.catalog = catalog
        self.pool = pool
        self.plan = plan
        self.metrics = metrics
        self.clock = clock
        self._queued = queued
        self._last_used = last_used
        self.tenure = tenure or Tenure()
        self.refused: list[tuple[WorkerState, p.ModelLoaded]] = []  # delivered by the tick
        # load on demand evicts for each turn, a hundred times a second on a host that
        # churns through its working set: the metric counts them all
        self._evictions_log = RateLimitedLog(logger, per_s=1.0)

    # -- the plan's numbers load on demand and the lifecycle read -------------------------
    def available(self, worker: WorkerState) -> int | None:
        return self.plan.available(worker)

    def used(self, worker: WorkerState) -> int:
        return self.plan.used(worker)

    def forget(self, key: tuple[bytes, str, int]) -> None:
        self.plan.forget(key)

    def worker_gone(self, identity: bytes) -> None:
        self.plan.worker_gone(identity)

    def retain(self, model: str, folder: Path, shas: Iterable[str]) -> None:
        self.plan.retain(model, folder, shas)

    def describe_model(self, name: str) -> dict[str, Any]:
        return self.plan.describe_model(name)

    # -- whether a version fits ----------------------------------------------------------
    def _need(self, worker: WorkerState, name: str, version: int) -> tuple[int, str] | None:
        model = self.catalog.get(name)
        if model is None:
            return None
        return self.plan.need(worker, name, version, model.config, model.path / str(version))

    def refusal(self, worker: WorkerState, name: str, version: int) -> str | None:
        """Why ``name/version`` does not fit on ``worker`` now (None: it fits, or is
        there already), from its measured footprint or else the prediction, against the
        device's free memory less its headroom. Evicts nothing."""
        if (name, version) in worker.loaded | worker.loading:
            return None
        got = self._need(worker, name, version)
        if got is None:
            return wording.unknown_model(name)
        return self._verdict(worker, name, version, *got, self.plan.available(worker))

    def too_big(self, worker: WorkerState, name: str, version: int) -> str | None:
        """Why ``name/version`` could not load on ``worker`` even with nothing else
        loaded there (None: it could, or it is there already). Evicts nothing; asked of
        the first request for a model not loaded, so the words are written only for a
        version that is too big."""
        if (name, version) in worker.loaded or (name, version) in worker.loading:
            return None
        got = self._need(worker, name, version)
        if got is None:
            return wording.unknown_model(name)
        need, how = got
        free = self.plan.available(worker)
        if free is None or need <= free:
            return None
        budget = self.plan.budget(worker)
        if budget:
            empty = budget - self.plan.budget_headroom(worker) - self.plan.context(worker)
        else:   # what is loading too: it is evictable once loaded
            empty = free + sum(self.plan.footprint(worker, m, v)
                               for m, v in self.plan.held(worker))
        if need <= empty:
            return None
        freed = eviction.freeable(self.snapshot(worker, name, need, free))
        return self._verdict(worker, name, version, need, how, free + freed)

    def fits(self, worker: WorkerState, name: str, version: int) -> bool:
        """Whether ``name/version`` can load on ``worker`` now, after evicting the idle
        models that may go (what :meth:`load` would do, evicting nothing). Load on demand
        asks it for every model waiting, of every worker, each time room may have
        opened, and mostly hears no: that answer writes no reasons."""
        if (name, version) in worker.loaded or (name, version) in worker.loading:
            return True
        got = self._need(worker, name, version)
        if got is None:
            return False
        free = self.plan.available(worker)
        if free is None or got[0] <= free:
            return True
        return eviction.choose(self.snapshot(worker, name, got[0], free)) is not None

    @staticmethod
    def for_memory(error: str) -> bool:
        """Whether a load's error is one of placement's refusals (what ``_verdict``
        writes), not the worker's."""
        return " free after " in error and " needs " in error

    def _verdict(self, worker: WorkerState, name: str, version: int, need: int, how: str,
                 free: int | None, busy: int = 0) -> str | None:
        if free is None or need <= free:
            return None
        why = (f"{self.plan.where(worker)} has {size_text(max(0, free))} free after "
               f"{size_text(self.plan.headroom(worker))} headroom; "
               f"{ModelVersion(name, version)} needs {size_text(need)} ({how})")
        budget = self.plan.budget(worker)
        room = budget - self.plan.budget_headroom(worker) - self.plan.context(worker)
        if budget and need > room:
            why += (f"; more than worker {worker.worker_id}'s memory budget of "
                    f"{size_text(budget)} leaves after its context"
                    f"{' and headroom' if device_kind(worker) == 'cpu' else ''}")
        elif busy:
            why += f"; {size_text(busy)} of it is held by models that are busy"
        return why

    # -- before a load -------------------------------------------------------------
    def load(self, worker: WorkerState, msg: p.LoadModel,
             cfg: ModelConfig | None = None) -> None:
        """Send a LOAD if the version fits (evicting idle models when that makes room);
        else refuse it: a failed LOADED, delivered by the next tick. ``cfg``: the config
        ``msg`` carries, already parsed (else it is parsed here)."""
        name, version = msg.model, msg.version
        if name.startswith(TRIAL):
            self.pool.load(worker, msg)
            return
        key = (worker.identity, name, version)
        if cfg is None:
            try:
                cfg = parse_config(msg.config, f"config of {name}")
            except (ConfigError, ValueError):
                self.pool.load(worker, msg)   # the worker says what is wrong with it
                return
        need, how = self.plan.need(worker, name, version, cfg, Path(msg.path), msg.sha256)
        free = self.plan.available(worker)   # a version reloaded in place is held twice a while
        if free is not None and need > free:
            snap = self.snapshot(worker, name, need, free)
            victims = eviction.choose(snap)
            if victims is None:
                why = self._verdict(worker, name, version, need, how,
                                    free + eviction.freeable(snap))
                assert why is not None   # nothing that may go frees enough
                self._refuse(worker, p.ModelLoaded(name, version, False, error=why))
                return
            self._evict(worker, name, victims, "room")
        self.plan.footprints[key] = need
        self.plan.measured.pop(key, None)   # this load's warm-up measures it afresh
        self.pool.load(worker, msg)

    def _refuse(self, worker: WorkerState, msg: p.ModelLoaded) -> None:
        logger.error("refusing %s/%d on %s: %s", msg.model, msg.version, worker.worker_id,
                     msg.error)
        self.catalog.fail(msg.model, msg.error, [msg.version])
        self.plan.refused(worker, msg.model)
        self.refused.append((worker, msg))

    def take_refused(self) -> list[tuple[WorkerState, p.ModelLoaded]]:
        out, self.refused = self.refused, []
        return [(w, m) for w, m in out if self.pool.get(w.identity) is w]

    # -- after a load ----------------------------------------------------------------
    def check(self, worker: WorkerState, msg: p.ModelLoaded) -> p.ModelLoaded:
        """Replace the prediction with what the worker measured; on a budget, refuse
        (turn into a failed load) what does not fit even so."""
        key = (worker.identity, msg.model, msg.version)
        if not msg.ok or msg.model.startswith(TRIAL):
            if not msg.ok:
                self.plan.footprints.pop(key, None)
            return msg
        need = self.plan.learn(worker, msg)
        budget = self.plan.budget(worker)
        free = self.plan.budget_room(worker, (msg.model, msg.version))
        if free is None or need <= free:
            return msg
        snap = self.snapshot(worker, msg.model, need, free)
        victims = eviction.choose(snap)
        if victims is not None:
            self._evict(worker, msg.model, victims, "measured")
            return msg
        freed = eviction.freeable(snap)
        why = self._verdict(worker, msg.model, msg.version, need, "measured", free + freed,
                            busy=max(0, budget - free - freed))
        logger.error("refusing %s/%d on %s: %s", msg.model, msg.version, worker.worker_id, why)
        assert why is not None   # nothing that may go frees enough
        self.catalog.fail(msg.model, why, [msg.version])
        self.plan.forget(key)
        self.pool.unload(worker, msg.model, msg.version)
        return msgspec.structs.replace(msg, ok=False, error=why)

    # -- eviction ----------------------------------------------------------------------
    def snapshot(self, worker: WorkerState, keep: str, need: int,
                 free: int | None) -> eviction.Snapshot:
        """The worker as eviction sees it now, for ``keep`` needing ``need`` bytes."""
        now, plan, tenure = self.clock(), self.plan, self.tenure
        busy = self.pool.busy_models(worker)
        held: dict[str, int] = {}   # loading versions too: the room counts them
        for m, v in plan.held(worker):
            if m != keep:
                held[m] = held.get(m, 0) + plan.footprint(worker, m, v)
        loaded = {m for m, _ in worker.loaded if m != keep}
        return eviction.Snapshot(
            keep=keep, need_bytes=need, free_bytes=free, now_s=now,
            keep_wanted=tenure.wanted_level(keep, now), wait=tenure.wait(keep),
            held=tuple(eviction.Held(
                model=m, bytes=held.get(m, 0),
                loaded_bytes=sum(plan.footprint(worker, m, v)
                                 for v in worker.versions_of(m)),
                idle=m in loaded and m not in busy and not self._queued(m),
                wanted=tenure.wanted_level(m, now), last_used_s=self._last_used(m),
                resident_until_s=tenure.resident_until(worker.worker_id, m))
                for m in sorted(held.keys() | loaded)))

    def _evict(self, worker: WorkerState, keep: str, victims: tuple[str, ...],
               reason: str) -> None:
        for model in victims:
            for version in sorted(worker.versions_of(model)):
                self.plan.forget((worker.identity, model, version))
                # idle, so unloaded now: its UNLOAD goes before the LOAD it makes room
                # for (never both held at once), and before any reload of it (a retired
                # version's late UNLOAD would unload the reload)
                self.pool.unload(worker, model, version)
            self.catalog.routable(self.pool.workers.values(), model)
            self.metrics.evictions.inc((model, reason))
            self.tenure.record_eviction(
                worker.identity, worker.worker_id, model,
                f"evicted from worker {worker.worker_id} at {time.strftime('%H:%M:%S')}: "
                "least wanted idle model, to make room" if reason == "room" else
                f"evicted from worker {worker.worker_id}: {reason}")
            self._evictions_log.log(logging.WARNING, "evicted %s from worker %s (the least "
                                    "wanted idle model) to make room for %s", model,
                                    worker.worker_id, keep)
