"""The broker: one process, one thread, one zmq.Poller loop.

It owns the catalog, admits requests, feeds the scheduler, sends batches to
workers with free credits and routes results back. Tensor frames are forwarded
untouched; the loop does no per-sample work. The poll timeout is always the
next thing due (a deadline, a heartbeat, a delayed batch), never a fixed tick.
"""

from __future__ import annotations

import itertools
import logging
import math
import random
import signal
import socket
import time
from pathlib import Path
from typing import Any, Callable

import zmq

from zeroserve.broker import protocol as p
from zeroserve.broker.catalog import Catalog, CatalogModel, RequestError, check_inputs, \
    normalize_priority
from zeroserve.broker.control import ControlHandler
from zeroserve.broker.latency import LatencyBook
from zeroserve.broker.lifecycle import Lifecycle, LifecycleOptions
from zeroserve.broker.membership import Inflight, Membership, WorkerState
from zeroserve.broker.metrics import BrokerMetrics
from zeroserve.broker.operations import Operations
from zeroserve.broker.workforce import Workforce
from zeroserve.broker.runtime import Endpoints, exposed_endpoints
from zeroserve.broker.scheduler import Entry, Scheduler
from zeroserve.broker.sdnotify import Notifier

logger = logging.getLogger(__name__)

Clock = Callable[[], float]


