"""The two-phase swap of a model's versions, run by the lifecycle (lifecycle.py).

Prepare: every worker that serves the model loads and warms up the new versions
while the old ones keep serving (a loaded but uncommitted version is never routed:
routing follows ``CatalogModel.versions`` and ``ready``). Commit: once all of them
report LOADED with the repository's sha256, the catalog flips in one step; the old
versions leave the workers' routable sets at once, and each is unloaded when its
in-flight batches are done. Any failure means no flip: the old versions keep
serving and the failure shows in ``zeroserve models``, the metrics and the log.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from zeroserve.broker import protocol as p
from zeroserve.broker.server.catalog import Catalog
from zeroserve.broker.server.loadretry import LoadRetries
from zeroserve.broker.server.metrics import BrokerMetrics
from zeroserve.broker.server.pool import WorkerPool, WorkerState
from zeroserve.broker.server.types import ModelVersion
from zeroserve.models.repository import ModelConfig, RepoModel

logger = logging.getLogger(__name__)

Placed = Callable[[ModelConfig, WorkerState], bool]


@dataclass
class Swap:
    repo: RepoModel
    shas: dict[int, str]
    changed: set[int]
    started_s: float
    workers: set[bytes] = field(default_factory=set)        # still in the swap
    waiting: set[tuple[bytes, int]] = field(default_factory=set)
    loaded: set[tuple[bytes, int]] = field(default_factory=set)
    excluded: set[bytes] = field(default_factory=set)       # sha256 mismatch

    @property
    def name(self) -> str:
        return self.repo.config.name


def placed_on(cfg: ModelConfig, worker: WorkerState) -> bool:
    """The default placement: a model's pinned workers, or every worker."""
    pinned = cfg.instances.get("workers") or []
    return not pinned or worker.worker_id in pinned


