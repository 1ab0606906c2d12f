"""The loads that bring each worker in line with what is committed: what a worker should
hold (``placed``: pins, the replicas autoscaling chose, or load on demand's placement)
loaded and the rest unloaded; a failed load retried with backoff when its reason may
pass (loadretry.py), one worker at a time per content. The lifecycle's swaps load
through the same placement; a swap in progress is handed in where it decides."""

from __future__ import annotations

import logging
from typing import Callable

from zeroserve.broker import protocol as p
from zeroserve.broker.server.catalog import Catalog
from zeroserve.broker.server.loadretry import LoadRetries
from zeroserve.broker.server.metrics import BrokerMetrics
from zeroserve.broker.server.placement import Placement
from zeroserve.broker.server.pool import WorkerPool, WorkerState
from zeroserve.broker.server.swap import Placed, Swaps, placed_on
from zeroserve.broker.server.types import ModelVersion
from zeroserve.models.repository import ModelConfig

logger = logging.getLogger(__name__)


class WorkerLoads:
    def __init__(self, catalog: Catalog, pool: WorkerPool, placement: Placement,
                 retries: LoadRetries, metrics: BrokerMetrics, clock: Callable[[], float], *,
                 placed: Placed = placed_on,
                 turn: Callable[[str], bool] = lambda name: False) -> None:
        self.catalog = catalog
        self.pool = pool
        self.placement = placement
        self.retries = retries
        self.metrics = metrics
        self.clock = clock
        self.placed = placed
        self.turn = turn   # whether a model's load is load on demand's: logged at debug

    def placed_on(self, cfg: ModelConfig) -> list[WorkerState]:
        """The live workers placed for a model (those a reload loads it on)."""
        return [w for w in self.pool.workers.values() if not w.draining and self.placed(cfg, w)]

    def retry_due(self, now: float, swaps: Swaps) -> None:
        """Retries come due: sent where still wanted."""
        if self.retries:
            for worker_id, load in self.retries.take_due(now):
                self._retry_load(worker_id, load, swaps)

    def loaded(self, worker: WorkerState, msg: p.ModelLoaded) -> None:
        """A plain sync load's LOADED (neither a registration's trial nor a swap's)."""
        key = ModelVersion(msg.model, msg.version)
        if msg.ok:
            self.pool.loaded(worker, key, msg.load_s)
            self.metrics.model_loaded(msg.model, True, msg.load_s)
            if not self.catalog.mark_ready(*key):
                self.pool.unload(worker, *key)
            # a turn of load on demand loads many a second (the metrics count them, and
            # the worker says at info what it read from disk)
            logger.log(logging.DEBUG if self.turn(msg.model) else logging.INFO,
                       "worker %s loaded %s/%d in %.2fs", worker.worker_id, msg.model,
                       msg.version, msg.load_s)
        else:
            load = self.message(msg.model, msg.version)
            # load on demand asks again on the next request: no retry of its own
            retry = None if load is None or self.turn(msg.model) else self.retries.failed(
                worker.worker_id, load, msg.error, msg.transient, self.clock())
            self.pool.failed(worker, key, msg.error if retry is None
                             else f"{msg.error} ({retry})")
            for worker_id in self.retries.given_up():   # parked behind it: never sent
                parked = self.pool.by_id(worker_id)
                if parked is not None:
                    self.pool.failed(parked, key, msg.error)
            self.metrics.model_loaded(msg.model, False, 0.0)
            logger.log(logging.ERROR if retry is None else logging.WARNING,
                       "worker %s failed to load %s/%d: %s%s", worker.worker_id, msg.model,
                       msg.version, msg.error, f" ({retry})" if retry else "")


    def sync_worker(self, worker: WorkerState) -> None:
        """Tell a worker to load what it should serve and unload what it should not."""
        wanted = {(name, v) for name, m in self.catalog.models.items()
                  if self.placed(m.config, worker) for v in m.versions}
        for name, version in sorted(wanted - worker.loaded - worker.loading):
            self._load(worker, name, version)
        for name, version in sorted(worker.loaded - wanted):
            self.pool.unload(worker, name, version)
        for key in worker.loaded & wanted:
            self.catalog.mark_ready(*key)

    def load_placed(self, worker: WorkerState, name: str) -> None:
        """What :meth:`sync_worker` does for one model placed on ``worker`` anew: load
        its versions the worker neither holds nor loads, without walking the catalog (load
        on demand places a model on every turn, on hosts of hundreds of models)."""
        model = self.catalog.models.get(name)
        if model is None or not self.placed(model.config, worker):
            return
        for version in model.versions:
            key = ModelVersion(name, version)
            if key not in worker.loaded and key not in worker.loading:
                self._load(worker, name, version)

    def _load(self, worker: WorkerState, name: str, version: int) -> None:
        load = self.message(name, version)
        assert load is not None
        if not self.retries.park(worker.worker_id, load):   # else sent when its turn comes
            self.placement.load(worker, load, self.catalog.models[name].config)

    def message(self, name: str, version: int) -> p.LoadModel | None:
        """The LOAD of a version the catalog serves; None for any other (a swap's version
        whose failure came after the swap failed is not retried as a sync load)."""
        model = self.catalog.models.get(name)
        if model is None or version not in model.versions:
            return None
        return p.LoadModel(name, version, str(model.path / str(version)), model.config_json(),
                           self.catalog.shas.get(name, {}).get(version, ""))

    def _retry_load(self, worker_id: str, load: p.LoadModel, swaps: Swaps) -> None:
        """A retry come due: sent where it is still wanted (its swap waits for it, or the
        catalog still serves that content on that worker), else given up."""
        worker = self.pool.by_id(worker_id)
        model = self.catalog.models.get(load.model)
        if worker is None:
            self.retries.worker_left(worker_id)
        elif load.model in swaps:
            if swaps.waits_for(worker, load):
                self.placement.load(worker, load)
                return
        elif model is not None and load.version in model.versions \
                and self.catalog.shas.get(load.model, {}).get(load.version) == load.sha256 \
                and self.placed(model.config, worker) \
                and not worker.holds(load.model, load.version):
            self.placement.load(worker, load, model.config)
            return
        self.retries.skip(worker_id, load)

    def release(self, msg: p.ModelLoaded, swaps: Swaps) -> None:
        """A load succeeded: loads parked behind its content go now."""
        for worker_id, load in self.retries.succeeded(msg.model, msg.version, msg.sha256):
            worker = self.pool.by_id(worker_id)
            if worker is not None and (load.model not in swaps
                                       or swaps.waits_for(worker, load)):
                self.placement.load(worker, load)

    def worker_left(self, worker_id: str) -> None:
        self.retries.worker_left(worker_id)
        self.catalog.routable(self.pool.workers.values())
