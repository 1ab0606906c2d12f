"""Which workers hold an autoscaled model: the controller's decisions (autoscale.py)
applied to the pool, in the broker's tick.

A model whose config gives ``instances.min``/``max`` (or ``count``) is held only by the
workers chosen for it here, its :class:`ReplicaSets` (whose ``placed`` is the placement
strategy the worker loads and the swaps read); every other model stays on every
eligible worker. Scaling up assigns one more worker, chosen among those that may hold
the model and that placement says have memory for it, and loads it there through the
worker loads (``sync_worker``: the LOADED answer makes it routable). Scaling down takes
one replica out of routing at once and unloads it when its in-flight batches are done
(``Catalog.evict``): nothing queued or running is lost, since the other replicas keep
the model.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any, Callable

from zeroserve.broker.server.autoscale import DOWN, HOLD, UP, Controller, Decision, \
    Sample, ScalePolicy
from zeroserve.broker.server.catalog import Catalog
from zeroserve.broker.server.metrics import BrokerMetrics
from zeroserve.broker.server.placement import Placement
from zeroserve.broker.server.pool import WorkerPool, WorkerState
from zeroserve.broker.server.scheduler import Scheduler
from zeroserve.broker.server.swap import Placed, placed_on
from zeroserve.broker.server.types import ModelVersion
from zeroserve.models.repository import ModelConfig

logger = logging.getLogger(__name__)

REFUSED_RETRY_S = 30.0      # a worker whose load failed is not asked again before this
HISTORY = 20                # decisions kept per model for ``zeroserve status``
_QUIET = {"steady", "warming_up", "loading", "no_worker"}   # holds logged at debug level only


def policy_of(cfg: ModelConfig) -> ScalePolicy | None:
    return ScalePolicy.of(cfg.instances, cfg.autoscaling)


def gpu_utilization(workers: list[WorkerState]) -> float | None:
    """The mean utilization the workers' drivers last reported (heartbeats), or None when
    none reports one."""
    seen = [w.memory["gpu"]["utilization"] for w in workers
            if (w.memory.get("gpu") or {}).get("utilization") is not None]
    return sum(seen) / len(seen) if seen else None


class ReplicaSets:
    """Which workers hold each autoscaled model (its replicas, in the order added):
    written by :class:`Replicas` as it scales, read as a placement strategy
    (:meth:`placed`) by the worker loads, which are built before the Replicas that asks
    them to load."""

    def __init__(self, default: Placed = placed_on) -> None:
        self.default = default   # the workers any model may go to: its pins
        self.assigned: dict[str, list[bytes]] = {}

    def placed(self, cfg: ModelConfig, worker: WorkerState) -> bool:
        """The placement strategy: pinned workers, and of those, for an autoscaled model,
        only its replicas."""
        if not self.default(cfg, worker):
            return False
        return policy_of(cfg) is None or worker.identity in self.assigned.get(cfg.name, ())


class Replicas:
    """Reads the catalog, the pool, the scheduler's queues and placement's memory plan;
    writes its ``sets``; asks ``predict(model)`` for a batch's run time (the latency
    model), ``swapping(model)`` whether a swap is placing it, ``failing(model)`` whether
    its circuit breaker is open or probing, and ``sync_worker(worker)`` to (un)load what
    a worker should hold."""

    def __init__(self, catalog: Catalog, pool: WorkerPool, scheduler: Scheduler,
                 placement: Placement, metrics: BrokerMetrics, sets: ReplicaSets, *,
                 predict: Callable[[str], Callable[[float], float]],
                 swapping: Callable[[str], bool],
                 sync_worker: Callable[[WorkerState], None],
                 failing: Callable[[str], bool] = lambda model: False,
                 sample_s: float = 0.05, step_s: float = 0.5) -> None:
        self.catalog = catalog
        self.pool = pool
        self.scheduler = scheduler
        self.placement = placement
        self.metrics = metrics
        self._predict = predict
        self._swapping = swapping
        self._sync_worker = sync_worker
        self._failing = failing
        self.sample_s = sample_s
        self.step_s = step_s
        self.controller = Controller()
        self.assigned = sets.assigned   # per model, in the order added
        self.refused: dict[tuple[bytes, str], float] = {}
        self.last: dict[str, Decision] = {}
        self.history: dict[str, deque[dict[str, Any]]] = {}
        self._next_sample = 0.0
        self._next_step = 0.0
        self._default_placed = sets.default

    # -- the broker's calls ---------------------------------------------------
    def adopt(self, worker: WorkerState) -> None:
        """A worker (re)joins holding autoscaled models (it outlived a broker restart):
        it keeps them as replicas while the model's max allows, instead of unloading.
        Any joiner brings the next step forward: a model under its min gets it now."""
        self._next_sample = self._next_step = 0.0
        for name in sorted({m for m, _ in worker.loaded}):
            model = self.catalog.get(name)
            pol = policy_of(model.config) if model is not None else None
            if pol is None or model is None or not self._default_placed(model.config, worker):
                continue
            ids = self.assigned.setdefault(name, [])
            if worker.identity not in ids and (not pol.max_replicas
                                               or len(ids) < pol.max_replicas):
                ids.append(worker.identity)

    def arrived(self, model: object) -> None:
        if isinstance(model, str):
            self.controller.arrived(model)

    def next_due(self) -> float | None:
        return min(self._next_sample, self._next_step) if self.controller.models() else None

    def tick(self, now: float) -> None:
        if now < self._next_sample:
            return
        self._next_sample = now + self.sample_s
        step = now >= self._next_step
        if step:
            self._next_step = now + self.step_s
            self._sync_policies(now)
        for name in self.controller.models():
            self.controller.observe(name, now, self._sample(name, now))
        if step:
            for name in self.controller.models():
                self._step(name, now)

    # -- signals --------------------------------------------------------------
    def _workers(self, name: str) -> list[WorkerState]:
        found = (self.pool.get(i) for i in self.assigned.get(name, ()))
        return [w for w in found if w is not None and not w.draining]

    def serving(self, name: str) -> list[WorkerState]:
        return [w for w in self._workers(name) if w.holds(name)]

    def loading(self, name: str) -> list[WorkerState]:
        return [w for w in self._workers(name)
                if not w.holds(name) and any(m == name for m, _ in w.loading)]

    def _sample(self, name: str, now: float) -> Sample:
        oldest = self.scheduler.oldest_arrival(name)
        serving = self.serving(name)
        busy = sum(1 for w in serving if name in self.pool.busy_models(w))
        return Sample(now - oldest if oldest is not None else 0.0,
                      self.scheduler.depth(name), busy, len(serving), self._capacity(name),
                      gpu_utilization(serving), self._failing(name))

    def _capacity(self, name: str) -> float:
        """One replica's requests/s at full batches, by the broker's latency model (0
        until it has one). Requests, not samples: the arrival rate counts requests."""
        model = self.catalog.models.get(name)
        if model is None:
            return 0.0
        cap = max(model.config.max_batch_size, 1)
        run_s = self._predict(name)(cap)
        return cap / run_s if run_s > 0 else 0.0

    # -- policies ---------------------------------------------------------------
    def _sync_policies(self, now: float) -> None:
        catalog = self.catalog
        for name, model in catalog.models.items():
            pol = policy_of(model.config)
            known = self.controller.policy(name) is not None
            if pol is None:
                if known:  # no longer autoscaled: every eligible worker holds it again
                    self._forget(name)
                    for w in list(self.pool.workers.values()):
                        self._sync_worker(w)
                continue
            if not known:  # newly autoscaled: those holding it now are its replicas
                ids = self.assigned.setdefault(name, [])
                ids.extend(w.identity for w in self.pool.holders(name)
                           if w.identity not in ids)
                logger.info("model %s autoscaled: %d to %s replica(s), %d now", name,
                            pol.min_replicas, pol.max_replicas or "every worker", len(ids))
            self.controller.set_policy(name, pol, now)
        for name in self.controller.models():
            if name not in catalog.models:
                self._forget(name)

    def _forget(self, name: str) -> None:
        self.controller.forget(name)
        self.assigned.pop(name, None)
        self.last.pop(name, None)
        self.history.pop(name, None)
        for gauge in (self.metrics.replicas, self.metrics.scale_queue,
                      self.metrics.scale_utilization):
            try:
                gauge.remove(name)
            except KeyError:
                pass  # never set: the model left before its first step

    def _prune(self, name: str, now: float) -> None:
        """Replicas whose worker left are gone; one whose load failed (placement
        refused it, or the load raised) is given up and that worker skipped a while."""
        ids = self.assigned.get(name, [])
        model = self.catalog.models[name]
        for identity in list(ids):
            w = self.pool.get(identity)
            if w is None:
                ids.remove(identity)
                continue
            if w.holds(name) or any(m == name for m, _ in w.loading):
                continue
            errors = [w.load_errors[k] for k in (ModelVersion(name, v) for v in model.versions)
                      if k in w.load_errors]
            if errors:
                ids.remove(identity)
                self.refused[(identity, name)] = now + REFUSED_RETRY_S
                self._record(name, now, Decision(HOLD, "load_failed", len(self.serving(name)),
                                                 self.controller.signals(name, now),
                                                 f"{w.worker_id}: {errors[0]}"), [w])
            elif not w.draining:
                self._sync_worker(w)   # assigned but neither holding nor loading it

    # -- one step ---------------------------------------------------------------
    def _step(self, name: str, now: float) -> None:
        if self._swapping(name) or name not in self.catalog.models:
            return  # a swap places versions itself; decide when it is over
        self._prune(name, now)
        for _ in range(len(self.pool.workers) + 1):  # below min: as many as it takes
            dec = self.controller.decide(name, now, len(self.serving(name)),
                                         len(self.loading(name)),
                                         lambda: self._room(name, now)[1])
            changed = [w for w in (self._scale_up(name, now) if dec.action == UP
                                   else self._scale_down(name) if dec.action == DOWN
                                   else None for _ in range(dec.count)) if w is not None]
            self.controller.applied(name, now, dec.action if changed else HOLD)
            self._record(name, now, dec, changed)
            if dec.reason != "below_min" or not changed:
                break
        self.metrics.replicas.labels(name).set(len(self.serving(name)))
        sig = self.last[name].signals
        self.metrics.scale_queue.labels(name).set(sig.queue_s)
        self.metrics.scale_utilization.labels(name).set(sig.utilization)

    def _room(self, name: str, now: float
              ) -> tuple[WorkerState | None, tuple[str, str] | None]:
        """The worker to take one more replica, or why none can."""
        model = self.catalog.models[name]
        taken = set(self.assigned.get(name, ()))
        candidates = [w for w in self.pool.workers.values()
                      if not w.draining and w.identity not in taken
                      and self._default_placed(model.config, w)
                      and self.refused.get((w.identity, name), 0.0) <= now]
        if not candidates:
            return None, ("no_worker", "no other worker may hold it")
        fits, why = [], []
        for w in candidates:
            refusals = [r for v in model.versions
                        if (r := self.placement.refusal(w, name, v)) is not None]
            if refusals:
                why.append(refusals[0])
            else:
                fits.append(w)
        if not fits:
            more = f" (and {len(why) - 2} more)" if len(why) > 2 else ""
            return None, ("no_memory", "; ".join(why[:2]) + more)
        place = self.placement
        return min(fits, key=lambda w: (len(w.loaded), place.used(w), len(w.inflight))), None

    def _scale_up(self, name: str, now: float) -> WorkerState | None:
        worker, _ = self._room(name, now)
        if worker is None:
            return None
        self.assigned.setdefault(name, []).append(worker.identity)
        self._sync_worker(worker)   # LOAD now; routable when its LOADED arrives
        return worker

    def _scale_down(self, name: str) -> WorkerState | None:
        ids = self.assigned.get(name, [])
        serving = self.serving(name)
        if len(serving) <= 1:
            return None
        busy = {w.identity: sum(1 for b in w.inflight if (rec := self.pool.inflight.get(b))
                                and rec.model == name) for w in serving}
        # the least busy; among equals the newest, so long-lived replicas stay warm
        victim = min(serving, key=lambda w: (busy[w.identity], -ids.index(w.identity)))
        ids.remove(victim.identity)
        for version in sorted(victim.versions_of(name)):
            # out of routing now, unloaded when idle
            self.pool.retire(victim, ModelVersion(name, version))
        self.catalog.routable(self.pool.workers.values(), name)
        return victim

    # -- telling ----------------------------------------------------------------
    def _record(self, name: str, now: float, dec: Decision,
                workers: list[WorkerState]) -> None:
        prev = self.last.get(name)
        self.last[name] = dec
        if dec.action == HOLD and prev is not None and prev.action == HOLD \
                and prev.reason == dec.reason:
            return  # the same hold again: decided once, logged and counted once
        self.metrics.autoscale_decision(name, dec.action, dec.reason)
        where = ", ".join(w.worker_id for w in workers)
        self.history.setdefault(name, deque(maxlen=HISTORY)).append(
            {"time": time.time(), "action": dec.action, "reason": dec.reason,
             "replicas": dec.replicas, "changed": len(workers), "worker": where,
             "detail": dec.detail,
             "signals": dec.signals.brief()})
        if dec.action != HOLD:
            logger.info("model %s: scale %s to %d replica(s) (%s) %s %s: %s", name,
                        dec.action, dec.replicas + len(workers) * (1 if dec.action == UP
                                                                   else -1),
                        dec.reason, "on" if dec.action == UP else "off", where or "-",
                        dec.signals.brief())
        elif dec.reason not in _QUIET:
            logger.log(logging.WARNING if dec.reason in ("no_memory", "load_failed")
                       else logging.INFO, "model %s: holds at %d replica(s) (%s)%s: %s",
                       name, dec.replicas, dec.reason,
                       f" {dec.detail}" if dec.detail else "", dec.signals.brief())
        else:
            logger.debug("model %s: %s at %d replica(s)", name, dec.reason, dec.replicas)

    def describe(self) -> dict[str, Any]:
        """Per autoscaled model, for ``zeroserve status``."""
        out: dict[str, Any] = {}
        for name in sorted(self.controller.models()):
            pol = self.controller.policy(name)
            assert pol is not None
            last = self.last.get(name)
            out[name] = {
                "min": pol.min_replicas, "max": pol.max_replicas or None,
                "replicas": sorted(w.worker_id for w in self.serving(name)),
                "loading": sorted(w.worker_id for w in self.loading(name)),
                "last": None if last is None else {
                    "action": last.action, "reason": last.reason, "detail": last.detail,
                    "signals": last.signals.brief()},
                "decisions": list(self.history.get(name, ())),
            }
        return out
