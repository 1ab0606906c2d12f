"""The worker's loader thread: it loads and warms up versions, so the old version keeps
serving while a new one loads, and sends each answer to the broker itself (under load on
demand a host churns through loads, and each hop between threads was a wake-up on every
one of them). It is the one writer of the worker's versions (workers/loaded.py) and of
the host-memory tier (workers/hostcache.py)."""

from __future__ import annotations

import functools
import gc
import logging
import queue
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch
from prometheus_client import CollectorRegistry, Gauge

from zeroserve.broker import protocol as p
from zeroserve.models import handlers
from zeroserve.models.loader import LoadError, LoadedModel, load, transient
from zeroserve.models.repository import parse_config
from zeroserve.workers import bls, discovery, memory
from zeroserve.workers.channel import BrokerChannel
from zeroserve.workers.hostcache import HostCache, files_stamp
from zeroserve.workers.loaded import Key, LoadedModels
from zeroserve.workers.memory import rss_bytes

logger = logging.getLogger(__name__)

_STOP = object()


class Stopping:
    """Whether the worker is going away: set by a signal handler (the main thread) or by
    the loader on a leak, read by both. A plain flag, no lock: a handler may run between
    any two bytecodes, and one that interrupted another inside a lock would deadlock."""

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set


class Loader:
    """``forget(key)`` drops the compute thread's timing of a version whose files may
    now run differently; ``stopping`` is the worker's flag: set, unloads drop rather than
    park, and a leak found after an unload sets it with ``recycle_reason``. ``context``
    is the device's context cost the report sends: the loader is its one writer after
    start, adding a format's runtime when it loads one (memory.load_runtime)."""

    def __init__(self, models: LoadedModels, device: str, registry: CollectorRegistry, *,
                 stopping: Stopping, forget: Callable[[Key], None],
                 memory_tolerance_bytes: int, host_cache_bytes: int,
                 models_client: bls.ModelsClient | None,
                 context: dict[str, Any] | None = None) -> None:
        self.models = models
        self.context = context if context is not None else {}
        self.device = device
        self.stopping = stopping
        self._forget = forget
        self.memory_tolerance_bytes = memory_tolerance_bytes
        self.host_cache = HostCache(host_cache_bytes, device)   # loader thread only
        self.models_client = models_client
        self.recycle_reason = ""
        self._load_seq = 0
        self._loads: queue.Queue[Any] = queue.Queue()
        self.m_model_memory = Gauge("zeroserve_model_memory_bytes",
                                    "Memory a loaded version cost, measured after load",
                                    ["model", "version"], registry=registry)
        self.m_host_cache = Gauge("zeroserve_worker_host_cache_bytes",
                                  "Memory of the versions parked in host memory "
                                  "(--host-cache-bytes)", registry=registry)

    # -- the thread ---------------------------------------------------------------
    def put(self, msg: p.LoadModel | p.UnloadModel) -> None:
        """From whichever thread read it: a LOAD or UNLOAD, done in the order put."""
        self._loads.put(msg)

    @property
    def pending(self) -> int:
        """Loads and unloads put and not done (each LOADED is sent before its load counts
        as done)."""
        return self._loads.unfinished_tasks

    def start(self, channel: BrokerChannel) -> threading.Thread:
        thread = threading.Thread(target=self._loop, args=(channel,), name="loader",
                                  daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        self._loads.put(_STOP)

    def _loop(self, channel: BrokerChannel) -> None:
        while (job := self._loads.get()) is not _STOP:
            if isinstance(job, p.UnloadModel):
                self.unload_version(job.model, job.version)
            else:   # straight to the broker: a relay through the main thread cost a wake-up
                channel.send(p.encode(self.load_version(job)))
            self._loads.task_done()

    # -- loading ------------------------------------------------------------------
    def load_version(self, msg: p.LoadModel) -> p.ModelLoaded:
        name, version = msg.model, msg.version
        settle = None
        if msg.discover:
            guessed = [str(n) for n in msg.discover.get("datatypes", [])]
            settle = functools.partial(discovery.complete, guessed=guessed)
        if not msg.discover:
            parked = self._from_host(msg)
            if parked is not None:
                return parked
        self._forget((name, version))   # new files may run differently
        try:
            stamp = files_stamp(Path(msg.path))   # before the load reads them
            cfg = parse_config(msg.config, f"config of {name}", discover=bool(msg.discover))
            memory.load_runtime(self.context, cfg, Path(msg.path),
                                memory.settled(self._memory_probe, self.device))
            loaded = load(cfg, version, Path(msg.path), self.device,
                          memory.settled(self._memory_probe, self.device),
                          memory.PeakProbe(self.device), settle, self._models_for(msg))
        except (LoadError, ValueError, OSError) as exc:
            logger.error("load of %s/%d failed: %s", name, version, exc)
            passes = exc.transient if isinstance(exc, LoadError) else transient(exc)
            return p.ModelLoaded(name, version, False, error=str(exc), transient=passes)
        if loaded.calls_models and self.models_client is not None:
            self.models_client.start()   # now: the broker's first answer takes a round trip
        self._load_seq += 1
        loaded.extra["seq"] = self._load_seq
        loaded.extra.update(config=msg.config, stamp=stamp)
        return self._install(loaded, msg)

    def _from_host(self, msg: p.LoadModel) -> p.ModelLoaded | None:
        """The version parked in host memory, moved back, when it is the content and
        config asked for; its memory and plan are its load's (on a CPU it never left
        the process, so a probe now would read nothing)."""
        start = time.monotonic()
        loaded, stale = self.host_cache.take(msg.model, msg.version, msg.sha256, msg.config,
                                             Path(msg.path))
        while stale:   # popped, not a loop variable: that would hold the last one alive
            stale.pop().release()
        self.m_host_cache.set(self.host_cache.bytes)
        if loaded is None:
            return None
        loaded.load_s = time.monotonic() - start
        return self._install(loaded, msg, "from host memory")

    def _install(self, loaded: LoadedModel, msg: p.LoadModel,
                 source: str = "") -> p.ModelLoaded:
        name, version = msg.model, msg.version
        loaded.extra["steps"] = p.STEPS_VERSION in msg.versions   # the broker reads STEPS
        old = self.models.put((name, version), loaded)
        if old is not None:  # the same version changed in place: the new one replaces it
            old.release()
            del old
        self.m_model_memory.labels(name, str(version)).set(loaded.memory_bytes)
        # a move back from the host-memory tier is a turn of load on demand, many a
        # second: debug (the broker's metrics count them); a read from disk is news
        logger.log(logging.DEBUG if source else logging.INFO,
                   "loaded %s/%d (sha256 %s, %.1f MB, %.3fs%s)", name, version,
                   loaded.sha256[:12], loaded.memory_bytes / 1e6, loaded.load_s,
                   f", {source}" if source else "")
        return p.ModelLoaded(name, version, True, sha256=loaded.sha256,
                             memory_bytes=loaded.memory_bytes, load_s=loaded.load_s,
                             memory=loaded.plan,
                             config=loaded.config.to_json() if msg.discover else {})

    def _models_for(self, msg: p.LoadModel) -> Any:
        """The client a handler that calls models is given: only from a broker that reads
        WAITING (an older one drops it, and a worker waiting on calls only it can run
        would deadlock again), so during a rolling upgrade such a handler is refused."""
        if self.models_client is None or p.WAITING_VERSION in msg.versions:
            return self.models_client
        return handlers.NoModels(
            f"the broker speaks protocol versions {', '.join(map(str, msg.versions))}: a "
            f"handler that calls models needs a broker of protocol version "
            f"{p.WAITING_VERSION} or later (upgrade the broker first, docs/bls.md)")

    # -- unloading ----------------------------------------------------------------
    def unload_version(self, name: str, version: int) -> None:
        loaded, later = self.models.pop((name, version))
        if loaded is None:
            return
        try:
            self.m_model_memory.remove(name, str(version))
        except KeyError:
            pass
        dropped = [loaded] if self.stopping.is_set() else \
            self.host_cache.park(loaded, loaded.extra.get("config", {}))
        parked = all(d is not loaded for d in dropped)
        if not parked:   # a parked version keeps its timing: it moves back as it ran
            self._forget((name, version))
        # what memory may legitimately stay: models loaded after this one and still held,
        # in memory or parked (on a CPU), and this one if it is parked
        expected = loaded.probe_before + sum(later) + self.host_cache.resident_after(
            loaded.extra.get("seq", 0)) + (loaded.memory_bytes if parked and
                                           self.device == "cpu" else 0)
        released = bool(dropped)
        # popped, not a loop variable: that would hold the last one, and the memory the
        # probe below looks for, until this returns (and recycle a worker that leaked nothing)
        while dropped:
            dropped.pop().release()
        del loaded, dropped
        self.m_host_cache.set(self.host_cache.bytes)
        if parked and not released and self.device == "cpu":
            # nothing left the process: a collection and a probe would find nothing to
            # free and cost the loader a millisecond on every turn of load on demand
            logger.debug("unloaded %s/%d (parked in host memory, %d of %d bytes)", name,
                         version, self.host_cache.bytes, self.host_cache.limit_bytes)
            return
        gc.collect()
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()  # back to the device, where the broker's plan sees it
        excess = self._memory_probe() - expected
        logger.info("unloaded %s/%d (memory %+.1f MB against before its load%s)", name,
                    version, excess / 1e6, f"; parked in host memory, "
                    f"{self.host_cache.bytes} of {self.host_cache.limit_bytes} bytes"
                    if parked else "")
        if excess > self.memory_tolerance_bytes and not self.stopping.is_set():
            self.recycle_reason = (f"memory not returned after unloading {name}/{version}: "
                                   f"{excess / 1e6:.0f} MB above the tolerance of "
                                   f"{self.memory_tolerance_bytes / 1e6:.0f} MB")
            logger.warning("%s; draining to restart", self.recycle_reason)
            self.stopping.set()  # the main loop drains through the broker, then exits

    def _memory_probe(self) -> int:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
            return int(torch.cuda.memory_allocated())
        return rss_bytes()
