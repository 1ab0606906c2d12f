"""What an operator asks of the broker (drain, undrain, restart a worker, reload a model,
SIGHUP) and what stopping needs: a mixin of Broker, kept apart from the socket loop."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from zeroserve.broker import protocol as p

if TYPE_CHECKING:
    from zeroserve.broker.membership import WorkerState
    from zeroserve.broker.server import Broker

logger = logging.getLogger(__name__)


class Operations:
    def _worker_named(self: "Broker", worker_id: str) -> WorkerState:
        worker = self.members.by_id(worker_id)
        if worker is None:
            known = ", ".join(sorted(w.worker_id for w in self.members.workers.values()))
            raise LookupError(f"unknown worker {worker_id!r} (known: {known or 'none'})")
        return worker

    def drain_worker(self: "Broker", worker_id: str, draining: bool = True) -> dict[str, Any]:
        """Stop (or resume) sending new batches to a worker; its in-flight ones finish."""
        worker = self._worker_named(worker_id)
        if not draining and worker.exiting:
            raise LookupError(f"worker {worker_id!r} is leaving and cannot be undrained")
        worker.draining = draining
        logger.info("worker %s %s by the operator", worker_id,
                    "drained" if draining else "undrained")
        return worker.describe(self.clock())

    def restart_worker(self: "Broker", worker_id: str) -> dict[str, Any]:
        """Drain a worker, then let it exit cleanly so its supervisor starts it again."""
        worker = self._worker_named(worker_id)
        worker.draining = worker.exiting = True
        logger.info("worker %s restarting by the operator after %d batch(es)", worker_id,
                    len(worker.inflight))
        described = worker.describe(self.clock())
        self._release_if_drained(worker)
        return described

    def reload_model(self: "Broker", name: str, version: int | None) -> dict[str, Any]:
        """A fresh load of a model's version(s) on every worker placed for it, swapped
        in two phases once all are ready; the old load keeps serving until then, and
        keeps serving if any load fails."""
        model = self.catalog.get(name)
        if model is None:
            raise LookupError(f"unknown model {name!r}")
        if version is not None and version not in model.versions:
            raise LookupError(f"version {version} of model {name!r} is not served")
        versions = [version] if version is not None else list(model.versions)
        workers = self.lifecycle.reload(name, versions)
        return {"model": name, "versions": versions,
                "loads": [f"{w}:{name}/{v}" for w in workers for v in versions]}

    def reload_config(self: "Broker") -> None:
        """SIGHUP: rescan the repository and bring every worker in line with it."""
        self._reload_requested = False
        self.notifier.reloading()
        logger.info("reloading the model repository")
        try:
            self.load_catalog()
        except ValueError as exc:
            logger.error("reload failed, keeping the catalog: %s", exc)
        for worker in list(self.members.workers.values()):
            self.sync_worker(worker)
        self.notifier.ready()

    def _fail_unservable(self: "Broker") -> None:
        """While stopping, queued work that no staying worker can take fails now."""
        for name in list(self.scheduler.models_waiting()):
            if not any(w.holds(name) and not w.draining for w in self.members.workers.values()):
                for entry in self.scheduler.drop_model(name):
                    self._answer_error(entry, p.ErrorCode.UNAVAILABLE,
                                       "broker is shutting down and no worker can take this")