class Broker(Operations, Workforce):
    def __init__(self, endpoints: Endpoints, model_dir: Path, *,
                 heartbeat_s: float = 0.5, worker_expiry_s: float = 2.0,
                 drain_timeout_s: float = 30.0, latency_model: bool = True,
                 clock: Clock = time.monotonic,
                 ctx: zmq.Context[Any] | None = None,
                 lifecycle: LifecycleOptions | None = None) -> None:
        self.endpoints = endpoints
        self.clock = clock
        self.heartbeat_s = heartbeat_s
        self.worker_expiry_s = worker_expiry_s
        self.drain_timeout_s = drain_timeout_s
        self.ctx = ctx or zmq.Context.instance()
        self.catalog = Catalog(model_dir)
        self.scheduler = Scheduler()
        self.members = Membership()
        self.inflight: dict[int, Inflight] = {}
        self.latency = LatencyBook(enabled=latency_model)
        self.metrics = BrokerMetrics()
        self.control = ControlHandler(self)
        self.lifecycle = Lifecycle(self, lifecycle)
        self.rng = random.Random()
        self._batch_ids = itertools.count(1)
        self._next_heartbeat = 0.0
        self.stopping = False
        self._stop_deadline = math.inf
        self.notifier = Notifier()
        self._reload_requested = False

    # -- setup --------------------------------------------------------------
    def bind(self) -> None:
        def router(endpoint: str) -> zmq.Socket[Any]:
            sock = self.ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.bind(endpoint)
            return sock

        self.frontend = router(self.endpoints.frontend)
        self.backend = router(self.endpoints.backend)
        self.ctl = router(self.endpoints.control)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.poller = zmq.Poller()
        # workers first, so replies drain before new work is taken
        self.poller.register(self.backend, zmq.POLLIN)
        self.poller.register(self.frontend, zmq.POLLIN)
        self.poller.register(self.ctl, zmq.POLLIN)
        self.poller.register(self._wake_r, zmq.POLLIN)
        self.lifecycle.start(self.poller)

    def load_catalog(self) -> None:
        self.catalog.rescan()
        for name, model in self.catalog.models.items():
            self.scheduler.set_policy(name, model.policy())
        self.lifecycle.prime()
        for name, err in self.catalog.errors.items():
            logger.error("model %s not served: %s", name, err)
        logger.info("catalog: %s", ", ".join(
            f"{n} v{list(m.versions)}" for n, m in sorted(self.catalog.models.items())) or "empty")

    def install_signal_handlers(self) -> None:
        """Handlers only set a flag; the wakeup fd makes the poller return at once."""
        signal.set_wakeup_fd(self._wake_w.fileno())
        signal.signal(signal.SIGTERM, lambda *_: self.request_stop())
        signal.signal(signal.SIGINT, lambda *_: self.request_stop())
        signal.signal(signal.SIGHUP, lambda *_: setattr(self, "_reload_requested", True))

    def request_stop(self) -> None:
        if not self.stopping:
            self.stopping = True
            self._stop_deadline = self.clock() + self.drain_timeout_s
            self.notifier.stopping()

    def close(self, linger_ms: int = 1000) -> None:
        """Close the sockets; the last answers (shutdown errors) get ``linger_ms`` to
        leave, since a linger of 0 would drop them unsent."""
        for sock in (self.frontend, self.backend, self.ctl):
            sock.close(linger=linger_ms)
        self._wake_r.close()
        self._wake_w.close()
        self.lifecycle.close()

    # -- the loop -----------------------------------------------------------
    def run(self, ready: Callable[[], None] | None = None) -> None:
        if ready:
            ready()
        self.notifier.ready()
        while True:
            now = self.clock()
            if self._reload_requested:
                self.reload_config()
            if self.stopping:
                self._fail_unservable()
            if self.stopping and (not self.inflight and not self._queued()
                                  or now >= self._stop_deadline):
                self._fail_everything(p.ErrorCode.UNAVAILABLE, "broker is shutting down")
                # workers leaving too can go now; the others wait for the next broker
                for worker in self.members.workers.values():
                    self._send(self.backend, worker.identity,
                               p.encode_simple(p.Kind.DISCONNECT, reason="broker stopping"))
                return
            timeout_ms = self._poll_timeout_ms(now)
            events = dict(self.poller.poll(timeout_ms))
            if self._wake_r in events:
                try:
                    self._wake_r.recv(512)
                except BlockingIOError:
                    pass
            if self.backend in events:
                self._drain_socket(self.backend, self.on_backend)
            if self.frontend in events:
                self._drain_socket(self.frontend, self.on_frontend)
            if self.ctl in events:
                self._drain_socket(self.ctl, self.on_control)
            self.lifecycle.on_events(events)
            self.tick(self.clock())

    def _drain_socket(self, sock: zmq.Socket[Any], handler: Callable[[list[Any]], None],
                      budget: int = 256) -> None:
        for _ in range(budget):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            handler(frames)

    def tick(self, now: float) -> None:
        """Everything time-driven, then dispatch."""
        for entry in self.scheduler.expire(now):
            self._answer_error(entry, p.ErrorCode.DEADLINE,
                               "deadline exceeded while queued")
        self._check_execution_timeouts(now)
        self.notifier.watchdog(now)
        self.lifecycle.tick(now)
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + self.heartbeat_s
            self._heartbeat_workers(now)
        self.dispatch(now)

    def _poll_timeout_ms(self, now: float) -> int:
        due = [self._next_heartbeat]
        if (d := self.scheduler.next_deadline()) is not None:
            due.append(d)
        for name in self.scheduler.models_waiting():
            if (d := self.scheduler.next_due(name, now, self.latency.predictor(name))) is not None:
                due.append(d)
        due.extend(rec.exec_deadline_s for rec in self.inflight.values())
        if self.stopping:
            due.append(self._stop_deadline)
        if (d := self.lifecycle.next_due()) is not None:
            due.append(d)  # the watcher's debounce, a swap's timeout
        return max(0, math.ceil((min(due) - now) * 1000))

    # -- frontend -----------------------------------------------------------
    def on_frontend(self, frames: list[Any]) -> None:
        client, msg = frames[0].bytes, frames[1:]
        try:
            kind, header, bufs = p.unpack(msg)
        except p.ProtocolError as exc:
            self._bad_message("frontend", exc)
            return
        if kind is p.Kind.REQUEST:
            self.on_request(client, header, bufs)
        elif kind is p.Kind.CANCEL:
            self.on_cancel(client, header)
        elif kind is p.Kind.PING:
            self._send(self.frontend, client, p.encode_simple(p.Kind.PONG))
        elif kind is p.Kind.CONTROL:
            self._send(self.frontend, client, self.control.handle(header))
        else:
            self._bad_message("frontend", p.ProtocolError(f"unexpected kind {kind.name}"))

    def on_request(self, client: bytes, header: dict[str, Any], bufs: Any) -> None:
        now = self.clock()
        try:
            req = p.decode_request(header, bufs)
        except p.ProtocolError as exc:
            rid = p.request_id_of(header)
            if rid is None:
                self._bad_message("frontend", exc)
            else:
                self._reply_error(client, rid, p.ErrorCode.BAD_INPUT, str(exc), model="")
            return
        model = self.catalog.get(req.model)
        err = self._admission_error(req, model)
        if err is not None:
            code, message = err
            self._reply_error(client, req.request_id, code, message, model=req.model)
            return
        assert model is not None
        cfg = model.config
        try:
            samples = check_inputs(cfg, [t.meta for t in req.tensors], req.outputs)
        except RequestError as exc:
            self._reply_error(client, req.request_id, p.ErrorCode.BAD_INPUT, str(exc),
                              model=req.model)
            return
        priority = normalize_priority(req.priority, cfg)
        timeout_ms = req.timeout_ms or cfg.dynamic_batching.default_timeout_ms
        deadline = now + timeout_ms / 1000.0 if timeout_ms > 0 else math.inf
        predict = self.latency.predictor(req.model)
        holders = len(self.members.holders(req.model))
        wait_s = self.scheduler.estimate_wait(req.model, priority, predict, holders)
        wait_s += min((self._busy_until(w, now) for w in self.members.holders(req.model)),
                      default=now) - now
        if now + wait_s + predict(samples) > deadline:
            self._reply_error(client, req.request_id, p.ErrorCode.DEADLINE,
                              f"deadline of {timeout_ms:g} ms cannot be met: the queue ahead "
                              f"needs about {wait_s * 1000:.1f} ms", model=req.model)
            return
        version = req.version
        if version is None and cfg.traffic:
            version = model.route(self.rng)
        entry = Entry(key=(client, req.request_id), model=req.model, priority=priority,
                      arrival_s=now, deadline_s=deadline, samples=samples, version=version,
                      payload=_Payload(client, req, req.version is not None))
        try:
            shed = self.scheduler.add(entry)
        except KeyError:
            self._reply_error(client, req.request_id, p.ErrorCode.BAD_INPUT,
                              "a request with this id is already queued", model=req.model)
            return
        for victim in shed:
            retry = self.scheduler.estimate_wait(victim.model, 1, predict, holders)
            self._answer_error(victim, p.ErrorCode.OVERLOADED,
                               f"queue of model {victim.model!r} is full",
                               retry_after_s=max(1.0, math.ceil(retry)))

    def _admission_error(self, req: p.InferRequest,
                         model: CatalogModel | None) -> tuple[p.ErrorCode, str] | None:
        if self.stopping:
            return p.ErrorCode.UNAVAILABLE, "broker is shutting down"
        if model is None:
            return p.ErrorCode.NOT_FOUND, f"unknown model {req.model!r}"
        if req.version is not None and req.version not in model.versions:
            return p.ErrorCode.NOT_FOUND, \
                f"version {req.version} of model {req.model!r} is not served"
        if not self.members.holders(req.model, req.version if req.version else None):
            return p.ErrorCode.NO_WORKER, f"no worker has model {req.model!r} loaded"
        return None

    def on_cancel(self, client: bytes, header: dict[str, Any]) -> None:
        rid = header.get("id")
        entry = self.scheduler.cancel((client, rid)) if isinstance(rid, str) else None
        if entry is not None:
            self._answer_error(entry, p.ErrorCode.CANCELLED, "cancelled by the client")

    # -- backend ------------------------------------------------------------
    def on_backend(self, frames: list[Any]) -> None:
        identity, msg = frames[0].bytes, frames[1:]
        try:
            kind, header, bufs = p.unpack(msg)
        except p.ProtocolError as exc:
            self._bad_message("backend", exc)
            return
        now = self.clock()
        worker = self.members.workers.get(identity)
        if worker is not None:
            worker.last_seen_s = now
        try:
            if kind is p.Kind.READY:
                self.on_worker_ready(identity, header, now)
            elif worker is None:
                # a worker we do not know (we restarted, or it was purged): ask it to re-register
                self._send(self.backend, identity,
                           p.encode_simple(p.Kind.DISCONNECT, reason="unknown worker"))
            elif kind is p.Kind.RESULT:
                self.on_result(worker, header, bufs, now)
            elif kind is p.Kind.HEARTBEAT:
                self.on_heartbeat(worker, header)
            elif kind is p.Kind.LOADED:
                self.on_loaded(worker, header)
            elif kind is p.Kind.DISCONNECT:
                logger.info("worker %s leaves: %s", worker.worker_id, header.get("reason"))
                if header.get("drain"):
                    worker.draining = worker.exiting = True
                    worker.info["recycle"] = bool(header.get("recycle"))
                    self._release_if_drained(worker)
                else:
                    self.purge_worker(worker, "worker left")
            else:
                raise p.ProtocolError(f"unexpected kind {kind.name}")
        except (p.ProtocolError, KeyError, TypeError, ValueError) as exc:
            self._bad_message("backend", exc)

    def on_result(self, worker: WorkerState, header: dict[str, Any], bufs: Any,
                  now: float) -> None:
        rec = self.inflight.pop(p.result_batch_id(header), None)
        if rec is None:
            return  # the batch was already failed or retried (its worker was purged)
        worker.inflight.discard(rec.batch_id)
        result = p.decode_result(header, bufs, rec.model, rec.version)
        compute_s = result.compute_ms / 1000.0
        if result.error is not None:
            if result.retry:
                self._retry_or_fail(rec.entries.values(), result.error)
            elif result.expired:
                for entry in rec.entries.values():
                    self._answer_error(entry, p.ErrorCode.DEADLINE, result.error)
            else:
                for entry in rec.entries.values():
                    self._answer_error(entry, p.ErrorCode.MODEL_ERROR, result.error)
            self._release_if_drained(worker)
            return
        self.latency.observe(rec.model, worker.worker_id, rec.samples, compute_s)
        self.metrics.batch_done(rec.model, rec.samples, compute_s)
        for rep in result.replies:
            entry = rec.entries.pop(rep.request_id, None)
            if entry is None:
                continue
            pl: _Payload = entry.payload
            queue_s = rec.sent_s - entry.arrival_s
            self.metrics.request_done(rec.model, rec.version, entry.priority, queue_s,
                                      now - entry.arrival_s)
            stats = {"queue_ms": queue_s * 1000.0, "compute_ms": result.compute_ms,
                     "batch_size": rec.samples}
            self._send(self.frontend, pl.client, p.encode_reply(
                p.InferReply(pl.request.request_id, rec.model, rec.version, rep.tensors, stats)))
        for entry in rec.entries.values():
            self._answer_error(entry, p.ErrorCode.INTERNAL, "worker returned no output")
        self._release_if_drained(worker)

    # -- dispatch -----------------------------------------------------------
    def dispatch(self, now: float) -> None:
        for name in self.scheduler.models_waiting():
            model = self.catalog.get(name)
            if model is None:
                continue
            while True:
                worker = self.members.free_holder(name)
                if worker is None:
                    break
                held = worker.versions_of(name)
                default = model.default_version

                def resolve(e: Entry, held: set[int] = held, default: int = default) -> int | None:
                    v = e.version if e.version is not None else default
                    return v if v in held else None

                predict = self.latency.predictor(name, worker.worker_id)
                decision = self.scheduler.take(name, now, predict, resolve,
                                               start_s=self._busy_until(worker, now))
                if decision is None:
                    break
                for entry in decision.doomed:
                    self._answer_error(entry, p.ErrorCode.DEADLINE,
                                       "deadline cannot be met: the work ahead of this "
                                       "request takes longer than its remaining time")
                if not decision.entries:
                    if decision.doomed:
                        continue
                    break
                self._send_batch(worker, model, decision.entries, decision.reason, now)

    def _busy_until(self, worker: WorkerState, now: float) -> float:
        """When a worker is predicted to finish the batches it already has (they run
        one after another)."""
        cursor = now
        recs = sorted((self.inflight[b] for b in worker.inflight), key=lambda r: r.sent_s)
        for i, rec in enumerate(recs):
            run_s = self.latency.predictor(rec.model, worker.worker_id)(rec.samples)
            cursor = max(cursor, rec.sent_s + run_s) if i == 0 else cursor + run_s
        return cursor

    def _send_batch(self, worker: WorkerState, model: CatalogModel, entries: list[Entry],
                    reason: str, now: float) -> None:
        batch_id = next(self._batch_ids)
        version = entries[0].version
        assert version is not None
        items, by_item = [], {}
        for i, entry in enumerate(entries):
            pl: _Payload = entry.payload
            items.append(p.BatchItem(str(i), pl.request.tensors, pl.request.outputs))
            by_item[str(i)] = entry
        tightest = min(e.deadline_s for e in entries)
        exec_s = model.config.dynamic_batching.max_execution_ms / 1000.0
        samples = sum(e.samples for e in entries)
        rec = Inflight(batch_id, worker.identity, model.config.name, version, by_item, samples,
                       reason, now, now + exec_s if exec_s > 0 else math.inf)
        frames = p.encode_batch(p.Batch(batch_id, model.config.name, version, items,
                                        (tightest - now) * 1000.0 if tightest < math.inf else 0))
        self.inflight[batch_id] = rec
        worker.inflight.add(batch_id)
        self.lifecycle.last_used[model.config.name] = now  # memory budget: LRU eviction
        self.metrics.batch_sent(model.config.name, reason, samples)
        for entry in entries:
            self.metrics.queued(model.config.name, entry.priority, now - entry.arrival_s)
        if not self._send(self.backend, worker.identity, frames):
            self.purge_worker(worker, "unreachable")

    def _fail_everything(self, code: p.ErrorCode, message: str) -> None:
        for name in list(self.scheduler.models_waiting()):
            for entry in self.scheduler.drop_model(name):
                self._answer_error(entry, code, message)
        for rec in list(self.inflight.values()):
            for entry in rec.entries.values():
                self._answer_error(entry, code, message)
        self.inflight.clear()

    def _queued(self) -> bool:
        return bool(self.scheduler.models_waiting())

    # -- sending ------------------------------------------------------------
    def _answer_error(self, entry: Entry, code: p.ErrorCode, message: str,
                      retry_after_s: float | None = None) -> None:
        pl: _Payload = entry.payload
        self._reply_error(pl.client, pl.request.request_id, code, message, entry.model,
                          retry_after_s)

    def _reply_error(self, client: bytes, request_id: str, code: p.ErrorCode, message: str,
                     model: str, retry_after_s: float | None = None) -> None:
        self.metrics.error(model, code)
        self._send(self.frontend, client,
                   p.encode_error(p.ErrorReply(request_id, code, message, retry_after_s)))

    def _send(self, sock: zmq.Socket[Any], identity: bytes, frames: list[Any]) -> bool:
        try:
            sock.send_multipart([identity, *frames], copy=False)
            return True
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the peer went away
            logger.debug("send to %r failed: %s", identity, exc)
            return False

    def _bad_message(self, where: str, exc: Exception) -> None:
        self.metrics.bad_message(where)
        logger.warning("dropped a malformed message on %s: %s", where, exc)


    def on_control(self, frames: list[Any]) -> None:
        client, msg = frames[0].bytes, frames[1:]
        try:
            kind, header, _ = p.unpack(msg)
            if kind is not p.Kind.CONTROL:
                raise p.ProtocolError(f"unexpected kind {kind.name} on the control socket")
        except p.ProtocolError as exc:
            self._bad_message("control", exc)
            return
        self._send(self.ctl, client, self.control.handle(header))


