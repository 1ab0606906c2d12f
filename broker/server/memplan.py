"""The memory plan: what each version held or loading on a worker needs (measured
after its warm-up, else predicted from its files: models/footprint.py) and what each
worker's device has (its budget, headroom, context and free memory), reported in
``zeroserve status``/``models`` and as metrics. Placement (placement.py) decides with
these numbers; this keeps them.

A version measured already (on any worker of the same device kind, same sha256) is
planned with what was measured. Each device keeps a headroom (``--memory-headroom``,
reported by its worker):

* GPU: the worker's last report of ``torch.cuda.mem_get_info`` free memory, less what
  was loaded or is loading since that report, less the headroom;
* CPU with ``--memory-budget``: the budget less the headroom, the device's context cost
  (measured by the worker at start) and every loaded or loading version's footprint;
* GPU with ``--memory-budget``: the lesser of the two above, the headroom kept of the
  device's free memory only (an operator's cap on one process's share of a GPU: another
  server or a job beside it, or a many-model host that must evict before the device is
  full);
* CPU without a budget: no limit.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from zeroserve.broker import protocol as p
from zeroserve.broker.server.catalog import Catalog
from zeroserve.broker.server.pool import WorkerPool, WorkerState
from zeroserve.broker.server.types import ModelVersion
from zeroserve.models.footprint import Learned, Prediction, WeightsCache, facts, files_of, \
    predict, runtime_charge, size_text
from zeroserve.models.repository import ModelConfig

logger = logging.getLogger(__name__)

Key = tuple[bytes, str, int]
TRIAL = ".trial-"


def device_kind(worker: WorkerState) -> str:
    return "cuda" if str(worker.info.get("device", "")).startswith("cuda") else "cpu"


def int_of(doc: Mapping[str, Any], key: str) -> int:
    value = doc.get(key, 0)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


class MemoryPlan:
    """Reads the catalog and the pool; keeps each held version's footprint (what
    planning counts: measured, else predicted) and what was learned from warm-ups."""

    def __init__(self, catalog: Catalog, pool: WorkerPool, registry: CollectorRegistry) -> None:
        self.catalog = catalog
        self.pool = pool
        self.footprints: dict[Key, int] = {}        # what planning counts: measured, else predicted
        self.predicted: dict[Key, Prediction] = {}
        self.measured: dict[Key, dict[str, Any]] = {}    # the worker's plan after warm-up
        # by (model, device kind, format)
        self.learned: dict[tuple[str, str, str], Learned] = {}
        self.by_content: dict[tuple[str, str, str], tuple[int, str]] = {}  # -> bytes, worker
        self.refusals: dict[tuple[str, str], int] = {}   # (model, device) -> loads refused
        self._weights: WeightsCache = {}
        registry.register(self)  # a collector: see collect()

    # -- what a device has -------------------------------------------------------
    @staticmethod
    def budget(worker: WorkerState) -> int:
        value = worker.info.get("memory_budget_bytes", 0)
        return value if isinstance(value, int) and value > 0 else 0

    @staticmethod
    def headroom(worker: WorkerState) -> int:
        return int_of(worker.memory, "headroom_bytes")

    @staticmethod
    def context(worker: WorkerState) -> int:
        return int_of(worker.memory, "context_bytes")

    def held(self, worker: WorkerState,
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
            return int_of(plan, "footprint_bytes")
        return int_of(worker.memory.get("models") or {}, reported)

    def used(self, worker: WorkerState, skip: tuple[str, int] | None = None) -> int:
        """The context plus the footprints of what is loaded or loading (but ``skip``)."""
        return self.context(worker) + sum(self.footprint(worker, m, v)
                                          for m, v in self.held(worker, skip))

    def budget_headroom(self, worker: WorkerState) -> int:
        """The headroom kept of the budget: a GPU keeps it of its free memory instead."""
        return self.headroom(worker) if device_kind(worker) == "cpu" else 0

    def budget_room(self, worker: WorkerState,
                    skip: tuple[str, int] | None = None) -> int | None:
        """What the budget leaves for a new version (None: no budget)."""
        budget = self.budget(worker)
        if not budget:
            return None
        return budget - self.budget_headroom(worker) - self.used(worker, skip)

    def available(self, worker: WorkerState,
                  skip: tuple[str, int] | None = None) -> int | None:
        """Bytes a new version may take on the worker's device now, after the headroom
        (negative: over already); None: no limit (a CPU without a budget)."""
        room = self.budget_room(worker, skip)
        report = worker.memory
        if device_kind(worker) == "cuda" and isinstance(report.get("gpu_free_bytes"), int):
            seen = report.get("models") or {}
            unseen = sum(self.footprint(worker, m, v) for m, v in self.held(worker, skip)
                         if str(ModelVersion(m, v)) not in seen)
            device = int(report["gpu_free_bytes"]) - unseen - self.headroom(worker)
            return device if room is None else min(device, room)
        return room

    def where(self, worker: WorkerState) -> str:
        device = str(worker.info.get("device") or "cpu")
        budget = self.budget(worker)
        if budget:
            return (f"{device} on worker {worker.worker_id} (memory budget "
                    f"{size_text(budget)}, {size_text(self.context(worker))} context)")
        return f"{device} on worker {worker.worker_id}"

    # -- what a version needs ----------------------------------------------------
    def need(self, worker: WorkerState, name: str, version: int, cfg: ModelConfig,
             version_dir: Path, sha: str = "") -> tuple[int, str]:
        """(bytes, how they were known): measured here, measured on another worker of the
        same device kind for the same content, or predicted from the files; with the
        runtime of its format where the worker has not loaded that yet."""
        kind, files = device_kind(worker), facts(cfg, version_dir, self._weights)
        runtime = runtime_charge(files.runtime, worker.memory.get("runtimes") or {},
                                 self._runtimes(kind) if files.runtime else {}, kind == "cpu")
        more = f" + {size_text(runtime)} for the {files.runtime} runtime" if runtime else ""
        mine = self.measured.get((worker.identity, name, version))
        if mine is not None:
            return int_of(mine, "footprint_bytes") + runtime, "measured on this worker" + more
        sha = sha or self.catalog.shas.get(name, {}).get(version, "")
        seen = self.by_content.get((name, sha, kind)) if sha else None
        if seen is not None:
            return seen[0] + runtime, f"measured on worker {seen[1]}{more}"
        pred = predict(cfg, version_dir, self.learned.get((name, kind, files.format)),
                       self._weights, host=kind == "cpu", runtime_bytes=runtime)
        self.predicted[(worker.identity, name, version)] = pred
        return pred.total_bytes, pred.describe()

    def _runtimes(self, kind: str) -> dict[str, int]:
        """The format runtimes workers of a device kind measured (the most of each)."""
        out: dict[str, int] = {}
        for w in self.pool.workers.values():
            got = w.memory.get("runtimes")
            if device_kind(w) == kind and isinstance(got, dict):
                for name, n in got.items():
                    if isinstance(n, int) and n >= out.get(name, 0):
                        out[name] = n
        return out

    def learn(self, worker: WorkerState, msg: p.ModelLoaded) -> int:
        """Replace the prediction with what the worker measured (its bytes returned), and
        teach the predictions of the model's format on this device kind."""
        key = (worker.identity, msg.model, msg.version)
        plan = dict(msg.memory) if msg.memory else {"footprint_bytes": msg.memory_bytes,
                                                    "resident_bytes": msg.memory_bytes}
        need = int_of(plan, "footprint_bytes") or msg.memory_bytes
        self.measured[key] = plan
        self.footprints[key] = need
        model = self.catalog.get(msg.model)
        if msg.memory and model is not None:   # taught for this format only
            fmt = files_of(model.config, model.path / str(msg.version), self._weights)[1]
            self.learned[(msg.model, device_kind(worker), fmt)] = Learned.from_plan(plan)
        if msg.sha256:
            self.by_content[(msg.model, msg.sha256, device_kind(worker))] = (need, worker.worker_id)
        pred = self.predicted.get(key)
        if pred is not None:
            logger.info("memory of %s/%d on %s: %s predicted, %s measured", msg.model,
                        msg.version, worker.worker_id, size_text(pred.total_bytes),
                        size_text(need))
        return need

    def refused(self, worker: WorkerState, model: str) -> None:
        label = (model, str(worker.info.get("device") or "cpu"))
        self.refusals[label] = self.refusals.get(label, 0) + 1

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

    def worker_gone(self, identity: bytes) -> None:
        """A worker left (lost or drained): what was planned for its connection goes; a
        restart reconnects as a new one and reports what it holds (a worker killed
        every minute left two entries each for good)."""
        for table in (self.footprints, self.measured, self.predicted):
            for key in [k for k in table if k[0] == identity]:
                del table[key]

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
            out["measured_bytes"] = int_of(meas, "footprint_bytes")
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
                           for m, v in sorted(self.held(w))}}
        return out

    def describe_model(self, name: str) -> dict[str, Any]:
        """Per worker holding it: predicted and measured bytes (``zeroserve models``)."""
        return {w.worker_id: {str(v): self._entry(w, m, v)
                              for m, v in sorted(self.held(w)) if m == name}
                for w in self.pool.workers.values()
                if any(m == name for m, _ in self.held(w))}

    def collect(self) -> Iterator[Metric]:
        """prometheus_client's collector protocol: the plan as it stands at each scrape."""
        labels = ["model", "version", "worker"]
        pred = GaugeMetricFamily("zeroserve_model_memory_predicted_bytes",
                                 "A version's footprint predicted before it loaded", labels=labels)
        meas = GaugeMetricFamily("zeroserve_model_memory_measured_bytes",
                                 "A version's footprint measured after warm-up "
                                 "(resident + activations at its largest batch)", labels=labels)
        for w in self.pool.workers.values():
            for m, v in sorted(self.held(w)):
                key = (w.identity, m, v)
                if key in self.predicted:
                    pred.add_metric([m, str(v), w.worker_id], self.predicted[key].total_bytes)
                if key in self.measured:
                    meas.add_metric([m, str(v), w.worker_id],
                                    int_of(self.measured[key], "footprint_bytes"))
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
