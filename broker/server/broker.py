"""The broker process's objects, put together: the worker pool, the scheduler, the
request path, the catalog and its swaps, and the control verbs. The socket loop
(:mod:`loop`) calls the ``on_*`` methods with messages and :meth:`tick` with time;
everything here is sent through the functions it is given, so the same objects run
against real sockets and, in tests, against plain lists.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Iterable

import zmq

from zeroserve.broker import protocol as p
from zeroserve.broker.process import Notifier, trim_memory
from zeroserve.broker.server.cache import DEFAULT_BOUND_BYTES, ResponseCache
from zeroserve.broker.server.admission import Admission
from zeroserve.broker.server.answering import Answering
from zeroserve.broker.server.cachepath import CachedAnswers
from zeroserve.broker.server.catalog import Catalog
from zeroserve.broker.server.configwrite import ConfigWriter
from zeroserve.broker.server.control import ControlTable, model_arg, worker_arg
from zeroserve.broker.server.dispatch import Dispatch
from zeroserve.broker.server.dispatchgate import DispatchGate
from zeroserve.broker.server.extverbs import ExtensionVerbs
from zeroserve.broker.server.forecast import Forecast, Usage
from zeroserve.broker.server.frontdoor import FrontDoor
from zeroserve.broker.server.intake import Intake
from zeroserve.broker.server.latency import LatencyBook
from zeroserve.broker.server.ledger import AnswerLedger
from zeroserve.broker.server.lifecycle import Lifecycle, LifecycleOptions, Rescans
from zeroserve.broker.server.loadretry import LoadRetries
from zeroserve.broker.server.loads import WorkerLoads
from zeroserve.broker.server.membership import Membership
from zeroserve.broker.server.metrics import BreakerStates, BrokerMetrics, CacheSize, ModelStates
from zeroserve.broker.server.memplan import MemoryPlan
from zeroserve.broker.server.memtrace import MemoryTrace
from zeroserve.broker.server.ondemand import OnDemand, OnDemandOptions, OnDemandSets
from zeroserve.broker.server.pipeline import INTERNAL, OnWorkers, Pipelines
from zeroserve.broker.server.placement import Placement
from zeroserve.broker.server.pool import Batches, WorkerPool
from zeroserve.broker.server.breaker import BreakerOptions, Breakers
from zeroserve.broker.server.readverbs import ReadVerbs
from zeroserve.broker.server.registration import Registrar
from zeroserve.broker.server.releases import Releases
from zeroserve.broker.server.replicas import ReplicaSets, Replicas
from zeroserve.broker.server.repoctl import ModelControl, RepositoryControl
from zeroserve.broker.server.results import Results
from zeroserve.broker.server.scheduler import Scheduler
from zeroserve.broker.server.scope import TenantScope
from zeroserve.broker.server.shutdown import Shutdown
from zeroserve.broker.server.stats import ModelStatistics
from zeroserve.broker.server.stopping import StopState
from zeroserve.broker.server.streampath import StreamPath
from zeroserve.broker.server.streams import Streams
from zeroserve.broker.server.tenancy import Tenancy
from zeroserve.broker.server.types import Clock, Send, earliest
from zeroserve.broker.tracesettings import TraceState
from zeroserve.models.repository import RepoModel

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
        self._compose(model_dir, to_client, to_worker, to_controller, clock,
                      ctx or zmq.Context.instance(), heartbeat_s, worker_expiry_s,
                      drain_timeout_s, latency_model, tenants_path, response_cache_bytes,
                      breaker or BreakerOptions(), lifecycle or LifecycleOptions(),
                      on_demand or OnDemandOptions(), max_message_bytes, admin_token, trace)
        self._reload_requested = False
        self._next_heartbeat = 0.0
        self._busy_since_trim = False

    def _compose(self, model_dir: Path, to_client: Send, to_worker: Send, to_controller: Send,
                 clock: Clock, ctx: zmq.Context[Any], heartbeat_s: float,
                 worker_expiry_s: float, drain_timeout_s: float, latency_model: bool,
                 tenants_path: Path | None, cache_bytes: int, breaker: BreakerOptions,
                 opts: LifecycleOptions, demand: OnDemandOptions, max_message_bytes: int,
                 admin_token: str, trace: TraceState | None) -> None:
        """The composition root: every part built here, once, in dependency order, each
        handed the parts (and the ports, typing.Protocols) it asks. Nothing reaches
        through one part to another's parts; the parts the broker's own verbs use are
        its fields."""
        self.metrics = metrics = BrokerMetrics()
        registry = metrics.registry
        self.catalog = catalog = Catalog(model_dir)
        self.scheduler = scheduler = Scheduler()
        batches = Batches(to_worker, clock)     # the batches in flight on the workers
        self.pool = pool = WorkerPool(to_worker, clock, heartbeat_s=heartbeat_s,
                                      expiry_s=worker_expiry_s, batches=batches)
        self.tenancy = tenancy = Tenancy(tenants_path, registry, clock)  # TenantsError
        self.stop = stop = StopState()
        # a stopping broker that drains what it accepted runs the pipelines' next steps
        stop.client_draining(INTERNAL)
        self.cache = cache = ResponseCache(cache_bytes)
        self.stats = stats = ModelStatistics()         # the statistics extension's figures
        self.streams = streams = Streams()             # decoupled models' running requests
        latency = LatencyBook(enabled=latency_model)
        self.forecast = forecast = Forecast(pool, batches, latency)
        self.usage = usage = Usage()
        gate = DispatchGate()                          # when a worker may take a batch
        self.breakers = breakers = Breakers(breaker)
        self.answers = answers = CachedAnswers(cache, catalog, stats, metrics)
        # the request path, around the one answer ledger (admitted, not answered)
        ledger = AnswerLedger((streams.forget, tenancy.release))
        # ensembles: their steps' answers come back through its reply (pipeline.py)
        self.pipelines = pipelines = Pipelines(catalog, ledger, stats, metrics, to_client,
                                               clock)
        reply = pipelines.reply
        self.answering = answering = Answering(catalog, scheduler, pool, batches, latency,
                                               ledger, streams, tenancy, stats, metrics,
                                               reply, clock)
        self.releases = releases = Releases(catalog, pool, clock, registry,
                                            reroute=answering.reroute,
                                            watch_s=breaker.watch_s)
        self.streaming = streaming = StreamPath(streams, batches, catalog, metrics, stats, ledger,
                                                reply, answering, tenancy.completion_tokens)
        # the model lifecycle, built before the strategies that ask it to load: what they
        # decide (which workers hold a model) is kept in tables the worker loads read
        tenure = demand.tenure()   # load on demand writes it, placement reads it
        self.plan = plan = MemoryPlan(catalog, pool, registry)
        self.placement = placement = Placement(
            catalog, pool, plan, metrics, clock, queued=scheduler.depth,
            last_used=usage.last_used, tenure=tenure)
        replica_sets = ReplicaSets()   # autoscaled models: which workers hold them
        demand_sets = OnDemandSets(demand.enabled, tenure, default=replica_sets.placed)
        retries = LoadRetries(opts.load_retry)
        self.loads = loads = WorkerLoads(catalog, pool, placement, retries, metrics, clock,
                                         placed=OnWorkers(demand_sets.placed),
                                         turn=tenure.loading)
        # folders the broker publishes itself, which the lifecycle drains (the registrar
        # tells them, and the lifecycle drives the registrar)
        rescans = Rescans()
        model_control = ModelControl(opts.control_mode, opts.load_models, catalog, rescans)
        self.registrar = registrar = Registrar(catalog, pool, opts.import_roots,
                                               published=model_control.published)
        self.config_writer = ConfigWriter(catalog, model_control.published)
        self.lifecycle = lifecycle = Lifecycle(
            catalog, scheduler, pool, answering, answers, breakers, releases, metrics, clock,
            ctx, placement, registrar, loads, retries, stats=stats, rescans=rescans,
            options=opts, sources=(model_control.source, releases.unretired))
        self.replicas = replicas = Replicas(   # autoscaled models: the scaling decisions
            catalog, pool, scheduler, placement, metrics, replica_sets,
            predict=latency.predictor, swapping=lifecycle.swapping,
            sync_worker=loads.sync_worker, failing=breakers.failing)
        self.ondemand = ondemand = OnDemand(   # models loaded when asked for: where held
            catalog, pool, scheduler, placement, metrics, clock, demand, demand_sets,
            load_placed=loads.load_placed, fail=answering.fail_waiting, tenure=tenure)
        admission = Admission(catalog, scheduler, pool, latency, tenancy, stop, gate,
                              forecast, answers, ondemand)
        self.intake = Intake(catalog, scheduler, ledger, stop, breakers, admission, answers,
                             pipelines, streams, streaming, answering, tenancy, reply, clock)
        self.results = Results(catalog, pool, batches, ledger, answering, streaming, answers,
                               latency, forecast, breakers, releases, stats, metrics, reply,
                               scheduler=scheduler, tenancy=tenancy)
        self.dispatch = Dispatch(catalog, scheduler, pool, batches, latency, gate, forecast, usage,
                                 answering, streams, streaming, tenancy, metrics)
        self.ledger = ledger
        self.repository = repository = RepositoryControl(
            model_control, catalog, pool, stats, lifecycle, demand=ondemand.state)
        registry.register(ModelStates(catalog, demand_sets.on))
        registry.register(CacheSize(cache.describe))
        registry.register(BreakerStates(catalog, breakers.state, clock))
        self.notifier = notifier = Notifier()
        self.shutdown = Shutdown(stop, pool, scheduler, ledger, answering, metrics, notifier,
                                 clock, drain_timeout_s)
        # what a message may hold, per socket: clients' requests are small headers and
        # tensors; control calls carry configs; workers' heartbeats carry metrics text
        self.membership = Membership(
            pool, batches, p.Limits(header_bytes=32 << 20, message_bytes=max_message_bytes),
            self.results, streaming, lifecycle, loads, ondemand, replicas, answering,
            forecast, ledger, stop, metrics, clock)
        self.control = control = ControlTable(admin_token, TenantScope(tenancy, admin_token))
        self._add_verbs()
        repository.add_verbs(control)
        self.extensions = extensions = ExtensionVerbs(catalog, pool, stats, trace)
        extensions.add_verbs(control)
        self.front = FrontDoor(
            p.Limits(message_bytes=max_message_bytes),
            # a push may upload a model file in its header (behind the admin token)
            p.Limits(header_bytes=max(4 << 20, max_message_bytes), message_bytes=0),
            to_client, to_controller, self.intake, answering, replicas, control, extensions,
            stop, clock)

    @property
    def stopping(self) -> bool:
        return self.stop.stopping

    # -- setup --------------------------------------------------------------
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

    # -- the loop's calls -------------------------------------------------------
    def on_frontend(self, client: bytes, frames: list[Any]) -> None:
        self.front.on_frontend(client, frames)

    def on_control(self, client: bytes, frames: list[Any]) -> None:
        self.front.on_control(client, frames)

    def client_gone(self, client: bytes) -> None:
        self.front.client_gone(client)

    def on_backend(self, identity: bytes, frames: list[Any]) -> None:
        self.membership.on_backend(identity, frames)

    def worker_ready(self, identity: bytes, ready: p.WorkerReady, now: float) -> None:
        self.membership.worker_ready(identity, ready, now)

    def worker_connection_closed(self, identity: bytes) -> None:
        self.membership.worker_connection_closed(identity)

    def request_stop(self) -> None:
        self.shutdown.request_stop()

    def finished(self, now: float) -> bool:
        return self.shutdown.finished(now)

    def request_reload(self) -> None:
        self._reload_requested = True

    def on_events(self, events: dict[Any, int]) -> None:
        self.lifecycle.on_events(events)

    def tick(self, now: float) -> None:
        """Everything time-driven, then dispatch."""
        self.shutdown.begin()
        if self._reload_requested:
            self._reload_repository()
        self.dispatch.expire(now)
        self.results.move_stalled(now)
        self.membership.hung(now)
        self.notifier.watchdog(now)
        self.lifecycle.tick(now)
        self.releases.tick(now)
        self.ondemand.settle(now)
        self.replicas.tick(now)
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + self.pool.heartbeat_s
            self._trim_when_idle()
            self.pipelines.sync_ready()
            self.membership.heartbeat(now)
        self.membership.release_drained(now)
        self.shutdown.fail_unservable()
        self.dispatch.dispatch(now)

    def _trim_when_idle(self) -> None:
        """After a burst, once nothing is held, the memory it took goes back (checked at
        each heartbeat; trimming costs milliseconds, so never while requests wait)."""
        if len(self.ledger):
            self._busy_since_trim = True
        elif self._busy_since_trim:
            self._busy_since_trim = False
            trim_memory()

    def next_due(self, now: float) -> float:
        due = earliest((self.dispatch.next_due(now), self.lifecycle.next_due(),
                        self.replicas.next_due(), self.releases.next_due(),
                        self.ondemand.next_due(now), self.shutdown.next_due()))
        return self._next_heartbeat if due is None or due > self._next_heartbeat else due

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
        c.add("census", self.census)
        MemoryTrace().add_verbs(c)   # answers only where ZEROSERVE_TRACEMALLOC started it
        # apart from the census, which is 0 once every request is answered: the cache
        # holds answers for good, within its bound
        c.add("response_cache", lambda _: self.cache.describe())
        c.add("drain", lambda a: self.pool.set_draining(worker_arg(a), True)
              .describe(self.clock()), mutates=True)
        c.add("undrain", lambda a: self.pool.set_draining(worker_arg(a), False)
              .describe(self.clock()), mutates=True)
        c.add("drain_all", self.shutdown.drain_all, mutates=True)
        c.add("undrain_all", self.shutdown.undrain_all, mutates=True)
        c.add("draining", lambda _: {"ok": True})  # a gateway's notice (see on_frontend)
        c.add("restart", self._restart, mutates=True)
        c.add("reload", lambda a: self.lifecycle.reload_model(*model_arg(a)), mutates=True)
        c.add("register", self.registrar.register, mutates=True)
        c.add("register_status", self.registrar.status, mutates=True)
        c.add("unregister", self.registrar.unregister, mutates=True)
        c.add("push", self.registrar.push, mutates=True)
        c.add("configure", self.config_writer.configure, mutates=True)
        c.add("tenants", self.tenancy.describe)
        c.add("reload_tenants", self.tenancy.reload_verb, mutates=True)

    def census(self, _: dict[str, Any] | None = None) -> dict[str, int]:
        """Every structure that holds something of a request, by name and size: each is
        0 once every request has been answered, at any load (the fault tests check it)."""
        return {**self.scheduler.census(), **self.ledger.census(), **self.pool.census(),
                "tenancy.open": self.tenancy.open_count(), **self.pipelines.census(),
                **{f"streams.{k}": n for k, n in self.streams.sizes().items()}}

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
                **self.breakers.describe(name, self.clock())}

    def _status(self) -> dict[str, Any]:
        """The broker's own sections of ``zeroserve status`` (see readverbs.py)."""
        return {"stopping": self.stop.stopping, "open_requests": len(self.ledger),
                "streams": self.streams.sizes(), "tenants": self.tenancy.summary(),
                "autoscaling": self.replicas.describe(),
                "load_on_demand": self.ondemand.summary(self.clock()),
                "memory_plan": self.plan.describe()}