class _Payload:
    __slots__ = ("client", "request", "pinned", "attempts")

    def __init__(self, client: bytes, request: p.InferRequest, pinned: bool) -> None:
        self.client = client
        self.request = request
        self.pinned = pinned
        self.attempts = 0


def run_broker(endpoints: Endpoints, model_dir: Path, args: Any) -> int:
    exposed = exposed_endpoints(endpoints)
    if exposed:
        logger.error("refusing to bind %s: tcp:// beyond loopback needs CurveZMQ keys, which "
                     "this version does not support yet; use ipc:// or a loopback address "
                     "(and an SSH or WireGuard tunnel between hosts)", ", ".join(exposed))
        return 2
    broker = Broker(endpoints, model_dir, heartbeat_s=args.heartbeat_s,
                    worker_expiry_s=args.worker_expiry_s, drain_timeout_s=args.drain_timeout_s,
                    latency_model=args.latency_model == "on",
                    lifecycle=LifecycleOptions(
                        watch=getattr(args, "watch", "inotify"),
                        debounce_s=getattr(args, "watch_debounce_ms", 200) / 1000.0,
                        poll_s=getattr(args, "watch_interval_s", 2.0),
                        import_roots=tuple(Path(r) for r in getattr(args, "import_root", None)
                                           or ())))
    try:
        broker.load_catalog()
    except ValueError as exc:  # ConfigError: the repository folder is missing
        logger.error("%s", exc)
        return 2
    broker.bind()
    broker.install_signal_handlers()
    logger.info("broker listening: frontend %s, backend %s, control %s",
                endpoints.frontend, endpoints.backend, endpoints.control)
    try:
        broker.run()
    finally:
        broker.close()
        broker.ctx.term()  # blocks until the last answers have left (bounded by linger)
    logger.info("broker stopped")
    return 0
