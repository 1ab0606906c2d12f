"""Memory placement: each worker may have a budget (``--memory-budget``). Workers
report what each loaded version cost, measured after load; when a new version would
take a worker past its budget, the least recently used idle models on it are
evicted first, and a version that cannot fit even so is refused with a message that
says so (its load counts as failed: in a swap, the old version keeps serving)."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

from zeroserve.broker import protocol as p
from zeroserve.broker.server.pool import WorkerState

if TYPE_CHECKING:
    from zeroserve.broker.server.swap import Lifecycle

logger = logging.getLogger(__name__)


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


class Placement:
    def __init__(self, lifecycle: "Lifecycle") -> None:
        self.lc = lifecycle
        self.footprints: dict[tuple[bytes, str, int], int] = {}

    @staticmethod
    def budget(worker: WorkerState) -> int:
        value = worker.info.get("memory_budget_bytes", 0)
        return value if isinstance(value, int) and value > 0 else 0

    def used(self, worker: WorkerState) -> int:
        return sum(self.footprints.get((worker.identity, m, v), 0) for m, v in worker.loaded)

    def check(self, worker: WorkerState, msg: p.ModelLoaded) -> p.ModelLoaded:
        """Record a footprint; refuse (turn into a failed load) what cannot fit."""
        if not msg.ok:
            return msg
        name, version = msg.model, msg.version
        if name.startswith(".trial-"):
            return msg  # a registration's trial: unloaded at once
        need = msg.memory_bytes
        self.footprints[(worker.identity, name, version)] = need
        budget = self.budget(worker)
        if not budget:
            return msg
        used = self.used(worker) - self.footprints.get((worker.identity, name, version), 0) \
            * ((name, version) in worker.loaded)
        if used + need <= budget:
            return msg
        idle = self._idle(worker, name)
        evictable = sum(self._cost(worker, m) for m in idle)
        if need <= budget and used - evictable + need <= budget:
            self._evict(worker, name, idle, used + need - budget)
            return msg
        why = (f"{name}/{version} needs {_mb(need)} but worker {worker.worker_id} has a "
               f"memory budget of {_mb(budget)} with {_mb(used - evictable)} in use by models "
               "that are busy; it does not fit")
        if need > budget:
            why = (f"{name}/{version} needs {_mb(need)}, more than worker "
                   f"{worker.worker_id}'s whole memory budget of {_mb(budget)}")
        logger.error("refusing %s/%d on %s: %s", name, version, worker.worker_id, why)
        self.lc.failures[name] = {"error": why, "versions": [version], "time": time.time()}
        self.footprints.pop((worker.identity, name, version), None)
        self.lc.unload_now(worker, name, version)
        return dataclasses.replace(msg, ok=False, error=why)

    def _cost(self, worker: WorkerState, model: str) -> int:
        return sum(self.footprints.get((worker.identity, model, v), 0)
                   for v in worker.versions_of(model))

    def _idle(self, worker: WorkerState, keep: str) -> list[str]:
        """Models on the worker with nothing queued or running, least recently used first."""
        busy = self.lc.pool.busy_models(worker)
        return sorted({m for m, _ in worker.loaded if m != keep and m not in busy
                       and not self.lc.scheduler.depth(m)},
                      key=self.lc.requests.last_used)

    def _evict(self, worker: WorkerState, keep: str, idle: list[str], needed: int) -> None:
        freed = 0
        for model in idle:
            if freed >= needed:
                break
            freed += self._cost(worker, model)
            for version in sorted(worker.versions_of(model)):
                self.footprints.pop((worker.identity, model, version), None)
                self.lc.evict(worker, model, version)
            logger.warning("evicted %s from worker %s (least recently used idle model) to "
                           "make room for %s", model, worker.worker_id, keep)

    # minimal version for the autoscaler; memplan's branch replaces it with the
    # predicted footprint and per-device headroom (keep this signature)
    def refusal(self, worker: WorkerState, name: str, version: int) -> str | None:
        """Whether ``name/version`` would fit on ``worker`` now: None if it fits, else a
        message naming the device and how much it lacks. The need is the footprint last
        measured on any worker (0 before the first load: it is let through)."""
        budget = self.budget(worker)
        if not budget or worker.holds(name, version):
            return None
        need = max((n for (_, m, v), n in self.footprints.items()
                    if m == name and v == version), default=0)
        free = budget - self.used(worker)
        if need <= free:
            return None
        device = worker.info.get("device") or "cpu"
        return (f"{name}/{version} needs {_mb(need)} but worker {worker.worker_id} "
                f"({device}) has {_mb(max(free, 0))} of its {_mb(budget)} budget free: "
                f"{_mb(need - max(free, 0))} short")
