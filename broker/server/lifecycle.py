"""Model lifecycle, run by the broker: watch the repository, key each version by the
sha256 of its files (hashed off the loop, hasher.py), and bring every change in
through a two-phase swap (swap.py).

The watcher, SIGHUP, ``zeroserve reload`` and the repository extension's load all come
here. The state they change is the catalog's (catalog.py), changed only by its verbs;
what each worker should hold, and its loads, are the worker loads' (loads.py, which a
worker joining asks directly), and what a rescan sees of the
repository is what each of ``sources`` lets through in turn (explicit model control
filters it, a rollout's retired versions leave it). A folder the broker publishes
itself (a registration, a config written over the API) comes through the outbox
:class:`Rescans` when no watcher sees it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import zmq

from zeroserve.broker import protocol as p
from zeroserve.broker import wording
from zeroserve.broker.server.answering import Answering
from zeroserve.broker.server.breaker import Breakers
from zeroserve.broker.server.cachepath import CachedAnswers
from zeroserve.broker.server.catalog import Catalog
from zeroserve.broker.server.hasher import Hasher
from zeroserve.broker.server.loadretry import LoadRetries, RetryPolicy
from zeroserve.broker.server.loads import WorkerLoads
from zeroserve.broker.server.metrics import BrokerMetrics
from zeroserve.broker.server.placement import Placement
from zeroserve.broker.server.pool import WorkerPool, WorkerState
from zeroserve.broker.server.registration import Registrar
from zeroserve.broker.server.releases import Releases
from zeroserve.broker.server.scheduler import Scheduler
from zeroserve.broker.server.stats import ModelStatistics
from zeroserve.broker.server.swap import Swap, Swaps
from zeroserve.broker.server.types import ModelVersion, earliest
from zeroserve.models.repository import ConfigError, RepoModel, load_config, scan, \
    version_sha256
from zeroserve.models.watcher import ALL, RepoWatcher

logger = logging.getLogger(__name__)

Found = tuple[dict[str, RepoModel], dict[str, str]]
Source = Callable[[Found], Found]

# config fields that change what a worker loads; the others apply without a reload
_RELOAD_FIELDS = ("platform", "inputs", "outputs", "max_batch_size", "warmup")


@dataclass
class LifecycleOptions:
    watch: str = "inotify"           # or "poll" (NFS)
    debounce_s: float = 0.2
    poll_s: float = 2.0
    swap_timeout_s: float = 300.0
    import_roots: tuple[Path, ...] = ()
    control_mode: str = "poll"       # Triton's --model-control-mode: none, poll, explicit
    load_models: tuple[str, ...] = ()   # explicit: what to load at start
    load_retry: RetryPolicy = RetryPolicy()   # loads that failed for a reason that may pass


class Rescans:
    """The folders the broker itself published into the repository or removed from it (a
    registration, an unregister, a configure), for the lifecycle to look at again: an
    outbox, written by a part built before the lifecycle (repoctl.ModelControl, for the
    registrar, which the lifecycle drives), drained at the end of the lifecycle's tick.
    Every write comes in a turn of the loop that ends with that tick (a verb, a LOADED,
    the registrar's own tick), so nothing waits for a later turn and it adds no due
    time. A watched repository needs none: the watcher sees the rename."""

    def __init__(self) -> None:
        self._names: set[str] = set()

    def add(self, name: str) -> None:
        self._names.add(name)

    def take(self) -> set[str]:
        names, self._names = self._names, set()
        return names

    def __bool__(self) -> bool:
        return bool(self._names)


class Lifecycle:
    """The coordinator: rescans, hashes and worker joins become swaps or sync loads."""

    def __init__(self, catalog: Catalog, scheduler: Scheduler, pool: WorkerPool,
                 answering: Answering, answers: CachedAnswers, breakers: Breakers,
                 releases: Releases, metrics: BrokerMetrics, clock: Callable[[], float],
                 ctx: zmq.Context[Any], placement: Placement, registrar: Registrar,
                 loads: WorkerLoads, retries: LoadRetries, *, stats: ModelStatistics,
                 rescans: Rescans, options: LifecycleOptions | None = None,
                 sources: Sequence[Source] = ()) -> None:
        self.catalog = catalog
        self.scheduler = scheduler
        self.pool = pool
        self.answering = answering   # a change's queued requests: rerouted or failed
        self.answers = answers       # the response cache: a retired version's go
        self.breakers = breakers     # a new build starts with a closed breaker
        self.releases = releases     # a new build may start a rollout
        self.metrics = metrics
        self.stats = stats           # a retired version's figures go
        self.clock = clock
        self.ctx = ctx
        self.opts = options or LifecycleOptions()
        self.root = catalog.root
        self.placement = placement
        self.registrar = registrar
        self.loads = loads       # what each worker should hold: loaded, retried
        self.retries = retries
        self.sources = tuple(sources)
        self.rescans = rescans   # folders the broker published or removed
        self.watcher: RepoWatcher | None = None
        self.hasher: Hasher | None = None
        self.pending: dict[str, tuple[RepoModel, int]] = {}   # hashing
        self.deferred: set[str] = set()     # changed again while a swap ran
        self.forced: dict[str, set[int]] = {}   # operator reloads waiting for their hashes
        self.swaps = Swaps(catalog, pool, metrics, clock, load=placement.load,
                           placed=loads.placed,
                           committed=self._committed, ended=self._after_swap,
                           retry=self._retry, retries=self.retries,
                           timeout_s=self.opts.swap_timeout_s)

    def swapping(self, name: str) -> bool:
        """Whether a swap is placing ``name`` now (autoscaling waits for it)."""
        return name in self.swaps

    def busy(self, name: str) -> bool:
        """Whether a change of ``name`` is on its way (hashing, swapping or deferred)."""
        return name in self.pending or name in self.swaps or name in self.deferred

    # -- setup (Broker.bind / load_catalog / close) -----------------------------
    def prime(self) -> None:
        """At startup, before serving: the sha256 of every served version."""
        self.catalog.prime(version_sha256)
        for name in self.catalog.models:   # 0, not absent, until a swap fails
            self.metrics.swap_failures.labels(name)

    def start(self, poller: zmq.Poller) -> None:
        self.registrar.clean_leftovers()
        self.hasher = Hasher(self.ctx)
        self.hasher.register(poller)
        if self.opts.control_mode != "poll":  # none, explicit: the repository is not watched
            logger.info("model control %s: %s is not watched", self.opts.control_mode,
                        self.root)
            return
        self.watcher = RepoWatcher(self.root, self.opts.watch, self.opts.debounce_s,
                                   self.opts.poll_s, self.clock)
        if self.watcher.inotify is not None:
            # zmq.Poller reports plain descriptors by number, whatever was registered
            poller.register(self.watcher.inotify.fileno(), zmq.POLLIN)
        logger.info("watching %s (%s)", self.root, self.opts.watch)

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.close()
        if self.hasher is not None:
            self.hasher.close()

    # -- the loop's calls ---------------------------------------------------
    def on_events(self, events: dict[Any, int]) -> None:
        if self.watcher is not None and self.watcher.fileno() in events:
            self.watcher.read()
        if self.hasher is not None and self.hasher.ready(events):
            for result in self.hasher.receive():
                self._on_hashed(result)

    def next_due(self) -> float | None:
        # asked every turn: the registrar (and its clock) only while it has jobs
        dues = [self.watcher.next_due() if self.watcher is not None else None,
                self.swaps.next_due(),
                self.registrar.next_due(self.clock()) if self.registrar.jobs else None,
                self.retries.next_due()]
        if self.placement.refused:  # loads refused for memory: answered on the next tick
            dues.append(self.clock())
        return earliest(dues)

    def tick(self, now: float) -> None:
        if self.placement.refused:   # every turn, almost always none
            for worker, refused in self.placement.take_refused():
                self.on_loaded(worker, refused)
        if self.watcher is not None:
            dirty = self.watcher.take_due()
            if dirty:
                self.rescan(dirty)
        if self.swaps:
            self.swaps.check(now)
        self.loads.retry_due(now, self.swaps)
        if self.pool.retiring:
            for holder, key in self.pool.take_idle():
                self.placement.forget((holder.identity, *key))
                self.pool.unload(holder, *key)
        if self.registrar.jobs:
            self.registrar.tick()
            self.registrar.check_workers()
        if self.rescans:   # last: what the registrar published just now is seen now
            published = self.rescans.take()
            if self.watcher is None:   # else the watcher sees the renames
                self.rescan(published)

    # -- rescans ------------------------------------------------------------
    def rescan(self, dirty: set[str]) -> None:
        skip = self.watcher.is_writing if self.watcher is not None else None
        try:
            found, errors = self._source(scan(self.root, skip))
        except ConfigError as exc:
            logger.error("%s", exc)
            return
        names = set(found) | set(errors) | set(self.catalog.models) \
            | set(self.catalog.failures) if ALL in dirty else dirty - {ALL}
        names |= self._ensembles_of(names, found)
        for folder in sorted(names):
            if folder in self.swaps:
                self.deferred.add(folder)   # picked up again when this swap ends
            elif folder in found:
                self._hash(found[folder])
            elif folder in errors:
                self._on_error(folder, errors[folder])
            else:  # gone (or, under explicit control, not asked for)
                self.remove_model(folder, "its folder was removed")

    def _source(self, found: Found) -> Found:
        for source in self.sources:
            found = source(found)
        return found

    def _ensembles_of(self, names: set[str], found: dict[str, RepoModel]) -> set[str]:
        """The ensembles to look at again with ``names``: those served whose steps name
        one of them (a step's model changed or left), and those the scan finds valid (a
        step's model came back)."""
        served = {n for n, m in self.catalog.models.items()
                  if any(s.model_name in names for s in m.config.ensemble)}
        return served | {n for n, rm in found.items() if rm.config.ensemble}

    def reload_model(self, name: str, version: int | None) -> dict[str, Any]:
        """``zeroserve reload MODEL[/V]``: a fresh load of the version(s) on every worker
        placed for the model, swapped in two phases once all are ready; the old load
        keeps serving until then, and keeps serving if any load fails."""
        model = self.catalog.get(name)
        if model is None:
            raise LookupError(wording.unknown_model(name))
        if version is not None and version not in model.versions:
            raise LookupError(wording.unknown_version(name, version))
        versions = [version] if version is not None else list(model.versions)
        workers = self.reload(name, versions)
        return {"model": name, "versions": versions,
                "loads": [f"{w}:{ModelVersion(name, v)}" for w in workers for v in versions]}

    def reload_repository(self) -> None:
        """SIGHUP: rescan everything (hashed off the loop, swapped in two phases) and
        bring every worker in line with what is committed now."""
        self.rescan({ALL})
        for worker in list(self.pool.workers.values()):
            self.loads.sync_worker(worker)

    def reload(self, name: str, versions: list[int]) -> list[str]:
        """``zeroserve reload``: load these versions afresh on every worker placed for
        the model and swap them in (two phases, as for a change on disk), even when
        their files did not change or failed before. Returns the workers' ids."""
        found, errors = self._source(scan(self.root))
        if name not in found:
            raise LookupError(errors.get(name, f"model {name!r} is not in the repository"))
        return self.load_now(found[name], versions)

    def load_now(self, rm: RepoModel, versions: list[int]) -> list[str]:
        """A fresh load of these versions of ``rm`` on every worker placed for it, swapped
        in two phases (``reload``, and the repository extension's load)."""
        name = rm.config.name
        self.catalog.retry(name)
        self.retries.forget(name)   # an operator's load starts the count afresh
        self.forced.setdefault(name, set()).update(versions)
        placed = self.loads.placed_on(rm.config)
        for w in placed:
            for v in versions:
                self.pool.begin_load(w, ModelVersion(name, v))
        if name in self.swaps:
            self.deferred.add(name)
        else:
            self._hash(rm)
        return [w.worker_id for w in placed]

    def _hash(self, rm: RepoModel) -> None:
        assert self.hasher is not None
        job = self.hasher.submit(rm.config.name, {v: rm.path / str(v) for v in rm.versions})
        self.pending[rm.config.name] = (rm, job)

    def _on_error(self, folder: str, error: str) -> None:
        path = self.root / folder
        writing = self.watcher is not None and any(
            path in w.parents for w in self.watcher.writing)
        if folder in self.catalog.models and not writing:
            try:
                load_config(path)
            except ConfigError:
                # a broken config.json: the old config keeps serving, the error shows
                self.catalog.set_error(folder, error)
                logger.error("model %s: %s (the loaded versions keep serving)", folder, error)
                return
            if self.catalog.models[folder].config.ensemble:   # its steps no longer fit
                self.remove_model(folder, error)
                self.catalog.set_error(folder, error)
                return
            self.remove_model(folder, "no version folder is left")
            return
        self.catalog.set_error(folder, error)
        logger.warning("model folder %s not served: %s", folder, error)

    def _on_hashed(self, result: dict[str, Any]) -> None:
        name = str(result["model"])
        entry = self.pending.get(name)
        if entry is None or entry[1] != result["job"]:
            return  # superseded by a later rescan
        del self.pending[name]
        rm = entry[0]
        forced = self.forced.pop(name, set()) & set(rm.versions)
        if result["errors"]:
            logger.info("model %s changed while hashing; waiting for the next event", name)
            for w in self.pool.workers.values():
                for v in forced:
                    self.pool.end_load(w, ModelVersion(name, v))
            return
        shas = {int(v): str(s) for v, s in result["shas"].items()}
        cur = self.catalog.get(name)
        committed = self.catalog.shas.get(name, {})
        self.catalog.clear_error(name)
        if not forced and cur is not None and cur.config == rm.config \
                and cur.versions == rm.versions \
                and all(committed.get(v) == shas[v] for v in rm.versions):
            self.catalog.reread_provenance(name)   # the same builds: only that may change
            return
        reload_all = cur is not None and any(
            getattr(cur.config, f) != getattr(rm.config, f) for f in _RELOAD_FIELDS)
        changed = forced | {v for v in rm.versions
                            if reload_all or committed.get(v) != shas[v]}
        if any(self.catalog.failed_before(name, v, shas[v]) for v in changed):
            return  # this exact content failed already; its failure stays visible
        self.swaps.start(Swap(rm, shas, changed, self.clock()))

    # -- the swap's follow-ups --------------------------------------------------
    def _committed(self, name: str, gone: set[int], swap: Swap) -> None:
        model = self.catalog.models[name]
        self.scheduler.set_policy(name, model.policy())
        self.answering.reroute(name, gone)
        self.answers.retain(name)   # a retired version's answers hold no memory
        self.stats.retain(name, model.versions)     # nor its figures, nor its series
        self.metrics.retain_versions(name, model.versions)
        self.placement.retain(name, model.path, self.catalog.shas.get(name, {}).values())
        if swap.changed:   # a new build: what the old one failed is moot
            self.breakers.reset(name)
        self.releases.committed(name, swap.changed)   # a new build may start a rollout
        for w in list(self.pool.workers.values()):
            if w.identity not in swap.excluded and w.identity not in swap.workers:
                self.loads.sync_worker(w)   # joined meanwhile: loads what is now committed

    def _after_swap(self, name: str) -> None:
        if name in self.deferred:
            self.deferred.discard(name)
            self.rescan({name})

    def _retry(self, name: str) -> None:
        if self.watcher is not None:
            self.watcher.dirty.add(name)  # rescanned after the debounce

    # -- workers ----------------------------------------------------------------
    def on_loaded(self, worker: WorkerState, msg: p.ModelLoaded) -> None:
        """A LOADED: a registration's trial, part of a swap, or a plain sync load."""
        msg = self.placement.check(worker, msg)  # may turn it into a refused load
        if msg.ok:
            self.loads.release(msg, self.swaps)
        if self.registrar.on_loaded(worker, msg) or self.swaps.on_loaded(worker, msg):
            return
        self.loads.loaded(worker, msg)

    def worker_removed(self, worker_id: str, identity: bytes) -> None:
        """A worker left: versions no live worker holds are no longer routable; loads it
        would retry go to the next worker; its memory plan goes."""
        self.loads.worker_left(worker_id)
        self.placement.worker_gone(identity)

    def remove_model(self, name: str, why: str) -> None:
        # a folder that never loaded has no catalog entry, but its failure must go too
        self.pending.pop(name, None)
        self.retries.forget(name)
        if not self.catalog.remove(name):
            return
        self.swaps.cancel(name)
        self.answers.retain(name)
        self.breakers.reset(name)
        self.answering.fail_queued(name, p.ErrorCode.NOT_FOUND, f"model {name!r} was removed")
        for w in self.pool.workers.values():
            for v in w.versions_of(name):
                self.pool.retire(w, ModelVersion(name, v))
        logger.info("model %s removed: %s", name, why)

    # -- status -------------------------------------------------------------
    def describe(self, name: str) -> dict[str, Any]:
        out = {**self.catalog.status(name), **self.swaps.describe(name),
               **self.retries.describe(name, self.clock())}
        memory = self.placement.describe_model(name)
        if memory:
            out["memory"] = memory
        return out
