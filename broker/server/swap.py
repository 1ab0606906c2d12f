"""Model lifecycle, run by the broker: watch the repository, key each version by the
sha256 of its files, and swap versions in two phases.

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
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import zmq

from zeroserve.broker import protocol as p
from zeroserve.broker import wording
from zeroserve.broker.server.catalog import Catalog, CatalogModel
from zeroserve.broker.server.hasher import Hasher
from zeroserve.broker.server.metrics import BrokerMetrics
from zeroserve.broker.server.placement import Placement
from zeroserve.broker.server.pool import WorkerPool, WorkerState
from zeroserve.broker.server.registration import Registrar
from zeroserve.broker.server.requests import RequestPath
from zeroserve.broker.server.scheduler import Scheduler
from zeroserve.models.repository import ConfigError, ModelConfig, RepoModel, load_config, \
    load_labels, scan, version_sha256
from zeroserve.models.watcher import ALL, RepoWatcher

logger = logging.getLogger(__name__)

Found = tuple[dict[str, RepoModel], dict[str, str]]

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
    pinned = cfg.instances.get("workers") or []
    return not pinned or worker.worker_id in pinned


class Lifecycle:
    """The catalog's one path to change: the watcher, SIGHUP, ``zeroserve reload`` and a
    worker joining all come here, and every change is a two-phase swap."""

    def __init__(self, catalog: Catalog, scheduler: Scheduler, pool: WorkerPool,
                 requests: RequestPath, metrics: BrokerMetrics, clock: Callable[[], float],
                 ctx: zmq.Context[Any], options: LifecycleOptions | None = None) -> None:
        self.catalog = catalog
        self.scheduler = scheduler
        self.pool = pool
        self.requests = requests
        self.metrics = metrics
        self.clock = clock
        self.ctx = ctx
        self.opts = options or LifecycleOptions()
        self.root = catalog.root
        self.watcher: RepoWatcher | None = None
        self.hasher: Hasher | None = None
        self.shas: dict[str, dict[int, str]] = {}
        self.swaps: dict[str, Swap] = {}
        self.pending: dict[str, tuple[RepoModel, int]] = {}   # hashing
        self.deferred: set[str] = set()     # changed again while a swap ran
        self.failures: dict[str, dict[str, Any]] = {}
        self.failed: set[tuple[str, int, str]] = set()
        self.forced: dict[str, set[int]] = {}   # operator reloads waiting for their hashes
        self.retiring: list[tuple[bytes, str, int]] = []
        self.placement = Placement(self)
        # which workers hold a model: pins (placed_on), and for autoscaled models the
        # replicas chosen (replicas.py sets this)
        self.placed: Callable[[ModelConfig, WorkerState], bool] = placed_on
        self.registrar = Registrar(self)
        # what a rescan sees of the repository: explicit model control filters it to the
        # models asked for and substitutes load overrides (see repoctl.py)
        self.source: Callable[[Found], Found] = lambda found: found
        self.published: Callable[[str], None] = self.rescan_one  # registration, no watcher

    def rescan_one(self, name: str) -> None:
        """A folder registration published or removed: the watcher sees the rename; with
        the watcher off (model control none or explicit) this is called instead."""
        if self.watcher is None:
            self.rescan({name})

    # -- setup (Broker.bind / load_catalog / close) -----------------------------
    def prime(self) -> None:
        """At startup, before serving: the sha256 of every served version."""
        for name, model in self.catalog.models.items():
            self.shas[name] = {v: version_sha256(model.path / str(v)) for v in model.versions}

    def start(self, poller: zmq.Poller) -> None:
        self.registrar.clean_leftovers()
        self.hasher = Hasher(self.ctx)
        poller.register(self.hasher.results, zmq.POLLIN)
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
        if self.hasher is not None and self.hasher.results in events:
            for result in self.hasher.receive():
                self._on_hashed(result)

    def next_due(self) -> float | None:
        due = self.watcher.next_due() if self.watcher is not None else None
        if self.swaps:
            first = min(s.started_s for s in self.swaps.values()) + self.opts.swap_timeout_s
            due = first if due is None else min(due, first)
        if (copy := self.registrar.next_due(self.clock())) is not None:
            due = copy if due is None else min(due, copy)
        if self.placement.refused:  # loads refused for memory: answered on the next tick
            due = self.clock()
        return due

    def tick(self, now: float) -> None:
        for worker, refused in self.placement.take_refused():
            self.on_loaded(worker, refused)
        if self.watcher is not None:
            dirty = self.watcher.take_due()
            if dirty:
                self.rescan(dirty)
        if self.swaps:
            self._check_swaps(now)
        if self.retiring:
            self._retire_idle()
        if self.registrar.jobs:
            self.registrar.tick()
            self.registrar.check_workers()

    # -- rescans ------------------------------------------------------------
    def rescan(self, dirty: set[str]) -> None:
        skip = self.watcher.is_writing if self.watcher is not None else None
        try:
            found, errors = self.source(scan(self.root, skip))
        except ConfigError as exc:
            logger.error("%s", exc)
            return
        names = set(found) | set(errors) | set(self.catalog.models) | set(self.failures) \
            if ALL in dirty \
            else dirty - {ALL}
        for folder in sorted(names):
            if folder in self.swaps:
                self.deferred.add(folder)   # picked up again when this swap ends
            elif folder in found:
                self._hash(found[folder])
            elif folder in errors:
                self._on_error(folder, errors[folder])
            else:  # gone (or, under explicit control, not asked for)
                self.remove_model(folder, "its folder was removed")

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
                "loads": [f"{w}:{name}/{v}" for w in workers for v in versions]}

    def reload_repository(self) -> None:
        """SIGHUP: rescan everything (hashed off the loop, swapped in two phases) and
        bring every worker in line with what is committed now."""
        self.rescan({ALL})
        for worker in list(self.pool.workers.values()):
            self.sync_worker(worker)

    def reload(self, name: str, versions: list[int]) -> list[str]:
        """``zeroserve reload``: load these versions afresh on every worker placed for
        the model and swap them in (two phases, as for a change on disk), even when
        their files did not change or failed before. Returns the workers' ids."""
        found, errors = self.source(scan(self.root))
        if name not in found:
            raise LookupError(errors.get(name, f"model {name!r} is not in the repository"))
        return self.load_now(found[name], versions)

    def load_now(self, rm: RepoModel, versions: list[int]) -> list[str]:
        """A fresh load of these versions of ``rm`` on every worker placed for it, swapped
        in two phases (``reload``, and the repository extension's load)."""
        name = rm.config.name
        self.failed = {f for f in self.failed if f[0] != name}
        self.forced.setdefault(name, set()).update(versions)
        placed = [w for w in self.pool.workers.values()
                  if not w.draining and self.placed(rm.config, w)]
        for w in placed:
            for v in versions:
                # seen as loading from now on, so a waiting operator sees the outcome
                w.loading.add((name, v))
                w.load_errors.pop(f"{name}/{v}", None)
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
                self.catalog.errors[folder] = error
                logger.error("model %s: %s (the loaded versions keep serving)", folder, error)
                return
            self.remove_model(folder, "no version folder is left")
            return
        self.catalog.errors[folder] = error
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
                w.loading -= {(name, v) for v in forced}
            return
        shas = {int(v): str(s) for v, s in result["shas"].items()}
        cur = self.catalog.get(name)
        committed = self.shas.get(name, {})
        self.catalog.errors.pop(name, None)
        if not forced and cur is not None and cur.config == rm.config \
                and cur.versions == rm.versions \
                and all(committed.get(v) == shas[v] for v in rm.versions):
            return  # the same content again: nothing to do
        reload_all = cur is not None and any(
            getattr(cur.config, f) != getattr(rm.config, f) for f in _RELOAD_FIELDS)
        changed = forced | {v for v in rm.versions
                            if reload_all or committed.get(v) != shas[v]}
        if any((name, v, shas[v]) in self.failed for v in changed):
            return  # this exact content failed already; its failure stays visible
        self._start_swap(Swap(rm, shas, changed, self.clock()))

    # -- the two phases -----------------------------------------------------
    def _start_swap(self, swap: Swap) -> None:
        cfg = swap.repo.config
        workers = [w for w in self.pool.workers.values()
                   if not w.draining and self.placed(cfg, w)]
        if not swap.changed or not workers:
            self._commit(swap)
            return
        for w in workers:
            swap.workers.add(w.identity)
            for v in sorted(swap.changed):
                self._flush_retiring(w, cfg.name, v)
                swap.waiting.add((w.identity, v))
                self.placement.load(w, p.LoadModel(cfg.name, v, str(swap.repo.path / str(v)),
                                                   cfg.to_json(), swap.shas[v]))
        self.swaps[cfg.name] = swap
        logger.info("model %s: preparing version(s) %s on %d worker(s)", cfg.name,
                    sorted(swap.changed), len(workers))

    def on_loaded(self, worker: WorkerState, msg: p.ModelLoaded) -> None:
        """A LOADED: a registration's trial, part of a swap, or a plain sync load."""
        msg = self.placement.check(worker, msg)  # may turn it into a refused load
        if self.registrar.on_loaded(worker, msg):
            return
        name, version = msg.model, msg.version
        swap = self.swaps.get(name)
        if swap is None or (worker.identity, version) not in swap.waiting:
            self._on_sync_loaded(worker, msg)
            return
        swap.waiting.discard((worker.identity, version))
        worker.loading.discard((name, version))
        key = f"{name}/{version}"
        if not msg.ok:
            worker.load_errors[key] = msg.error
            self.metrics.model_loaded(name, False, 0.0)
            self._fail(swap, f"worker {worker.worker_id} failed to load {key}: {msg.error}")
            return
        self.metrics.model_loaded(name, True, msg.load_s)
        worker.load_errors.pop(key, None)
        if msg.sha256 != swap.shas[version]:
            self._exclude(swap, worker, version, msg.sha256)
        else:
            worker.add_loaded(name, version)
            swap.loaded.add((worker.identity, version))
        self._maybe_finish(swap)

    def _on_sync_loaded(self, worker: WorkerState, msg: p.ModelLoaded) -> None:
        key = (msg.model, msg.version)
        worker.loading.discard(key)
        model = self.catalog.get(msg.model)
        if msg.ok:
            worker.add_loaded(*key)
            worker.load_errors.pop(f"{msg.model}/{msg.version}", None)
            self.metrics.model_loaded(msg.model, True, msg.load_s)
            if model is not None and msg.version in model.versions:
                model.ready.add(msg.version)
            else:
                self.pool.unload(worker, *key)
            logger.info("worker %s loaded %s/%d in %.2fs", worker.worker_id, msg.model,
                        msg.version, msg.load_s)
        else:
            worker.load_errors[f"{msg.model}/{msg.version}"] = msg.error
            self.metrics.model_loaded(msg.model, False, 0.0)
            logger.error("worker %s failed to load %s/%d: %s", worker.worker_id, msg.model,
                         msg.version, msg.error)

    def sync_worker(self, worker: WorkerState) -> None:
        """Tell a worker to load what it should serve and unload what it should not."""
        wanted = {(name, v) for name, m in self.catalog.models.items()
                  if self.placed(m.config, worker) for v in m.versions}
        for name, version in sorted(wanted - worker.loaded - worker.loading):
            model = self.catalog.models[name]
            self.placement.load(worker, p.LoadModel(
                name, version, str(model.path / str(version)), model.config.to_json(),
                self.shas.get(name, {}).get(version, "")))
        for name, version in sorted(worker.loaded - wanted):
            self.pool.unload(worker, name, version)
        for key in worker.loaded & wanted:
            self.catalog.models[key[0]].ready.add(key[1])

    def worker_removed(self) -> None:
        """A worker left: versions no live worker holds are no longer routable."""
        workers = self.pool.workers.values()
        for model in self.catalog.models.values():
            model.ready = {v for v in model.ready
                           if any(w.holds(model.config.name, v) for w in workers)}

    def _exclude(self, swap: Swap, worker: WorkerState, version: int, sha: str) -> None:
        why = (f"sha256 {sha[:12]} differs from the repository's "
               f"{swap.shas[version][:12]}: kept out of the swap")
        logger.error("worker %s loaded %s/%d: %s", worker.worker_id, swap.name, version, why)
        worker.load_errors[f"{swap.name}/{version}"] = why
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

    def _check_swaps(self, now: float) -> None:
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
            elif now - swap.started_s > self.opts.swap_timeout_s:
                self._fail(swap, f"workers did not load within {self.opts.swap_timeout_s:g} s")

    def _commit(self, swap: Swap) -> None:
        rm, name = swap.repo, swap.name
        self.swaps.pop(name, None)
        model = self.catalog.get(name)
        replaced = model is not None
        if model is None:
            model = self.catalog.models[name] = CatalogModel(rm.config, rm.path, rm.versions)
        else:
            model.config, model.path, model.versions = rm.config, rm.path, rm.versions
        model.labels = load_labels(rm.path)
        self.scheduler.set_policy(name, model.policy())
        served = set(rm.versions)
        workers = list(self.pool.workers.values())
        model.ready = {v for v in served if any(w.holds(name, v) for w in workers)}
        self.shas[name] = dict(swap.shas)
        self.failures.pop(name, None)
        self.catalog.errors.pop(name, None)
        gone: set[int] = set()
        for w in workers:
            for v in w.versions_of(name) - served:
                self._retire(w, name, v)
                gone.add(v)
        self.requests.reroute(name, gone)
        for w in workers:
            if w.identity not in swap.excluded and w.identity not in swap.workers:
                self.sync_worker(w)   # joined meanwhile: loads what is now committed
        if replaced and swap.changed:
            self.metrics.swaps.labels(name).inc()
        logger.info("model %s now serves version(s) %s (prepared in %.3f s)", name,
                    sorted(served), self.clock() - swap.started_s)
        self._after_swap(name)

    def _fail(self, swap: Swap, why: str, retry: bool = False) -> None:
        name = swap.name
        self.swaps.pop(name, None)
        self.failures[name] = {"error": why, "versions": sorted(swap.changed),
                               "time": time.time()}
        if retry and self.watcher is not None:
            self.watcher.dirty.add(name)  # rescanned after the debounce
        for v in swap.changed if not retry else ():
            self.failed.add((name, v, swap.shas[v]))
        cur = self.catalog.get(name)
        served = set(cur.versions) if cur is not None else set()
        for identity, v in swap.loaded:
            w = self.pool.workers.get(identity)
            if w is not None and v not in served:
                self._retire(w, name, v)
        logger.error("model %s: swap to version(s) %s failed; %s: %s", name,
                     sorted(swap.changed),
                     f"version(s) {sorted(served)} keep serving" if served else "not served",
                     why)
        self._after_swap(name)

    def _after_swap(self, name: str) -> None:
        if name in self.deferred:
            self.deferred.discard(name)
            self.rescan({name})

    # -- retiring -----------------------------------------------------------
    def _retire(self, worker: WorkerState, name: str, version: int) -> None:
        """No new batches from now; unloaded once its in-flight batches are done."""
        worker.discard_loaded(name, version)
        self.retiring.append((worker.identity, name, version))

    def _flush_retiring(self, worker: WorkerState, name: str, version: int) -> None:
        key = (worker.identity, name, version)
        if key in self.retiring:  # loaded again before it went: unload first, in order
            self.retiring.remove(key)
            self.pool.unload(worker, name, version)

    def _retire_idle(self) -> None:
        busy = self.pool.busy()
        keep = []
        for key in self.retiring:
            identity, name, version = key
            worker = self.pool.get(identity)
            if key in busy:
                keep.append(key)
            elif worker is not None:
                self.placement.forget(key)
                self.pool.unload(worker, name, version)
        self.retiring = keep

    def unload_now(self, worker: WorkerState, name: str, version: int) -> None:
        self.pool.unload(worker, name, version)

    def evict(self, worker: WorkerState, name: str, version: int) -> None:
        """Memory: an idle model leaves this worker; routable only where others hold it."""
        self._retire(worker, name, version)
        model = self.catalog.get(name)
        if model is not None:
            model.ready = {v for v in model.ready
                           if any(w.holds(name, v) for w in self.pool.workers.values())}

    def remove_model(self, name: str, why: str) -> None:
        # a folder that never loaded has no catalog entry, but its failure must go too
        self.failures.pop(name, None)
        self.pending.pop(name, None)
        self.catalog.errors.pop(name, None)
        if self.catalog.models.pop(name, None) is None:
            return
        self.requests.fail_queued(name, p.ErrorCode.NOT_FOUND, f"model {name!r} was removed")
        for w in self.pool.workers.values():
            for v in w.versions_of(name):
                self._retire(w, name, v)
        self.shas.pop(name, None)
        self.swaps.pop(name, None)
        self.failures.pop(name, None)
        logger.info("model %s removed: %s", name, why)

    # -- status -------------------------------------------------------------
    def describe(self, name: str) -> dict[str, Any]:
        out: dict[str, Any] = {"sha256": {str(v): s[:12] for v, s in
                                          sorted(self.shas.get(name, {}).items())}}
        swap = self.swaps.get(name)
        if swap is not None:
            out["swap"] = {"versions": sorted(swap.changed), "waiting": len(swap.waiting)}
        if name in self.failures:
            out["last_failure"] = self.failures[name]
        memory = self.placement.describe_model(name)
        if memory:
            out["memory"] = memory
        return out
