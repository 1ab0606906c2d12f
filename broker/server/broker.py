"""The broker process's objects, put together: the worker pool, the scheduler, the
request path, the catalog and its swaps, and the control verbs. The socket loop
(:mod:`loop`) calls the ``on_*`` methods with messages and :meth:`tick` with time;
everything here is sent through the functions it is given, so the same objects run
against real sockets and, in tests, against plain lists.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import zmq

from zeroserve.broker import protocol as p
from zeroserve.broker.process import Notifier, trim_memory
from zeroserve.broker.server.cache import DEFAULT_BOUND_BYTES, ResponseCache
from zeroserve.broker.server.catalog import Catalog
from zeroserve.broker.server.configwrite import ConfigWriter
from zeroserve.broker.server.control import ControlTable, model_arg, worker_arg
from zeroserve.broker.server.extverbs import ExtensionVerbs
from zeroserve.broker.server.latency import LatencyBook
from zeroserve.broker.server.lifecycle import Lifecycle, LifecycleOptions
from zeroserve.broker.server.metrics import BreakerStates, BrokerMetrics, CacheSize, ModelStates
from zeroserve.broker.server.memplan import MemoryPlan
from zeroserve.broker.server.ondemand import OnDemand, OnDemandOptions
from zeroserve.broker.server.placement import Placement
from zeroserve.broker.server.pool import Loss, WorkerPool, WorkerState
from zeroserve.broker.server.breaker import CLOSED, BreakerOptions, Breakers
from zeroserve.broker.server.readverbs import ReadVerbs
from zeroserve.broker.server.registration import Registrar
from zeroserve.broker.server.releases import Releases
from zeroserve.broker.server.replicas import Replicas
from zeroserve.broker.server.repoctl import RepositoryControl
from zeroserve.broker.server.requests import RequestPath
from zeroserve.broker.server.scheduler import Scheduler
from zeroserve.broker.server.scope import TenantScope
from zeroserve.broker.server.stopping import StopState
from zeroserve.broker.server.tenancy import Tenancy
from zeroserve.broker.server.types import Clock, Send
from zeroserve.broker.tracesettings import TraceState
from zeroserve.models.repository import ModelConfig, RepoModel

logger = logging.getLogger(__name__)


class Broker:
    def __init__(self, model_dir: Path, *, to_client: Send, to_worker: Send,
                 to_controller: Send, heartbeat_s: float = 0.5, worker_expiry_s: float = 2.0,
                 drain_timeout_s: float = 30.0, latency_model: bool = True,
                 clock: Clock = time.monotonic, ctx: zmq.Context[Any] | None = None,
                 lifecycle: LifecycleOptions | None = None, admin_token: str = "",
                 tenants_path: Path | None = None, max_message_bytes: int = 256 << 20,
                 trace: TraceState | None = None,
                 response_cache_bytes: int = DEFAULT_BOUND_BYTES,
                 on_demand: OnDemandOptions | None = None,
                 breaker: BreakerOptions | None = None) -> None:
        self.clock = clock
        # what a message may hold, per socket: clients' requests are small headers and
        # tensors; control calls carry configs; workers' heartbeats carry metrics text
        self.limits = {
            "frontend": p.Limits(message_bytes=max_message_bytes),
            # a push may upload a model file in its header (behind the admin token)
            "control": p.Limits(header_bytes=max(4 << 20, max_message_bytes), message_bytes=0),
            "backend": p.Limits(header_bytes=32 << 20, message_bytes=max_message_bytes)}
        self.drain_timeout_s = drain_timeout_s
        self._to_client = to_client
        self._to_controller = to_controller
        self.metrics = BrokerMetrics()
        self.catalog = Catalog(model_dir)
        self.metrics.registry.register(ModelStates(lambda: self.catalog.models,
                                                   lambda cfg: self.ondemand.on(cfg)))
        self.scheduler = Scheduler()
        self.pool = WorkerPool(to_worker, clock, heartbeat_s=heartbeat_s,
                               expiry_s=worker_expiry_s)
        self.tenancy = Tenancy(tenants_path, self.metrics.registry, clock)  # TenantsError
        self.stop = StopState()
        cache = ResponseCache(response_cache_bytes)
        self.metrics.registry.register(CacheSize(cache.describe))
        breaker = breaker or BreakerOptions()
        self.releases = Releases(self.catalog, self.pool, clock, self.metrics.registry,
                                 reroute=lambda name, gone, to: self.requests.reroute(
                                     name, gone, to), watch_s=breaker.watch_s)
        breakers = Breakers(breaker)
        self.metrics.registry.register(BreakerStates(lambda: self.catalog.models,
                                                     breakers.state))
        self.requests = RequestPath(self.catalog, self.scheduler, self.pool,
                                    LatencyBook(enabled=latency_model), self.metrics, to_client,
                                    self.tenancy, self.stop, clock, cache, self.releases,
                                    breakers)
        self.lifecycle = self._compose(clock, ctx or zmq.Context.instance(),
                                       lifecycle or LifecycleOptions(),
                                       on_demand or OnDemandOptions())
        self.control = ControlTable(admin_token, TenantScope(self.tenancy, admin_token))
        self._add_verbs()
        self.repository.add_verbs(self.control)
        self.extensions = ExtensionVerbs(self.catalog, self.pool, self.requests.stats, trace)
        self.extensions.add_verbs(self.control)
        self.notifier = Notifier()
        self._stop_requested = False
        self._exit_requested = False
        self._stop_deadline = math.inf
        self._left_s: dict[bytes, float] = {}      # when a worker said it shuts down
        self._reload_requested = False
        self._next_heartbeat = 0.0
        self._busy_since_trim = False

    def _compose(self, clock: Clock, ctx: zmq.Context[Any], opts: LifecycleOptions,
                 demand: OnDemandOptions) -> Lifecycle:
        """The model lifecycle and its strategies, each given what it reads and
        callbacks for what it asks (the lifecycle's, bound late: it is built last)."""
        tenure = demand.tenure()   # load on demand writes it, placement reads it
        self.plan = MemoryPlan(self.catalog, self.pool, self.metrics.registry)
        self.placement = Placement(self.catalog, self.pool, self.plan, self.metrics, clock,
                                   queued=self.scheduler.depth,
                                   last_used=self.requests.last_used, tenure=tenure)
        self.replicas = Replicas(   # autoscaled models: which workers hold them
            self.catalog, self.pool, self.scheduler, self.placement, self.metrics,
            predict=self.requests.latency.predictor,
            swapping=lambda name: name in self.lifecycle.swaps,
            sync_worker=lambda worker: self.lifecycle.sync_worker(worker),
            failing=lambda name: self.requests.breakers.state(name) != CLOSED)
        self.ondemand = OnDemand(   # models loaded when asked for: where they are held
            self.catalog, self.pool, self.scheduler, self.placement, self.metrics, clock,
            demand, load_placed=lambda worker, name: self.lifecycle.load_placed(worker, name),
            fail=self.requests.fail_waiting, default=self.replicas.placed, tenure=tenure)
        self.requests.admission.use_demand(self.ondemand)
        self.repository = RepositoryControl(
            opts.control_mode, opts.load_models, self.catalog, self.pool,
            self.requests.stats, load_now=lambda rm, vs: self.lifecycle.load_now(rm, vs),
            remove=lambda name, why: self.lifecycle.remove_model(name, why),
            rescan=lambda name: self.lifecycle.rescan_one(name),
            busy=lambda name: self.lifecycle.busy(name), demand=self.ondemand.state)
        self.registrar = Registrar(self.catalog, self.pool, opts.import_roots,
                                   published=self.repository.published)
        return Lifecycle(self.catalog, self.scheduler, self.pool, self.requests, self.metrics,
                         clock, ctx, self.placement, self.registrar, options=opts,
                         placed=self._placed, turn=lambda name: self.ondemand.loading(name),
                         source=lambda found: self.releases.unretired(
                             self.repository.source(found)))

    def _placed(self, cfg: ModelConfig, worker: WorkerState) -> bool:
        """An ensemble is never loaded on a worker: the broker runs it (pipeline.py)."""
        return not cfg.ensemble and self.ondemand.placed(cfg, worker)

    @property
    def stopping(self) -> bool:
        return self.stop.stopping

    # -- setup --------------------------------------------------------------
    def load_catalog(self) -> None:
        """At startup: read the repository and hash what it serves (before serving)."""
        self.catalog.rescan()
        self.repository.prime()   # explicit model control: only what --load-model names
        for name, model in self.catalog.models.items():
            self.scheduler.set_policy(name, model.policy())
        self.lifecycle.prime()
        for name, err in self.catalog.errors.items():
            logger.error("model %s not served: %s", name, err)
        logger.info("catalog: %s", ", ".join(
            f"{n} v{list(m.versions)}" for n, m in sorted(self.catalog.models.items())) or "empty")

    def add_model(self, rm: RepoModel, shas: dict[int, str], ready: Iterable[int] = ()) -> None:
        """Serve ``rm`` as committed at once, without a swap, with ``ready`` routable: how
        a model enters a broker that did not scan it from its repository (the tests')."""
        model, _ = self.catalog.commit(rm, shas, ready)
        self.scheduler.set_policy(rm.config.name, model.policy())

    def start(self, poller: zmq.Poller) -> None:
        self.lifecycle.start(poller)
        self.notifier.ready()

    def close(self) -> None:
        self.lifecycle.close()
        self.repository.close()

    def request_stop(self) -> None:
        """SIGTERM: stop admitting, finish what was accepted, then exit. Only sets flags:
        a signal handler may run in the middle of a tick, so the change itself happens
        at the next one (:meth:`_begin_stop`)."""
        self._exit_requested = self._stop_requested = True

    def _begin_stop(self) -> None:
        """The one stop path, for SIGTERM and ``drain --all`` alike (that one without
        exiting): no new work, everything accepted dispatched, and workers that were
        signalled with us kept at work until it is answered."""
        if not self._stop_requested:
            return
        self._stop_requested = False
        if self._exit_requested and not self.stop.exiting:
            self.stop.exit()
            self._stop_deadline = self.clock() + self.drain_timeout_s
            self.notifier.stopping()
        if self.stop.stopping:
            return
        self.stop.halt()
        kept = [w for w in self.pool.workers.values() if w.exiting and not w.recycle]
        for worker in kept:  # signalled with us: they run our queue until it is done
            self.pool.keep(worker)
        logger.info("%s: %d request(s) to finish, %d leaving worker(s) kept until then",
                    "stopping" if self.stop.exiting else "draining all",
                    self.requests.open_count(), len(kept))

    def _drain_all(self, _: dict[str, Any]) -> dict[str, Any]:
        self._stop_requested = True
        self._begin_stop()
        return {"draining": True, "open_requests": self.requests.open_count()}

    def _undrain_all(self, _: dict[str, Any]) -> dict[str, Any]:
        if self.stop.exiting:
            raise LookupError("the broker is stopping and cannot be undrained")
        self.stop.resume()
        self.pool.drain_leavers()
        logger.info("undrained: admitting requests again")
        return {"draining": False, "open_requests": self.requests.open_count()}

    def request_reload(self) -> None:
        self._reload_requested = True

    # -- frontend -----------------------------------------------------------
    def on_frontend(self, client: bytes, frames: list[Any]) -> None:
        """A client's message. One that cannot be used but names its requests (or its
        control call) answers each of them with what is wrong, then counts as malformed."""
        try:
            self._on_frontend(client, frames)
        except (p.Refused, p.VersionMismatch) as exc:   # the latter: say which we speak
            ids = exc.ids if isinstance(exc, p.Refused) else p.ids_of(exc.header)
            code = exc.code if isinstance(exc, p.Refused) else p.ErrorCode.BAD_INPUT
            if bytes(frames[0]) == p.Kind.CONTROL.value:   # answered as the call expects
                for call_id in ids:
                    self._to_client(client, p.encode(p.ControlReply(
                        call_id, False, code=code.value, error=str(exc)[:500])))
            else:
                self.requests.refuse_ids(client, ids, code, str(exc))
            raise

    def _on_frontend(self, client: bytes, frames: list[Any]) -> None:
        kind, header, bufs = p.unpack(frames, self.limits["frontend"])
        if kind is p.Kind.REQUEST or kind is p.Kind.REQUESTS:
            if kind is p.Kind.REQUEST:
                self.replicas.arrived(header.get("model"))   # offered load, refused or not
                self.requests.on_request(client, header, bufs, self.clock())
            else:
                parts = header.get("requests")
                for part in parts if isinstance(parts, list) else ():
                    self.replicas.arrived(part.get("model") if isinstance(part, dict) else None)
                self.requests.on_requests(client, header, bufs, self.clock())
        elif kind is p.Kind.CANCEL:
            self.requests.on_cancel(client, p.decode(p.Cancel, header).request_id)
        elif kind is p.Kind.PING:
            self._to_client(client, p.encode(self.extensions.pong()))
        elif kind is p.Kind.CONTROL:
            msg = self._control_request(header, lambda f: self._to_client(client, f))
            if msg.verb == "draining":
                self._client_draining(client)
            self._to_client(client, self.control.handle(msg, on_frontend=True))
        else:
            raise p.ProtocolError(f"unexpected kind {kind.name} on the frontend")

    def _client_draining(self, client: bytes) -> None:
        """A gateway stopping: what it forwards from now on comes from connections opened
        before its signal, which a stopping broker still takes. It says so on the socket
        its requests use, so the notice precedes them."""
        self.stop.client_draining(client)
        logger.info("a gateway drains its open connections; its requests stay admitted")

    def client_gone(self, client: bytes) -> None:
        self.stop.client_gone(client)
        withdrawn = self.requests.client_gone(client)
        if withdrawn:
            logger.info("a client went away; %d queued request(s) withdrawn", withdrawn)

    def on_control(self, client: bytes, frames: list[Any]) -> None:
        def answer(reply: list[Any]) -> None:
            self._to_controller(client, reply)
        try:
            kind, header, _ = p.unpack(frames, self.limits["control"])
        except (p.Refused, p.VersionMismatch) as exc:
            ids = exc.ids if isinstance(exc, p.Refused) else p.ids_of(exc.header)
            code = exc.code if isinstance(exc, p.Refused) else p.ErrorCode.BAD_INPUT
            for call_id in ids:
                answer(p.encode(p.ControlReply(call_id, False, code=code.value,
                                               error=str(exc)[:500])))
            raise
        if kind is p.Kind.PING:  # a long-lived controller (the gateway) watching us
            answer(p.encode(self.extensions.pong()))
            return
        if kind is not p.Kind.CONTROL:
            raise p.ProtocolError(f"unexpected kind {kind.name} on the control socket")
        answer(self.control.handle(self._control_request(header, answer), on_frontend=False))

    @staticmethod
    def _control_request(header: dict[str, Any],
                         answer: Callable[[list[Any]], Any]) -> p.ControlRequest:
        """The call, or (a field of the wrong type) its error answered when it has an id."""
        try:
            msg: p.ControlRequest = p.decode(p.ControlRequest, header)
            return msg
        except p.ProtocolError as exc:
            call_id = p.request_id_of(header)
            if call_id is not None:
                answer(p.encode(p.ControlReply(call_id, False, code="bad_input",
                                               error=str(exc)[:500])))
            raise

    # -- backend ------------------------------------------------------------
    def on_backend(self, identity: bytes, frames: list[Any]) -> None:
        kind, header, bufs = p.unpack(frames, self.limits["backend"])
        now = self.clock()
        if kind is p.Kind.READY:
            self.worker_ready(identity, p.decode(p.WorkerReady, header), now)
            return
        worker = self.pool.get(identity)
        if worker is None:
            # a worker we do not know (we restarted, or removed it): it registers again
            self.pool.disconnect(identity, p.DisconnectReason.UNKNOWN_WORKER)
            return
        self.pool.heard(worker, now)
        if kind is p.Kind.RESULT:
            self.requests.on_result(worker, header, bufs, now)
        elif kind is p.Kind.PARTIAL:
            self.requests.streaming.on_partial(worker, header, bufs, now)
        elif kind is p.Kind.STEPS:
            self.requests.streaming.on_steps(worker, header, bufs, now)
        elif kind is p.Kind.HEARTBEAT:
            self.pool.beat(worker, p.decode(p.WorkerHeartbeat, header))
        elif kind is p.Kind.LOADED:
            loaded = p.decode(p.ModelLoaded, header)
            self.lifecycle.on_loaded(worker, loaded)
            self.requests.warmed_up(worker, loaded)
            self.ondemand.settle(now)
        elif kind is p.Kind.LEAVE:
            self._on_leave(worker, p.decode(p.Leave, header))
        elif kind is p.Kind.WAITING:   # its freed credit is used by this round's dispatch
            self.pool.waits(worker, p.decode(p.Waiting, header).batch_id)
        else:
            raise p.ProtocolError(f"unexpected kind {kind.name} on the backend")

    def worker_ready(self, identity: bytes, ready: p.WorkerReady, now: float) -> None:
        """A worker registers. Once per process: a READY from a process already registered
        (it answered an "unknown worker" to a message sent before its first READY was
        read) changes nothing, where it used to re-queue what had just been sent to it.
        A worker id is one process's: another live process's claim to it is refused,
        naming both, and never takes it over."""
        old = self.pool.get(identity)
        if old is not None:
            if (old.info.get("pid"), old.info.get("host")) == (ready.pid, ready.host):
                return
            self._lose(old, Loss.REREGISTERED)   # its connection taken over by a new process
        twin = self.pool.by_id(ready.worker_id) if ready.worker_id else None
        if twin is not None and self.pool.alive(twin, now):
            detail = (f"worker id {ready.worker_id!r} is held by pid {twin.info.get('pid')} "
                      f"on {twin.info.get('host') or '?'}; pid {ready.pid} on "
                      f"{ready.host or '?'} was refused (give each worker its own --index "
                      "or --worker-id)")
            logger.error("%s", detail)
            self.metrics.bad_message("backend", "duplicate_worker_id")
            self.pool.disconnect(identity, p.DisconnectReason.DUPLICATE_ID, detail=detail)
            return
        if twin is not None:   # silent past its expiry: its successor takes its place
            self._lose(twin, Loss.REREGISTERED)
        worker = self.pool.register(identity, ready, now)
        self.metrics.worker_registered(worker.worker_id)
        self.replicas.adopt(worker)
        self.ondemand.adopt(worker)
        self.lifecycle.sync_worker(worker)
        self.metrics.workers_alive(len(self.pool.workers))

    def _on_leave(self, worker: WorkerState, msg: p.Leave) -> None:
        logger.info("worker %s leaves: %s %s", worker.worker_id, msg.reason.value, msg.detail)
        if not msg.drain:
            self._lose(worker, Loss.LEFT)
            return
        recycle = msg.reason is p.LeaveReason.RECYCLE
        if recycle:
            self.metrics.worker_recycled(worker.worker_id)
        self.pool.leave(worker, recycle=recycle)
        if self.stopping and not recycle:
            # the whole server stops: keep it until what we accepted is answered
            self.pool.keep(worker)
            logger.info("worker %s kept until the broker's queue is done", worker.worker_id)
        elif not recycle:
            self._left_s[worker.identity] = self.clock()

    def worker_connection_closed(self, identity: bytes) -> None:
        worker = self.pool.get(identity)
        if worker is not None:
            self._lose(worker, Loss.CRASHED)

    def _lose(self, worker: WorkerState, loss: Loss) -> None:
        self._left_s.pop(worker.identity, None)
        lost = self.pool.remove(worker, loss)
        self.metrics.worker_lost(worker.worker_id, loss.name.lower())
        self.requests.worker_lost(lost, loss, worker.worker_id, self.clock())
        self.requests.worker_gone(worker.worker_id)
        self.lifecycle.worker_removed(worker.worker_id)
        self.ondemand.worker_lost(worker)
        self.metrics.workers_alive(len(self.pool.workers))

    # -- time ---------------------------------------------------------------
    def on_events(self, events: dict[Any, int]) -> None:
        self.lifecycle.on_events(events)

    def tick(self, now: float) -> None:
        """Everything time-driven, then dispatch."""
        self._begin_stop()
        if self._reload_requested:
            self._reload_repository()
        self.requests.expire(now)
        self.requests.move_stalled(now)
        for identity in self.requests.overdue(now):
            worker = self.pool.get(identity)
            if worker is not None:
                logger.error("worker %s hung past max_execution_ms; restarting it",
                             worker.worker_id)
                self.pool.disconnect(identity, p.DisconnectReason.HUNG, restart=True)
                self._lose(worker, Loss.HUNG)
        self.notifier.watchdog(now)
        self.lifecycle.tick(now)
        self.releases.tick(now)
        self.ondemand.settle(now)
        self.replicas.tick(now)
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + self.pool.heartbeat_s
            self._trim_when_idle()
            self.requests.pipelines.sync_ready()
            for worker in self.pool.heartbeat(now):
                self._lose(worker, Loss.SILENT)
        self._release_drained(now)
        if self.stopping:
            self._fail_unservable()
        self.requests.dispatch(now)

    def _release_drained(self, now: float) -> None:
        """Leaving workers with nothing in flight go, except those a stopping broker keeps
        (they leave when it exits). One that left on SIGTERM waits a heartbeat first: the
        same signal may be on its way to us (a process group, a systemd target), and then
        it stays to run our queue instead of leaving it stranded."""
        for worker in self.pool.drained():
            if self.stopping and not worker.draining and self.requests.open_count():
                continue
            if not self.stopping and now < self._left_s.get(worker.identity, -math.inf) \
                    + self.pool.heartbeat_s:
                continue
            self._left_s.pop(worker.identity, None)
            self.pool.release(worker)
            self.requests.worker_gone(worker.worker_id)
            self.metrics.workers_alive(len(self.pool.workers))

    def _trim_when_idle(self) -> None:
        """After a burst, once nothing is held, the memory it took goes back (checked at
        each heartbeat; trimming costs milliseconds, so never while requests wait)."""
        if self.requests.open_count():
            self._busy_since_trim = True
        elif self._busy_since_trim:
            self._busy_since_trim = False
            trim_memory()

    def next_due(self, now: float) -> float:
        due = [self._next_heartbeat]
        for d in (self.requests.next_due(now), self.lifecycle.next_due(),
                  self.replicas.next_due(), self.releases.next_due(),
                  self.ondemand.next_due(now)):
            if d is not None:
                due.append(d)
        if self.stop.exiting:
            due.append(self._stop_deadline)
        return min(due)

    def finished(self, now: float) -> bool:
        """Whether a stopping broker may exit: everything it accepted is answered, or the
        drain bound passed (what is left gets 503). Workers that stop too are told."""
        self._begin_stop()
        if not self.stop.exiting or (self.requests.open_count() and now < self._stop_deadline):
            return False
        left = self.requests.open_count()
        if left:
            self.metrics.shutdown_failed(left)
            logger.error("drain bound of %.0fs passed: %d request(s) answered 503",
                         self.drain_timeout_s, left)
        self.requests.fail_everything(p.ErrorCode.UNAVAILABLE, "broker is shutting down")
        for worker in list(self.pool.workers.values()):
            # a worker stopping with us exits on this; the others wait for the next broker
            self.pool.disconnect(worker.identity, p.DisconnectReason.BROKER_STOPPING)
        logger.info("every accepted request answered; releasing %d worker(s)",
                    len(self.pool.workers))
        return True

    def _fail_unservable(self) -> None:
        """While stopping, queued work that no staying worker can take fails now."""
        for name in list(self.scheduler.models_waiting()):
            if not any(w.holds(name) and not w.draining for w in self.pool.workers.values()):
                self.requests.fail_queued(name, p.ErrorCode.UNAVAILABLE,
                                          "broker is shutting down and no worker can take this")

    def _reload_repository(self) -> None:
        """SIGHUP: the watcher's path for the whole repository (hashed off the loop,
        swapped in two phases), and every worker brought in line with it."""
        self._reload_requested = False
        self.notifier.reloading()
        self.tenancy.reload_quietly()
        logger.info("reloading the model repository")
        self.lifecycle.reload_repository()
        self.notifier.ready()

    # -- control verbs ------------------------------------------------------
    def _add_verbs(self) -> None:
        c = self.control
        ReadVerbs(self.catalog, self.pool, self.scheduler, self.metrics, self.clock,
                  describe_model=self._describe_model, status=self._status).add_verbs(c)
        self.releases.add_verbs(c)
        c.add("census", lambda _: self.requests.census())
        # apart from the census, which is 0 once every request is answered: the cache
        # holds answers for good, within its bound
        c.add("response_cache", lambda _: self.requests.answers.cache.describe())
        c.add("drain", lambda a: self.pool.set_draining(worker_arg(a), True)
              .describe(self.clock()), mutates=True)
        c.add("undrain", lambda a: self.pool.set_draining(worker_arg(a), False)
              .describe(self.clock()), mutates=True)
        c.add("drain_all", self._drain_all, mutates=True)
        c.add("undrain_all", self._undrain_all, mutates=True)
        c.add("draining", lambda _: {"ok": True})  # a gateway's notice (see on_frontend)
        c.add("restart", self._restart, mutates=True)
        c.add("reload", lambda a: self.lifecycle.reload_model(*model_arg(a)), mutates=True)
        c.add("register", self.registrar.register, mutates=True)
        c.add("register_status", self.registrar.status, mutates=True)
        c.add("unregister", self.registrar.unregister, mutates=True)
        c.add("push", self.registrar.push, mutates=True)
        c.add("configure", ConfigWriter(self.catalog, self.repository.published).configure,
              mutates=True)
        c.add("tenants", self.tenancy.describe)
        c.add("reload_tenants", self.tenancy.reload_verb, mutates=True)

    def _restart(self, args: dict[str, Any]) -> dict[str, Any]:
        """Drain a worker, then let it exit cleanly so its supervisor starts it again."""
        worker = self.pool.named(worker_arg(args))
        logger.info("worker %s restarting by the operator after %d batch(es)",
                    worker.worker_id, len(worker.inflight))
        described = worker.describe(self.clock())
        self.pool.leave(worker)
        return described

    def _describe_model(self, name: str) -> dict[str, Any]:
        return {**self.lifecycle.describe(name), **self.releases.describe(name),
                **self.ondemand.describe(name),
                **self.requests.breakers.describe(name, self.clock())}

    def _status(self) -> dict[str, Any]:
        """The broker's own sections of ``zeroserve status`` (see readverbs.py)."""
        return {"stopping": self.stopping, "open_requests": self.requests.open_count(),
                "streams": self.requests.streams.sizes(), "tenants": self.tenancy.summary(),
                "autoscaling": self.replicas.describe(),
                "load_on_demand": self.ondemand.summary(self.clock()),
                "memory_plan": self.plan.describe()}
