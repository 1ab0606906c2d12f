"""The broker's read-only control verbs (``status``, ``models``, ``metadata``, ``config``,
``metrics``): what its parts say of themselves, put together. Each part is given here as
what is read of it; nothing is changed but the queue-depth gauges a scrape refreshes."""

from __future__ import annotations

import os
from typing import Any, Callable

from zeroserve.broker import wording
from zeroserve.broker.runtime import hostname
from zeroserve.broker.server.catalog import Catalog, CatalogModel, optional_models
from zeroserve.broker.server.control import ControlTable
from zeroserve.broker.server.metrics import BrokerMetrics
from zeroserve.broker.server.pool import WorkerPool
from zeroserve.broker.server.scheduler import Scheduler


class ReadVerbs:
    """``describe_model(name)``: the lifecycle's part of a model's entry; ``status()``:
    the other parts' sections of ``zeroserve status``."""

    def __init__(self, catalog: Catalog, pool: WorkerPool, scheduler: Scheduler,
                 metrics: BrokerMetrics, clock: Callable[[], float], *,
                 describe_model: Callable[[str], dict[str, Any]],
                 status: Callable[[], dict[str, Any]]) -> None:
        self.catalog = catalog
        self.pool = pool
        self.scheduler = scheduler
        self.metrics = metrics
        self.clock = clock
        self._describe_model = describe_model
        self._status = status

    def add_verbs(self, c: ControlTable) -> None:
        c.add("status", self.status)
        c.add("models", self.models)
        c.add("metadata", self.metadata)
        c.add("config", lambda a: self.model(a).config.to_json())
        c.add("metrics", self.scrape)

    def model(self, args: dict[str, Any]) -> CatalogModel:
        name, version = args.get("model"), args.get("version")
        model = self.catalog.get(name) if isinstance(name, str) else None
        if model is None:
            raise LookupError(wording.unknown_model(name))
        if version is not None and version not in model.versions:
            raise LookupError(wording.unknown_version(name, version))
        return model

    def status(self, _: dict[str, Any]) -> dict[str, Any]:
        now = self.clock()
        return {"workers": [w.describe(now) for w in self.pool.workers.values()],
                "queues": {m: self.scheduler.depth(m) for m in self.catalog.models},
                "inflight_batches": len(self.pool.inflight), "pid": os.getpid(),
                **self._status()}

    def models(self, _: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for name, m in sorted(self.catalog.models.items()):
            out[name] = {"versions": list(m.versions), "ready": sorted(m.ready),
                         "default_version": m.default_version if m.ready else None,
                         "platform": m.config.platform, "optional": m.config.optional,
                         "workers": self._workers(m),
                         **self._describe_model(name)}
        errors = dict(self.catalog.errors)
        for name, failure in self.catalog.failures.items():
            errors.setdefault(name, failure["error"])
        return {"models": out, "errors": errors,
                "optional": optional_models(self.catalog, errors),
                "workers_connected": len(self.pool.workers)}

    def _workers(self, model: CatalogModel) -> list[str]:
        """The workers holding the model; for an ensemble (held by none: the broker
        runs it), those holding any of its steps."""
        names = [s.model_name for s in model.config.ensemble] or [model.config.name]
        return sorted({w.worker_id for n in names for w in self.pool.holders(n)})

    def metadata(self, args: dict[str, Any]) -> dict[str, Any]:
        model = self.model(args)
        meta = model.metadata()
        meta["ready"] = bool(model.ready if args.get("version") is None
                             else args["version"] in model.ready)
        meta["max_batch_size"] = model.config.max_batch_size
        meta["labels"] = model.labels
        return meta

    def scrape(self, _: dict[str, Any]) -> dict[str, Any]:
        for name in self.catalog.models:
            self.metrics.queue_depth.labels(name).set(self.scheduler.depth(name))
        return {"broker": self.metrics.render(), "instance": f"{hostname()}:{os.getpid()}",
                "workers": {w.worker_id: w.metrics_text for w in self.pool.workers.values()}}
