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
from typing import TYPE_CHECKING, Any

import zmq

from zeroserve.broker import protocol as p
from zeroserve.broker.catalog import CatalogModel
from zeroserve.broker.hasher import Hasher
from zeroserve.broker.membership import WorkerState
from zeroserve.broker.placement import Placement
from zeroserve.broker.registration import Registrar
from zeroserve.models.repository import ConfigError, ModelConfig, RepoModel, load_config, \
    scan, version_sha256
from zeroserve.models.watcher import ALL, RepoWatcher

if TYPE_CHECKING:
    from zeroserve.broker.server import Broker

logger = logging.getLogger(__name__)

# config fields that change what a worker loads; the others apply without a reload
_RELOAD_FIELDS = ("platform", "inputs", "outputs", "max_batch_size", "warmup")


@dataclass
class LifecycleOptions:
    watch: str = "inotify"           # or "poll" (NFS)
    debounce_s: float = 0.2
    poll_s: float = 2.0
    swap_timeout_s: float = 300.0
    import_roots: tuple[Path, ...] = ()


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
    def __init__(self, broker: "Broker", options: LifecycleOptions | None = None) -> None:
        self.b = broker
        self.opts = options or LifecycleOptions()
        self.root = broker.catalog.root
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
        self.last_used = self.placement.last_used   # the broker stamps it per batch
        self.registrar = Registrar(self)
        self.hooks: list[Any] = [self.registrar]   # trial loads: seen before swaps
        broker.control.verbs.update(self.registrar.verbs())

    # -- setup (Broker.bind / load_catalog / close) -----------------------------
    def prime(self) -> None:
        """At startup, before serving: the sha256 of every served version."""
        for name, model in self.b.catalog.models.items():
            self.shas[name] = {v: version_sha256(model.path / str(v)) for v in model.versions}

    def start(self, poller: zmq.Poller) -> None:
        self.registrar.clean_leftovers()
        self.watcher = RepoWatcher(self.root, self.opts.watch, self.opts.debounce_s,
                                   self.opts.poll_s, self.b.clock)
        self.hasher = Hasher(self.b.ctx)
        if self.watcher.inotify is not None:
            # zmq.Poller reports plain descriptors by number, whatever was registered
            poller.register(self.watcher.inotify.fileno(), zmq.POLLIN)
        poller.register(self.hasher.results, zmq.POLLIN)
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
        if (copy := self.registrar.next_due(self.b.clock())) is not None:
            due = copy if due is None else min(due, copy)
        return due

    def tick(self, now: float) -> None:
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
            found, errors = scan(self.root, skip)
        except ConfigError as exc:
            logger.error("%s", exc)
            return
        names = set(found) | set(errors) | set(self.b.catalog.models) if ALL in dirty \
            else dirty - {ALL}
        for folder in sorted(names):
            if folder in self.swaps:
                self.deferred.add(folder)   # picked up again when this swap ends
            elif folder in found:
                self._hash(found[folder])
            elif folder in errors:
                self._on_error(folder, errors[folder])
            elif folder in self.b.catalog.models:
                self.remove_model(folder, "its folder was removed")

    def reload(self, name: str, versions: list[int]) -> list[str]:
        """``zeroserve reload``: load these versions afresh on every worker placed for
        the model and swap them in (two phases, as for a change on disk), even when
        their files did not change or failed before. Returns the workers' ids."""
        found, errors = scan(self.root)
        if name not in found:
            raise LookupError(errors.get(name, f"model {name!r} is not in the repository"))
        self.failed = {f for f in self.failed if f[0] != name}
        self.forced.setdefault(name, set()).update(versions)
        placed = [w for w in self.b.members.workers.values()
                  if not w.draining and placed_on(found[name].config, w)]
        for w in placed:
            for v in versions:
                # seen as loading from now on, so a waiting operator sees the outcome
                w.loading.add((name, v))
                w.load_errors.pop(f"{name}/{v}", None)
        if name in self.swaps:
            self.deferred.add(name)
        else:
            self._hash(found[name])
        return [w.worker_id for w in placed]

    def _hash(self, rm: RepoModel) -> None:
        assert self.hasher is not None
        job = self.hasher.submit(rm.config.name, {v: rm.path / str(v) for v in rm.versions})
        self.pending[rm.config.name] = (rm, job)

    def _on_error(self, folder: str, error: str) -> None:
        path = self.root / folder
        writing = self.watcher is not None and any(
            path in w.parents for w in self.watcher.writing)
        if folder in self.b.catalog.models and not writing:
            try:
                load_config(path)
            except ConfigError:
                # a broken config.json: the old config keeps serving, the error shows
                self.b.catalog.errors[folder] = error
                logger.error("model %s: %s (the loaded versions keep serving)", folder, error)
                return
            self.remove_model(folder, "no version folder is left")
            return
        self.b.catalog.errors[folder] = error
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
            for w in self.b.members.workers.values():
                w.loading -= {(name, v) for v in forced}
            return
        shas = {int(v): str(s) for v, s in result["shas"].items()}
        cur = self.b.catalog.get(name)
        committed = self.shas.get(name, {})
        self.b.catalog.errors.pop(name, None)
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
        self._start_swap(Swap(rm, shas, changed, self.b.clock()))

    # -- the two phases -----------------------------------------------------
    def _start_swap(self, swap: Swap) -> None:
        cfg = swap.repo.config
        workers = [w for w in self.b.members.workers.values()
                   if not w.draining and placed_on(cfg, w)]
        if not swap.changed or not workers:
            self._commit(swap)
            return
        for w in workers:
            swap.workers.add(w.identity)
            for v in sorted(swap.changed):
                self._flush_retiring(w, cfg.name, v)
                w.loading.add((cfg.name, v))
                swap.waiting.add((w.identity, v))
                self.b._send(self.b.backend, w.identity, p.encode_simple(
                    p.Kind.LOAD, model=cfg.name, version=v, path=str(swap.repo.path / str(v)),
                    config=cfg.to_json(), sha256=swap.shas[v]))
        self.swaps[cfg.name] = swap
        logger.info("model %s: preparing version(s) %s on %d worker(s)", cfg.name,
                    sorted(swap.changed), len(workers))

    def on_loaded(self, worker: WorkerState, header: dict[str, Any]) -> bool:
        """A LOADED that belongs to a swap (or a hook); False: the broker's own path."""
        self.placement.on_loaded(worker, header)  # may turn it into a refused load
        for hook in self.hooks:
            if hook.on_loaded(worker, header):
                return True
        name, version = str(header["model"]), int(header["version"])
        swap = self.swaps.get(name)
        if swap is None or (worker.identity, version) not in swap.waiting:
            return False
        swap.waiting.discard((worker.identity, version))
        worker.loading.discard((name, version))
        key = f"{name}/{version}"
        if not header.get("ok"):
            worker.load_errors[key] = str(header.get("error"))
            self.b.metrics.model_loaded(name, False, 0.0)
            self._fail(swap, f"worker {worker.worker_id} failed to load {key}: "
                             f"{header.get('error')}")
            return True
        self.b.metrics.model_loaded(name, True, float(header.get("load_s", 0.0)))
        worker.load_errors.pop(key, None)
        if header.get("sha256") != swap.shas[version]:
            self._exclude(swap, worker, version, str(header.get("sha256")))
        else:
            worker.loaded.add((name, version))
            swap.loaded.add((worker.identity, version))
        self._maybe_finish(swap)
        return True

    def _exclude(self, swap: Swap, worker: WorkerState, version: int, sha: str) -> None:
        why = (f"sha256 {sha[:12]} differs from the repository's "
               f"{swap.shas[version][:12]}: kept out of the swap")
        logger.error("worker %s loaded %s/%d: %s", worker.worker_id, swap.name, version, why)
        worker.load_errors[f"{swap.name}/{version}"] = why
        swap.excluded.add(worker.identity)
        swap.workers.discard(worker.identity)
        swap.waiting = {(i, v) for i, v in swap.waiting if i != worker.identity}
        self.b._send(self.b.backend, worker.identity,
                     p.encode_simple(p.Kind.UNLOAD, model=swap.name, version=version))

    def _maybe_finish(self, swap: Swap) -> None:
        if swap.waiting or self.swaps.get(swap.name) is not swap:
            return
        if swap.workers:
            self._commit(swap)
        else:
            self._fail(swap, "no worker loaded the version with the repository's sha256")

    def _check_swaps(self, now: float) -> None:
        for swap in list(self.swaps.values()):
            gone = {i for i in swap.workers if i not in self.b.members.workers}
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
        b = self.b
        model = b.catalog.get(name)
        replaced = model is not None
        if model is None:
            model = b.catalog.models[name] = CatalogModel(rm.config, rm.path, rm.versions)
        else:
            model.config, model.path, model.versions = rm.config, rm.path, rm.versions
        b.scheduler.set_policy(name, model.policy())
        served = set(rm.versions)
        workers = list(b.members.workers.values())
        model.ready = {v for v in served if any(w.holds(name, v) for w in workers)}
        self.shas[name] = dict(swap.shas)
        self.failures.pop(name, None)
        b.catalog.errors.pop(name, None)
        gone: set[int] = set()
        for w in workers:
            for v in w.versions_of(name) - served:
                self._retire(w, name, v)
                gone.add(v)
        self._reroute(name, gone)
        for w in workers:
            if w.identity not in swap.excluded and w.identity not in swap.workers:
                b.sync_worker(w)   # joined meanwhile: loads what is now committed
        if replaced and swap.changed:
            b.metrics.swaps.labels(name).inc()
        logger.info("model %s now serves version(s) %s (prepared in %.3f s)", name,
                    sorted(served), b.clock() - swap.started_s)
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
        cur = self.b.catalog.get(name)
        served = set(cur.versions) if cur is not None else set()
        for identity, v in swap.loaded:
            w = self.b.members.workers.get(identity)
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
        worker.loaded.discard((name, version))
        self.retiring.append((worker.identity, name, version))

    def _flush_retiring(self, worker: WorkerState, name: str, version: int) -> None:
        key = (worker.identity, name, version)
        if key in self.retiring:  # loaded again before it went: unload first, in order
            self.retiring.remove(key)
            self.b._send(self.b.backend, worker.identity,
                         p.encode_simple(p.Kind.UNLOAD, model=name, version=version))

    def _retire_idle(self) -> None:
        busy = {(r.worker, r.model, r.version) for r in self.b.inflight.values()}
        keep = []
        for key in self.retiring:
            identity, name, version = key
            if key in busy:
                keep.append(key)
            elif identity in self.b.members.workers:
                self.placement.footprints.pop(key, None)
                self.b._send(self.b.backend, identity,
                             p.encode_simple(p.Kind.UNLOAD, model=name, version=version))
        self.retiring = keep

    def unload_now(self, worker: WorkerState, name: str, version: int) -> None:
        worker.loaded.discard((name, version))
        self.b._send(self.b.backend, worker.identity,
                     p.encode_simple(p.Kind.UNLOAD, model=name, version=version))

    def evict(self, worker: WorkerState, name: str, version: int) -> None:
        """Memory: an idle model leaves this worker; routable only where others hold it."""
        self._retire(worker, name, version)
        model = self.b.catalog.get(name)
        if model is not None:
            model.ready = {v for v in model.ready
                           if any(w.holds(name, v) for w in self.b.members.workers.values())}

    def _reroute(self, name: str, gone: set[int]) -> None:
        """Queued requests for versions that left: unpinned ones follow the new default,
        pinned ones get not found."""
        if not gone:
            return
        for entry in self.b.scheduler.queued(name):
            if entry.version not in gone:
                continue
            if getattr(entry.payload, "pinned", False):
                if self.b.scheduler.cancel(entry.key) is not None:
                    self.b._answer_error(entry, p.ErrorCode.NOT_FOUND,
                                         f"version {entry.version} of model {name!r} was "
                                         "retired")
            else:
                entry.version = None

    def remove_model(self, name: str, why: str) -> None:
        b = self.b
        if b.catalog.models.pop(name, None) is None:
            return
        for entry in b.scheduler.drop_model(name):
            b._answer_error(entry, p.ErrorCode.NOT_FOUND, f"model {name!r} was removed")
        for w in b.members.workers.values():
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
        return out
