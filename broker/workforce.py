"""The broker's side of worker membership: registration, what each worker loads,
heartbeats, drained exits, and what happens to a lost or hung worker's requests.

A mixin of :class:`~zeroserve.broker.server.Broker`, kept apart so the socket loop
stays short; it uses the broker's sockets, catalog, scheduler and metrics.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from zeroserve.broker import protocol as p
from zeroserve.broker.catalog import CatalogModel
from zeroserve.broker.membership import WorkerState

if TYPE_CHECKING:
    from zeroserve.broker.server import Broker

logger = logging.getLogger(__name__)


class Workforce:
    def on_worker_ready(self: "Broker", identity: bytes, header: dict[str, Any], now: float) -> None:
        old = self.members.workers.get(identity)
        if old is not None:
            self.purge_worker(old, "worker re-registered")
        worker = WorkerState(identity, str(header.get("worker_id", identity.decode())),
                             max(1, int(header.get("credits", 2))), now, info=dict(header))
        worker.loaded = {(str(m), int(v)) for m, v in header.get("models", [])}
        self.members.workers[identity] = worker
        logger.info("worker %s ready (pid %s, %s, %d credits)", worker.worker_id,
                    header.get("pid"), header.get("device"), worker.credits)
        self.sync_worker(worker)
        self.metrics.workers_alive(len(self.members.workers))

    def sync_worker(self: "Broker", worker: WorkerState) -> None:
        """Tell a worker to load what it should serve and unload what it should not."""
        wanted = {(name, v) for name, m in self.catalog.models.items()
                  if self._placed_on(m, worker) for v in m.versions}
        for name, version in sorted(wanted - worker.loaded - worker.loading):
            model = self.catalog.models[name]
            worker.loading.add((name, version))
            self._send(self.backend, worker.identity, p.encode_simple(
                p.Kind.LOAD, model=name, version=version,
                path=str(model.path / str(version)), config=model.config.to_json()))
        for name, version in sorted(worker.loaded - wanted):
            self._unload(worker, name, version)
        for key in worker.loaded & wanted:
            self.catalog.models[key[0]].ready.add(key[1])

    @staticmethod
    def _placed_on(model: CatalogModel, worker: WorkerState) -> bool:
        pinned = model.config.instances.get("workers") or []
        return not pinned or worker.worker_id in pinned

    def _unload(self: "Broker", worker: WorkerState, name: str, version: int) -> None:
        worker.loaded.discard((name, version))
        self._send(self.backend, worker.identity,
                   p.encode_simple(p.Kind.UNLOAD, model=name, version=version))

    def on_loaded(self: "Broker", worker: WorkerState, header: dict[str, Any]) -> None:
        if self.lifecycle.on_loaded(worker, header):
            return  # part of a two-phase swap or a registration trial
        key = (str(header["model"]), int(header["version"]))
        worker.loading.discard(key)
        model = self.catalog.get(key[0])
        if header.get("ok"):
            worker.loaded.add(key)
            worker.load_errors.pop(f"{key[0]}/{key[1]}", None)
            self.metrics.model_loaded(key[0], True, float(header.get("load_s", 0.0)))
            if model is not None and key[1] in model.versions:
                model.ready.add(key[1])
            else:
                self._unload(worker, *key)
            logger.info("worker %s loaded %s/%d in %.2fs", worker.worker_id, key[0], key[1],
                        float(header.get("load_s", 0.0)))
        else:
            worker.load_errors[f"{key[0]}/{key[1]}"] = str(header.get("error"))
            self.metrics.model_loaded(key[0], False, 0.0)
            logger.error("worker %s failed to load %s/%d: %s", worker.worker_id, key[0], key[1],
                         header.get("error"))

    def on_heartbeat(self: "Broker", worker: WorkerState, header: dict[str, Any]) -> None:
        if isinstance(header.get("metrics"), str):
            worker.metrics_text = header["metrics"]
        if isinstance(header.get("memory"), dict):
            worker.memory = header["memory"]

    def _release_if_drained(self: "Broker", worker: WorkerState) -> None:
        """A worker leaving on SIGTERM exits once nothing of ours is in flight on it."""
        if worker.exiting and not worker.inflight:
            recycle = bool(worker.info.get("recycle"))  # memory not returned: restart it
            self._send(self.backend, worker.identity,
                       p.encode_simple(p.Kind.DISCONNECT, reason="drained", restart=recycle))
            self.purge_worker(worker, "drained to restart" if recycle else "drained for shutdown")

    # -- failure handling ---------------------------------------------------
    def purge_worker(self: "Broker", worker: WorkerState, why: str) -> None:
        """Forget a worker; retry its batches once elsewhere while deadlines allow."""
        if self.members.workers.pop(worker.identity, None) is None:
            return
        logger.warning("worker %s removed: %s", worker.worker_id, why)
        for batch_id in sorted(worker.inflight):
            rec = self.inflight.pop(batch_id, None)
            if rec is not None:
                self._retry_or_fail(rec.entries.values(),
                                    f"worker {worker.worker_id} was lost while running this "
                                    f"request ({why})")
        for model in self.catalog.models.values():
            model.ready = {v for v in model.ready
                           if any(w.holds(model.config.name, v)
                                  for w in self.members.workers.values())}
        self.metrics.workers_alive(len(self.members.workers))

    def _retry_or_fail(self: "Broker", entries: Any, why: str) -> None:
        """Queue requests again, once, while their deadlines allow; else a retryable error."""
        now = self.clock()
        for entry in entries:
            pl: Any = entry.payload  # server._Payload
            if pl.attempts < 1 and entry.deadline_s > now and \
                    self.members.holders(entry.model):
                pl.attempts += 1
                entry.version = entry.version if pl.pinned else None
                for victim in self.scheduler.add(entry):
                    self._answer_error(victim, p.ErrorCode.OVERLOADED,
                                       f"queue of model {victim.model!r} is full",
                                       retry_after_s=1.0)
            else:
                self._answer_error(entry, p.ErrorCode.WORKER_LOST, f"{why}; retry")

    def _check_execution_timeouts(self: "Broker", now: float) -> None:
        for rec in [r for r in self.inflight.values() if r.exec_deadline_s <= now]:
            worker = self.members.workers.get(rec.worker)
            self.inflight.pop(rec.batch_id, None)
            for entry in rec.entries.values():
                self._answer_error(entry, p.ErrorCode.DEADLINE,
                                   f"batch ran past max_execution_ms of model {rec.model!r}")
            if worker is not None:
                worker.inflight.discard(rec.batch_id)
                logger.error("worker %s hung on %s batch %d; restarting it",
                             worker.worker_id, rec.model, rec.batch_id)
                self._send(self.backend, worker.identity,
                           p.encode_simple(p.Kind.DISCONNECT, reason="hung", restart=True))
                self.purge_worker(worker, "execution timeout")

    def _heartbeat_workers(self: "Broker", now: float) -> None:
        for worker in self.members.expired(now, self.worker_expiry_s):
            self.purge_worker(worker, "heartbeat expired")
        for worker in list(self.members.workers.values()):
            self._send(self.backend, worker.identity, p.encode_simple(p.Kind.HEARTBEAT))