class Swaps:
    """The swaps in progress, one per model at most. What it asks of others comes in as
    callbacks: ``load`` (placement's LOAD), ``placed`` (which workers hold a model),
    ``committed(name, gone_versions, swap)`` and ``ended(name)`` (the lifecycle's
    follow-ups), ``retry(name)`` (rescan after the debounce). A load that fails for a
    reason that may pass is parked in ``retries`` and the swap waits for it."""

    def __init__(self, catalog: Catalog, pool: WorkerPool, metrics: BrokerMetrics,
                 clock: Callable[[], float], *, load: Callable[[WorkerState, p.LoadModel], None],
                 placed: Placed, committed: Callable[[str, set[int], Swap], None],
                 ended: Callable[[str], None], retry: Callable[[str], None],
                 retries: LoadRetries, timeout_s: float = 300.0) -> None:
        self.catalog = catalog
        self.pool = pool
        self.metrics = metrics
        self.clock = clock
        self._load = load
        self._placed = placed
        self._committed = committed
        self._ended = ended
        self._retry = retry
        self.retries = retries
        self.timeout_s = timeout_s
        self.swaps: dict[str, Swap] = {}

    def __contains__(self, name: object) -> bool:
        return name in self.swaps

    def __bool__(self) -> bool:
        return bool(self.swaps)

    def next_due(self) -> float | None:
        if not self.swaps:
            return None
        return min(s.started_s for s in self.swaps.values()) + self.timeout_s

    def cancel(self, name: str) -> None:
        self.swaps.pop(name, None)

    # -- prepare --------------------------------------------------------------
    def start(self, swap: Swap) -> None:
        cfg = swap.repo.config
        workers = [w for w in self.pool.workers.values()
                   if not w.draining and self._placed(cfg, w)]
        if not swap.changed or not workers:
            self._commit(swap)
            return
        for w in workers:
            swap.workers.add(w.identity)
            for v in sorted(swap.changed):
                if self.pool.unretire(w, ModelVersion(cfg.name, v)):
                    self.pool.unload(w, cfg.name, v)   # loaded again before it went
                swap.waiting.add((w.identity, v))
                load = self.message(swap, v)
                if not self.retries.park(w.worker_id, load):
                    self._load(w, load)
        self.swaps[cfg.name] = swap
        logger.info("model %s: preparing version(s) %s on %d worker(s)", cfg.name,
                    sorted(swap.changed), len(workers))

    def on_loaded(self, worker: WorkerState, msg: p.ModelLoaded) -> bool:
        """A LOADED that is part of a swap (True), or not (False)."""
        name, version = msg.model, msg.version
        swap = self.swaps.get(name)
        if swap is None or (worker.identity, version) not in swap.waiting:
            return False
        swap.waiting.discard((worker.identity, version))
        key = ModelVersion(name, version)
        if not msg.ok:
            self.metrics.model_loaded(name, False, 0.0)
            retry = self.retries.failed(worker.worker_id, self.message(swap, version),
                                        msg.error, msg.transient, self.clock())
            if retry is not None:   # the swap waits for the retry's answer
                swap.waiting.add((worker.identity, version))
                self.pool.failed(worker, key, f"{msg.error} ({retry})")
                logger.warning("worker %s failed to load %s: %s (%s)", worker.worker_id, key,
                               msg.error, retry)
                return True
            self.pool.failed(worker, key, msg.error)
            self.retries.given_up()   # the loads parked behind it fail with the swap
            spent = f" (the last of {self.retries.policy.attempts} attempts)" \
                if msg.transient else ""
            self._fail(swap, f"worker {worker.worker_id} failed to load {key}: "
                             f"{msg.error}{spent}")
            return True
        self.metrics.model_loaded(name, True, msg.load_s)
        if msg.sha256 != swap.shas[version]:
            self._exclude(swap, worker, version, msg.sha256)
        else:
            self.pool.loaded(worker, key, msg.load_s)
            swap.loaded.add((worker.identity, version))
        self._maybe_finish(swap)
        return True

    @staticmethod
    def message(swap: Swap, version: int) -> p.LoadModel:
        cfg = swap.repo.config
        return p.LoadModel(cfg.name, version, str(swap.repo.path / str(version)),
                           cfg.to_json(), swap.shas[version])

    def waits_for(self, worker: WorkerState, load: p.LoadModel) -> bool:
        """Whether a swap still waits for this worker's load of this content (a retry
        that comes due after its swap ended is not sent)."""
        swap = self.swaps.get(load.model)
        return swap is not None and (worker.identity, load.version) in swap.waiting \
            and swap.shas.get(load.version) == load.sha256

    def _exclude(self, swap: Swap, worker: WorkerState, version: int, sha: str) -> None:
        why = (f"sha256 {sha[:12]} differs from the repository's "
               f"{swap.shas[version][:12]}: kept out of the swap")
        logger.error("worker %s loaded %s/%d: %s", worker.worker_id, swap.name, version, why)
        self.pool.failed(worker, ModelVersion(swap.name, version), why)
        swap.excluded.add(worker.identity)
        swap.workers.discard(worker.identity)
        swap.waiting = {(i, v) for i, v in swap.waiting if i != worker.identity}
        self.pool.unload(worker, swap.name, version)

    def _maybe_finish(self, swap: Swap) -> None:
        if swap.waiting or self.swaps.get(swap.name) is not swap:
            return
        if swap.workers:
            self._commit(swap)
        else:
            self._fail(swap, "no worker loaded the version with the repository's sha256")

    def check(self, now: float) -> None:
        for swap in list(self.swaps.values()):
            gone = {i for i in swap.workers if i not in self.pool.workers}
            if gone:  # a worker that left cannot answer; the others decide
                swap.workers -= gone
                swap.waiting = {(i, v) for i, v in swap.waiting if i not in gone}
                if not swap.workers:
                    self._fail(swap, "every worker preparing it left; trying again",
                               retry=True)
                else:
                    self._maybe_finish(swap)
            elif now - swap.started_s > self.timeout_s:
                self._fail(swap, f"workers did not load within {self.timeout_s:g} s")

    # -- commit or fail ---------------------------------------------------------
    def _commit(self, swap: Swap) -> None:
        rm, name = swap.repo, swap.name
        self.swaps.pop(name, None)
        served = set(rm.versions)
        workers = list(self.pool.workers.values())
        _, replaced = self.catalog.commit(
            rm, swap.shas, {v for v in served if any(w.holds(name, v) for w in workers)},
            self.clock())
        gone: set[int] = set()
        for w in workers:
            for v in w.versions_of(name) - served:
                self.pool.retire(w, ModelVersion(name, v))
                gone.add(v)
        if replaced and swap.changed:
            self.metrics.swaps.labels(name).inc()
        self.metrics.swap_failures.labels(name)
        self._committed(name, gone, swap)
        logger.info("model %s now serves version(s) %s (prepared in %.3f s)", name,
                    sorted(served), self.clock() - swap.started_s)
        self._ended(name)

    def _fail(self, swap: Swap, why: str, retry: bool = False) -> None:
        name = swap.name
        self.swaps.pop(name, None)
        self.retries.forget(name)
        self.catalog.fail(name, why, swap.changed, None if retry else swap.shas)
        if retry:
            self._retry(name)
        else:
            self.metrics.swap_failures.labels(name).inc()
        cur = self.catalog.get(name)
        served = set(cur.versions) if cur is not None else set()
        for identity, v in swap.loaded:
            w = self.pool.workers.get(identity)
            if w is not None and v not in served:
                self.pool.retire(w, ModelVersion(name, v))
        logger.error("model %s: swap to version(s) %s failed; %s: %s", name,
                     sorted(swap.changed),
                     f"version(s) {sorted(served)} keep serving" if served else "not served",
                     why)
        self._ended(name)

    def describe(self, name: str) -> dict[str, Any]:
        swap = self.swaps.get(name)
        if swap is None:
            return {}
        return {"swap": {"versions": sorted(swap.changed), "waiting": len(swap.waiting)}}
