"""Memory placement: whether a model version fits on a worker's device, decided before
the worker is asked to load it, and checked again with what it measured.

Before a LOAD the broker predicts the version's footprint (models/footprint.py): the
parameter and buffer bytes its archive holds, plus the activation term a warm-up of the
same model taught (per sample, at the model's largest batch). A version measured
already (on any worker of the same device kind, same sha256) is planned with what was
measured. Each device keeps a headroom (``--memory-headroom``, reported by its worker):

* GPU: the worker's last report of ``torch.cuda.mem_get_info`` free memory, less what
  was loaded or is loading since that report, less the headroom;
* CPU with ``--memory-budget``: the budget less the headroom, the device's context cost
  (measured by the worker at start) and every loaded or loading version's footprint;
* GPU with ``--memory-budget``: the lesser of the two above, the headroom kept of the
  device's free memory only (an operator's cap on one process's share of a GPU: another
  server or a job beside it, or a many-model host that must evict before the device is
  full);
* CPU without a budget: no limit.

A version that does not fit evicts idle models on the worker (nothing queued or
running), the least wanted first (fewest recent requests, then least recently used),
when that makes room, else it is refused without loading:
the refusal reaches the swap as a failed LOADED (the old version keeps serving) and
names the device and the bytes. After warm-up the worker's measurement replaces the
prediction; on a budget, a measured footprint that does not fit is evicted for or
refused as before.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import msgspec
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from zeroserve.broker import protocol as p
from zeroserve.broker import wording
from zeroserve.broker.process import RateLimitedLog
from zeroserve.broker.server.catalog import Catalog
from zeroserve.broker.server.pool import WorkerPool, WorkerState
from zeroserve.broker.server.types import ModelVersion
from zeroserve.models.footprint import Learned, Prediction, WeightsCache, files_of, predict, \
    size_text
from zeroserve.models.repository import ConfigError, ModelConfig, parse_config

logger = logging.getLogger(__name__)

Key = tuple[bytes, str, int]
TRIAL = ".trial-"


def _kind(worker: WorkerState) -> str:
    return "cuda" if str(worker.info.get("device", "")).startswith("cuda") else "cpu"


def _int(doc: Mapping[str, Any], key: str) -> int:
    value = doc.get(key, 0)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


Evictable = Callable[[WorkerState, str, str, bool], bool]
# The room past the most wanted models (kept) holds this many of the model asking for
# room: one loads while another runs. With one, the turns run in series (evict, load, the
# LOADED back, the batch, its result, evict again) and the less wanted models waited
# 20-30% longer under Zipf(1.1) over 12 models on a 4-model budget.
TURNS = 2
Evicted = Callable[[WorkerState, str, str], None]


def _always(worker: WorkerState, model: str, keep: str, hot: bool) -> bool:
    return True


def _nobody(worker: WorkerState, model: str, reason: str) -> None:
    pass


class Placement:
    """Reads the catalog and the pool; asks ``queued(model)`` (requests waiting) and
    ``wanted(model)`` (its recent requests) and ``last_used(model)`` (when it last ran) to
    choose what to evict, the least wanted first, ``evictable(worker, model, keep, hot)``
    whether an idle model may go to make room for ``keep`` (load on demand's residency;
    ``hot``: the model is one of the most wanted, as many as fit beside ``keep``), and
    tells ``evicted(worker, model, reason)`` what it evicted."""

    def __init__(self, catalog: Catalog, pool: WorkerPool, registry: CollectorRegistry, *,
                 queued: Callable[[str], int], last_used: Callable[[str], float],
                 wanted: Callable[[str], float] = lambda model: 0.0,
                 evictable: Evictable = _always, evicted: Evicted = _nobody) -> None:
        self.catalog = catalog
        self.pool = pool
        self._queued = queued
        self._last_used = last_used
        self._wanted = wanted
        self.evictable = evictable
        self.evicted = evicted
        self.footprints: dict[Key, int] = {}        # what planning counts: measured, else predicted
        self.predicted: dict[Key, Prediction] = {}
        self.measured: dict[Key, dict[str, Any]] = {}    # the worker's plan after warm-up
        # by (model, device kind, format)
        self.learned: dict[tuple[str, str, str], Learned] = {}
        self.by_content: dict[tuple[str, str, str], tuple[int, str]] = {}  # -> bytes, worker
        self.refused: list[tuple[WorkerState, p.ModelLoaded]] = []  # delivered by the tick
        self.refusals: dict[tuple[str, str], int] = {}
        self._weights: WeightsCache = {}
        # load on demand evicts for each turn, a hundred times a second on a host that
        # churns through its working set: the metric counts them all
        self._evictions_log = RateLimitedLog(logger, per_s=1.0)
        registry.register(self)  # a collector: see collect()

    # -- what a device has -------------------------------------------------------
    @staticmethod
    def budget(worker: WorkerState) -> int:
        value = worker.info.get("memory_budget_bytes", 0)
        return value if isinstance(value, int) and value > 0 else 0

    @staticmethod
    def headroom(worker: WorkerState) -> int:
        return _int(worker.memory, "headroom_bytes")

    @staticmethod
    def context(worker: WorkerState) -> int:
        return _int(worker.memory, "context_bytes")

    def _held(self, worker: WorkerState,
              skip: tuple[str, int] | None = None) -> set[tuple[str, int]]:
        return {k for k in worker.loaded | worker.loading
                if k != skip and not k[0].startswith(TRIAL)}

    def footprint(self, worker: WorkerState, name: str, version: int) -> int:
        """What planning counts for a held version: measured, else predicted; for one a
        worker held before this broker knew it (a restart), what its report says."""
        key = (worker.identity, name, version)
        if key in self.footprints:
            return self.footprints[key]
        reported = str(ModelVersion(name, version))   # the worker's reports key by it
        plan = (worker.memory.get("plans") or {}).get(reported)
        if isinstance(plan, dict):
            return _int(plan, "footprint_bytes")
        return _int(worker.memory.get("models") or {}, reported)

    def used(self, worker: WorkerState, skip: tuple[str, int] | None = None) -> int:
        """The context plus the footprints of what is loaded or loading (but ``skip``)."""
        return self.context(worker) + sum(self.footprint(worker, m, v)
                                          for m, v in self._held(worker, skip))

    def _budget_headroom(self, worker: WorkerState) -> int:
        """The headroom kept of the budget: a GPU keeps it of its free memory instead."""
        return self.headroom(worker) if _kind(worker) == "cpu" else 0

    def _budget_room(self, worker: WorkerState,
                     skip: tuple[str, int] | None = None) -> int | None:
        """What the budget leaves for a new version (None: no budget)."""
        budget = self.budget(worker)
        if not budget:
            return None
        return budget - self._budget_headroom(worker) - self.used(worker, skip)

    def available(self, worker: WorkerState,
                  skip: tuple[str, int] | None = None) -> int | None:
        """Bytes a new version may take on the worker's device now, after the headroom
        (negative: over already); None: no limit (a CPU without a budget)."""
        room = self._budget_room(worker, skip)
        report = worker.memory
        if _kind(worker) == "cuda" and isinstance(report.get("gpu_free_bytes"), int):
            seen = report.get("models") or {}
            unseen = sum(self.footprint(worker, m, v) for m, v in self._held(worker, skip)
                         if str(ModelVersion(m, v)) not in seen)
            device = int(report["gpu_free_bytes"]) - unseen - self.headroom(worker)
            return device if room is None else min(device, room)
        return room

    def _where(self, worker: WorkerState) -> str:
        device = str(worker.info.get("device") or "cpu")
        budget = self.budget(worker)
        if budget:
            return (f"{device} on worker {worker.worker_id} (memory budget "
                    f"{size_text(budget)}, {size_text(self.context(worker))} context)")
        return f"{device} on worker {worker.worker_id}"

    # -- what a version needs ----------------------------------------------------
    def _model(self, name: str) -> tuple[ModelConfig, Path] | None:
        model = self.catalog.get(name)
        return (model.config, model.path) if model is not None else None

    def need(self, worker: WorkerState, name: str, version: int, cfg: ModelConfig,
             version_dir: Path, sha: str = "") -> tuple[int, str]:
        """(bytes, how they were known): measured here, measured on another worker of the
        same device kind for the same content, or predicted from the files."""
        mine = self.measured.get((worker.identity, name, version))
        if mine is not None:
            return _int(mine, "footprint_bytes"), "measured on this worker"
        sha = sha or self.catalog.shas.get(name, {}).get(version, "")
        seen = self.by_content.get((name, sha, _kind(worker))) if sha else None
        if seen is not None:
            return seen[0], f"measured on worker {seen[1]}"
        fmt = files_of(cfg, version_dir, self._weights)[1]
        pred = predict(cfg, version_dir, self.learned.get((name, _kind(worker), fmt)),
                       self._weights)
        self.predicted[(worker.identity, name, version)] = pred
        return pred.total_bytes, pred.describe()

    def refusal(self, worker: WorkerState, name: str, version: int) -> str | None:
        """Why ``name/version`` does not fit on ``worker`` now (None: it fits, or is
        there already), from its measured footprint or else the prediction, against the
        device's free memory less its headroom. Evicts nothing."""
        if (name, version) in worker.loaded | worker.loading:
            return None
        model = self._model(name)
        if model is None:
            return wording.unknown_model(name)
        need, how = self.need(worker, name, version, model[0], model[1] / str(version))
        return self._verdict(worker, name, version, need, how, self.available(worker))

    def too_big(self, worker: WorkerState, name: str, version: int) -> str | None:
        """Why ``name/version`` could not load on ``worker`` even with nothing else
        loaded there (None: it could, or it is there already). Evicts nothing; asked of
        the first request for a model not loaded, so the words are written only for a
        version that is too big."""
        if (name, version) in worker.loaded or (name, version) in worker.loading:
            return None
        model = self.catalog.get(name)
        if model is None:
            return wording.unknown_model(name)
        need, how = self.need(worker, name, version, model.config, model.path / str(version))
        free = self.available(worker)
        if free is None or need <= free:
            return None
        budget = self.budget(worker)
        if budget:
            empty = budget - self._budget_headroom(worker) - self.context(worker)
        else:   # what is loading too: it is evictable once loaded
            empty = free + sum(self.footprint(worker, m, v) for m, v in self._held(worker))
        if need <= empty:
            return None
        freed = sum(self._cost(worker, m) for m in self._idle(worker, name, free, need))
        return self._verdict(worker, name, version, need, how, free + freed)

    def fits(self, worker: WorkerState, name: str, version: int) -> bool:
        """Whether ``name/version`` can load on ``worker`` now, after evicting the idle
        models that may go (what :meth:`load` would do, evicting nothing). Load on demand
        asks it for every model waiting, of every worker, each time room may have
        opened, and mostly hears no: that answer writes no reasons."""
        if (name, version) in worker.loaded or (name, version) in worker.loading:
            return True
        model = self.catalog.get(name)
        if model is None:
            return False
        need = self.need(worker, name, version, model.config, model.path / str(version))[0]
        free = self.available(worker)
        if free is None or need <= free:
            return True
        return free + sum(self._cost(worker, m)
                          for m in self._idle(worker, name, free, need)) >= need

    @staticmethod
    def for_memory(error: str) -> bool:
        """Whether a load's error is one of placement's refusals (what ``_verdict``
        writes), not the worker's."""
        return " free after " in error and " needs " in error

    def _verdict(self, worker: WorkerState, name: str, version: int, need: int, how: str,
                 free: int | None, busy: int = 0) -> str | None:
        if free is None or need <= free:
            return None
        why = (f"{self._where(worker)} has {size_text(max(0, free))} free after "
               f"{size_text(self.headroom(worker))} headroom; {ModelVersion(name, version)} needs "
               f"{size_text(need)} ({how})")
        budget = self.budget(worker)
        room = budget - self._budget_headroom(worker) - self.context(worker)
        if budget and need > room:
            why += (f"; more than worker {worker.worker_id}'s memory budget of "
                    f"{size_text(budget)} leaves after its context"
                    f"{' and headroom' if _kind(worker) == 'cpu' else ''}")
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
        need, how = self.need(worker, name, version, cfg, Path(msg.path), msg.sha256)
        free = self.available(worker)   # a version reloaded in place is held twice a while
        if free is not None and need > free:
            idle = self._idle(worker, name, free, need)
            freed = sum(self._cost(worker, m) for m in idle)
            why = self._verdict(worker, name, version, need, how, free + freed)
            if why is not None:
                self._refuse(worker, p.ModelLoaded(name, version, False, error=why))
                return
            self._evict(worker, name, idle, need - free, "room")
        self.footprints[key] = need
        self.measured.pop(key, None)   # this load's warm-up measures it afresh
        self.pool.load(worker, msg)

    def _refuse(self, worker: WorkerState, msg: p.ModelLoaded) -> None:
        logger.error("refusing %s/%d on %s: %s", msg.model, msg.version, worker.worker_id,
                     msg.error)
        self.catalog.fail(msg.model, msg.error, [msg.version])
        label = (msg.model, str(worker.info.get("device") or "cpu"))
        self.refusals[label] = self.refusals.get(label, 0) + 1
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
                self.footprints.pop(key, None)
            return msg
        need = self._learn(worker, msg)
        budget = self.budget(worker)
        free = self._budget_room(worker, (msg.model, msg.version))
        if free is None or need <= free:
            return msg
        idle = self._idle(worker, msg.model, free, need)
        freed = sum(self._cost(worker, m) for m in idle)
        why = self._verdict(worker, msg.model, msg.version, need, "measured", free + freed,
                            busy=max(0, budget - free - freed))
        if why is None:
            self._evict(worker, msg.model, idle, need - free, "measured")
            return msg
        logger.error("refusing %s/%d on %s: %s", msg.model, msg.version, worker.worker_id, why)
        self.catalog.fail(msg.model, why, [msg.version])
        self.forget(key)
        self.pool.unload(worker, msg.model, msg.version)
        return msgspec.structs.replace(msg, ok=False, error=why)

    def _learn(self, worker: WorkerState, msg: p.ModelLoaded) -> int:
        key = (worker.identity, msg.model, msg.version)
        plan = dict(msg.memory) if msg.memory else {"footprint_bytes": msg.memory_bytes,
                                                    "resident_bytes": msg.memory_bytes}
        need = _int(plan, "footprint_bytes") or msg.memory_bytes
        self.measured[key] = plan
        self.footprints[key] = need
        model = self._model(msg.model)
        if msg.memory and model is not None:   # taught for this format only
            fmt = files_of(model[0], model[1] / str(msg.version), self._weights)[1]
            self.learned[(msg.model, _kind(worker), fmt)] = Learned.from_plan(plan)
        if msg.sha256:
            self.by_content[(msg.model, msg.sha256, _kind(worker))] = (need, worker.worker_id)
        pred = self.predicted.get(key)
        if pred is not None:
            logger.info("memory of %s/%d on %s: %s predicted, %s measured", msg.model,
                        msg.version, worker.worker_id, size_text(pred.total_bytes),
                        size_text(need))
        return need

    def retain(self, model: str, folder: Path, shas: Iterable[str]) -> None:
        """Only the builds ``shas`` of the model (in ``folder``) are served now: what was
        learned of the others' contents and files goes (their folders are deleted; a
        version every 30 s once left an entry each for good)."""
        keep = set(shas)
        for key in [k for k in self.by_content if k[0] == model and k[1] not in keep]:
            del self.by_content[key]
        prefix = f"{folder}/"
        try:
            live = set(os.listdir(folder))
        except OSError:
            live = set()
        for path in [k for k in self._weights if k[0].startswith(prefix)
                     and k[0][len(prefix):].split("/", 1)[0] not in live]:
            del self._weights[path]

    def forget(self, key: Key) -> None:
        self.footprints.pop(key, None)
        self.measured.pop(key, None)
        self.predicted.pop(key, None)

    # -- eviction ----------------------------------------------------------------------
    def _cost(self, worker: WorkerState, model: str) -> int:
        return sum(self.footprint(worker, model, v) for v in worker.versions_of(model))

    def _idle(self, worker: WorkerState, keep: str, free: int, need: int) -> list[str]:
        """Models on the worker with nothing queued or running that may go to make room
        for ``keep`` (``need`` bytes, ``free`` now), the least wanted first, then the least
        recently used."""
        busy = self.pool.busy_models(worker)
        idle = {m for m, _ in worker.loaded if m != keep and m not in busy
                and not self._queued(m)}
        if not idle:
            return []
        hot = self._hot(worker, keep, free - TURNS * need)
        return sorted((m for m in idle if self.evictable(worker, m, keep, m in hot)),
                      key=lambda m: (self._wanted(m), self._last_used(m)))

    def _hot(self, worker: WorkerState, keep: str, short: int) -> set[str]:
        """The most wanted of the other models the worker holds, as many as still fit
        in ``short`` (the bytes free beside :data:`TURNS` of ``keep``; negative when room
        must be made) and what they hold: the room past them is where the less wanted
        models take turns."""
        cost: dict[str, int] = {}   # loading versions too: ``short`` counts them
        for m, v in self._held(worker):
            if m != keep:
                cost[m] = cost.get(m, 0) + self.footprint(worker, m, v)
        room, hot = short + sum(cost.values()), set()
        for m in sorted(cost, key=self._wanted, reverse=True):
            room -= cost[m]
            if room < 0:
                break
            hot.add(m)
        return hot

    def _evict(self, worker: WorkerState, keep: str, idle: list[str], needed: int,
               reason: str) -> None:
        freed = 0
        for model in idle:
            if freed >= needed:
                break
            freed += self._cost(worker, model)
            for version in sorted(worker.versions_of(model)):
                self.forget((worker.identity, model, version))
                # idle, so unloaded now: its UNLOAD goes before the LOAD it makes room
                # for (never both held at once), and before any reload of it (a retired
                # version's late UNLOAD would unload the reload)
                self.pool.unload(worker, model, version)
            self.catalog.routable(self.pool.workers.values(), model)
            self.evicted(worker, model, reason)
            self._evictions_log.log(logging.WARNING, "evicted %s from worker %s (the least "
                                    "wanted idle model) to make room for %s", model,
                                    worker.worker_id, keep)

    # -- status and metrics ------------------------------------------------------------
    def _entry(self, worker: WorkerState, name: str, version: int) -> dict[str, Any]:
        key = (worker.identity, name, version)
        pred, meas = self.predicted.get(key), self.measured.get(key)
        out: dict[str, Any] = {"state": "loaded" if (name, version) in worker.loaded
                               else "loading"}
        if pred is not None:
            out.update(predicted_bytes=pred.total_bytes, weights_bytes=pred.weights_bytes,
                       predicted=pred.describe())
        if meas is not None:
            out["measured_bytes"] = _int(meas, "footprint_bytes")
            out.update({k: v for k, v in meas.items() if k != "footprint_bytes"})
        if pred is not None and meas is not None and out["measured_bytes"]:
            out["error_pct"] = round(100.0 * (pred.total_bytes - out["measured_bytes"])
                                     / out["measured_bytes"], 1)
        return out

    def describe(self) -> dict[str, Any]:
        """Per worker: the device's numbers and each version's predicted and measured bytes
        (``zeroserve status``)."""
        out = {}
        for w in self.pool.workers.values():
            free = self.available(w)
            out[w.worker_id] = {
                "device": str(w.info.get("device") or "cpu"), "budget_bytes": self.budget(w),
                "headroom_bytes": self.headroom(w), "context_bytes": self.context(w),
                "available_bytes": free, "planned_bytes": self.used(w),
                "models": {str(ModelVersion(m, v)): self._entry(w, m, v)
                           for m, v in sorted(self._held(w))}}
        return out

    def describe_model(self, name: str) -> dict[str, Any]:
        """Per worker holding it: predicted and measured bytes (``zeroserve models``)."""
        return {w.worker_id: {str(v): self._entry(w, m, v)
                              for m, v in sorted(self._held(w)) if m == name}
                for w in self.pool.workers.values()
                if any(m == name for m, _ in self._held(w))}

    def collect(self) -> Iterator[Metric]:
        """prometheus_client's collector protocol: the plan as it stands at each scrape."""
        labels = ["model", "version", "worker"]
        pred = GaugeMetricFamily("zeroserve_model_memory_predicted_bytes",
                                 "A version's footprint predicted before it loaded", labels=labels)
        meas = GaugeMetricFamily("zeroserve_model_memory_measured_bytes",
                                 "A version's footprint measured after warm-up "
                                 "(resident + activations at its largest batch)", labels=labels)
        for w in self.pool.workers.values():
            for m, v in sorted(self._held(w)):
                key = (w.identity, m, v)
                if key in self.predicted:
                    pred.add_metric([m, str(v), w.worker_id], self.predicted[key].total_bytes)
                if key in self.measured:
                    meas.add_metric([m, str(v), w.worker_id],
                                    _int(self.measured[key], "footprint_bytes"))
        free = GaugeMetricFamily("zeroserve_worker_memory_available_bytes",
                                 "Bytes a new version may take on the worker's device after "
                                 "the headroom (negative: over it; absent: no limit)",
                                 labels=["worker", "device"])
        for w in self.pool.workers.values():
            room = self.available(w)
            if room is not None:
                free.add_metric([w.worker_id, str(w.info.get("device") or "cpu")], room)
        refused = CounterMetricFamily("zeroserve_memory_refusals",
                                      "Loads refused for memory before loading",
                                      labels=["model", "device"])
        for (model, device), n in sorted(self.refusals.items()):
            refused.add_metric([model, device], n)
        yield from (pred, meas, free, refused)
