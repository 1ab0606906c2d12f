"""The worker process: one per GPU (or N on a CPU host).

Threads, so heartbeats flow while a batch runs:
  * the compute thread reads the DEALER to the broker while it is idle and runs each
    batch it reads at once, in the thread that received it, then sends the result: at
    one request at a time a hand-off to another thread cost a wake-up and the GIL's
    passing on every batch (mlp, direct C=1: see the commit that made it so). A LOAD
    or UNLOAD it reads goes to the loader, every other message to the main thread;
  * the main thread heartbeats, keeps the timers (broker expiry, drain, watchdog) and
    handles everything but batches. It reads the DEALER itself while a batch runs that
    streams (its STOPs must be read meanwhile), or that may run past TAKEOVER_S (its
    version's last batch says so, or it is the first), or that has run past it (found
    within a heartbeat): so a long or hung batch never leaves the broker unheard (its
    restart order is read), and what comes behind it is read on arrival, where
    deadlines count from. Batches it reads queue for the compute thread;
  * the loader thread loads and warms up versions, so the old version keeps
    serving while a new one loads, and sends each answer itself: under load on
    demand a host churns through loads, and each hop between threads was a wake-up
    on every one of them.
How the threads share the broker's socket is workers/channel.py's to say and to
keep. torch releases the GIL inside its kernels, so the threads overlap.
"""

from __future__ import annotations

import collections
import functools
import gc
import itertools
import logging
import math
import os
import queue
import secrets
import select
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import torch
import zmq
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from zeroserve.broker import curve, protocol as p
from zeroserve.broker.liveness import AliveFile
from zeroserve.broker.logsettings import LogSettings, SettingsError
from zeroserve.broker.process import Notifier, RateLimitedLog
from zeroserve.models import handlers
from zeroserve.models.loader import LoadError, LoadedModel, load, transient
from zeroserve.models.repository import parse_config
from zeroserve.workers import batching, bls, discovery, gpustats, memory, streaming
from zeroserve.workers.sequences import SequenceTable
from zeroserve.workers.hostcache import DEFAULT_HOST_CACHE_BYTES, HostCache, files_stamp
from zeroserve.workers.callers import CallerThreads
from zeroserve.workers.channel import BrokerChannel, drain
from zeroserve.workers.memory import rss_bytes

logger = logging.getLogger(__name__)

_STOP = object()
# A batch that may run this long has the main thread read the broker's socket meanwhile;
# shorter ones (mlp's, about 0.1-0.5 ms at batch 1) keep the wake-up it costs off them.
TAKEOVER_S = 0.05
Job = tuple[p.Batch, float]   # a batch and the deadline by which it must start
# How far memory may stay above its pre-load level after an unload before the worker is
# recycled; tests/workers/test_memory.py measures the real drift of mlp cycles (a few MB).
DEFAULT_MEMORY_TOLERANCE_BYTES = 64 << 20
RECYCLE_EXIT_CODE = 75


def _is_batch(frames: list[Any]) -> bool:
    return len(frames) >= 2 and bytes(frames[0]) == p.Kind.BATCH.value


_LOADER_KINDS = {p.Kind.LOAD.value: p.LoadModel, p.Kind.UNLOAD.value: p.UnloadModel}


class Worker:
    def __init__(self, endpoint: str, worker_id: str, *, credits: int = 2,
                 heartbeat_s: float = 0.5, broker_expiry_s: float = 3.0,
                 drain_timeout_s: float = 30.0, device: str | None = None,
                 memory_tolerance_bytes: int = DEFAULT_MEMORY_TOLERANCE_BYTES,
                 memory_budget_bytes: int = 0, memory_headroom_bytes: int | None = None,
                 host_cache_bytes: int = DEFAULT_HOST_CACHE_BYTES,
                 ctx: zmq.Context[Any] | None = None,
                 curve_keys: curve.ClientKeys | None = None,
                 spans: Any = None, frontend: str | None = None,
                 alive: AliveFile | None = None) -> None:
        self.endpoint = endpoint
        self.alive = alive   # touched at each heartbeat: what `zeroserve probe worker` reads
        self.curve_keys = curve_keys  # for a broker on tcp:// with CurveZMQ
        self.spans = spans   # opentelemetry mode: a workers/spans.py BatchSpans
        self.worker_id = worker_id
        self.credits = credits
        self.heartbeat_s = heartbeat_s
        self.min_broker_expiry_s = self.broker_expiry_s = broker_expiry_s
        self.device = device or ("cuda:0" if torch.cuda.is_available() else "cpu")
        self.ctx = ctx or zmq.Context.instance()
        # written by the loader thread, read by the others: iterate only under the lock
        self.models: dict[tuple[str, int], LoadedModel] = {}
        self._models_lock = threading.Lock()
        # batches the main thread read while the compute thread ran one, for it to run next
        self._jobs: collections.deque[Job] = collections.deque()
        # what either thread read that is neither its batch nor the loader's, for the main
        # thread, in order
        self._inbox: collections.deque[list[Any]] = collections.deque()
        self._busy_since: float | None = None   # the compute thread's batch began then
        self._handed = False      # it runs a stream or a long batch: the main thread reads
        self._last_run: dict[tuple[str, int], tuple[float, float]] = {}  # seconds, units
        self._closing = False
        self._loads: queue.Queue[Any] = queue.Queue()
        # stream batches received and not finished -> their items the broker answered
        # already (STOP); the main thread adds, the compute thread reads and forgets
        self._stops: dict[int, set[str]] = {}
        self._stops_lock = threading.Lock()
        # iterative models' running sequences, by the loaded version they run on (the
        # compute thread's alone); while one is busy the compute thread steps it between
        # the batches it runs, and the main thread reads the socket
        self._tables: dict[int, SequenceTable] = {}
        self._seq_ids = itertools.count(1)
        self.drain_timeout_s = drain_timeout_s
        self.stopping = False
        self._draining = False
        self._stop_deadline = float("inf")
        self._exit: int | None = None
        self.notifier = Notifier()
        self.log_settings = LogSettings()
        self._registered = False  # the broker has heartbeated us since our READY
        self._identity = f"{worker_id}#{os.getpid()}.{secrets.token_hex(4)}".encode()
        self._retry_ready_s = math.inf   # refused as a duplicate id: when to try again
        self._broker_stopped = False  # it said BROKER_STOPPING and no broker spoke since
        self.memory_tolerance_bytes = memory_tolerance_bytes
        self.memory_budget_bytes = memory_budget_bytes
        self.memory_headroom_bytes = memory_headroom_bytes
        self.context = memory.context_cost(self.device)  # once, before any model
        self.driver = gpustats.DriverView.open(self.device)   # None: no GPU signals
        self.host_cache = HostCache(host_cache_bytes, self.device)   # loader thread only
        self.recycle_reason = ""
        self._load_seq = 0
        self._bad_log = RateLimitedLog(logger)
        # handlers that call models: their client (on the broker's frontend, as any
        # client) and the threads their batches run on (workers/bls.py, callers.py)
        self.models_client = bls.ModelsClient(frontend, curve_keys=curve_keys, ctx=self.ctx) \
            if frontend else None
        self._callers = CallerThreads(self._execute, self._finish, self._waiting)
        self._compute_thread: threading.Thread | None = None
        self._init_metrics()

    def _init_metrics(self) -> None:
        r = self.registry = CollectorRegistry()
        self.m_compute = Histogram("zeroserve_worker_batch_seconds", "Batch run time",
                                   ["model"], registry=r,
                                   buckets=(.001, .002, .005, .01, .02, .05, .1, .2, .5, 1, 5))
        self.m_expired = Counter("zeroserve_worker_expired_requests",
                                 "Requests not run because their deadline passed first",
                                 registry=r)
        self.m_sequences = Gauge("zeroserve_worker_sequences",
                                 "Sequences an iterative model runs on this worker now",
                                 ["model"], registry=r)
        self.m_steps = Counter("zeroserve_worker_steps", "Steps an iterative model ran",
                               ["model"], registry=r)
        self.m_memory = Gauge("zeroserve_worker_memory_bytes", "Worker resident memory",
                              registry=r)
        self.m_model_memory = Gauge("zeroserve_model_memory_bytes",
                                    "Memory a loaded version cost, measured after load",
                                    ["model", "version"], registry=r)
        self.m_host_cache = Gauge("zeroserve_worker_host_cache_bytes",
                                  "Memory of the versions parked in host memory "
                                  "(--host-cache-bytes)", registry=r)
        self.m_gpu = Gauge("zeroserve_gpu_memory_used_bytes", "CUDA memory allocated",
                           registry=r) if self.device.startswith("cuda") else None
        # the driver's view (NVML): series only where it answers, never a made-up 0
        driver = self.driver
        self.m_gpu_driver = None if driver is None else Gauge(
            "zeroserve_gpu_driver_memory_bytes", "Device memory as the driver sees it "
            "(NVML): used by every process, the CUDA context included, and the total",
            ["kind"], registry=r)
        self.m_gpu_busy = Gauge(
            "zeroserve_gpu_utilization_ratio", "Share of the driver's last sample period "
            "in which a kernel ran on the worker's device (NVML)", registry=r) \
            if driver is not None and driver.has_utilization else None

    # -- sockets ------------------------------------------------------------
    def _connect(self) -> None:
        self.channel.connect()
        self._send_ready()

    def _reconnect(self) -> None:
        self._poll_socket(False)
        self.channel.reconnect()
        self._send_ready()

    def _send(self, frames: list[Any]) -> None:
        self.channel.send(frames)

    def _unsent(self) -> None:
        self._bad_log.log(logging.WARNING, "no connection to the broker at %s (with CurveZMQ: "
                          "was our key refused? see the broker's log); retrying",
                          self.endpoint)

    def _send_result(self, frames: list[Any]) -> None:
        """From the compute thread or a caller thread."""
        off_compute = threading.current_thread() is not self._compute_thread
        if not self.channel.send_result(frames, off_compute):
            logger.debug("result not sent: the socket is closed (we are exiting)")

    def _poll_socket(self, on: bool) -> None:
        """Whether the main thread's poller waits on the socket (the compute thread's
        does whenever it is idle)."""
        if self.channel.set_main_reads(on):
            if on:
                self.poller.register(self.channel.fd, zmq.POLLIN)
            else:
                self.poller.unregister(self.channel.fd)

    def _loaded(self) -> list[tuple[tuple[str, int], LoadedModel]]:
        with self._models_lock:
            return list(self.models.items())

    def _send_ready(self) -> None:
        self._last_heard = time.monotonic()
        self._send(p.encode(p.WorkerReady(
            self.worker_id, self.credits, os.getpid(), socket.gethostname(), self.device,
            [[m, v] for (m, v), _ in self._loaded()], self.memory_budget_bytes,
            self._plan_report(), list(p.SUPPORTED_VERSIONS))))

    def _plan_report(self) -> dict[str, Any]:
        """The memory planner's inputs (READY and heartbeats): device, headroom, context,
        and what each loaded version measured."""
        report = memory.device_report(self.device, self.memory_budget_bytes,
                                      self.memory_headroom_bytes, self.context)
        report["models"] = {f"{m}/{v}": lm.memory_bytes for (m, v), lm in self._loaded()}
        report["plans"] = {f"{m}/{v}": lm.plan for (m, v), lm in self._loaded() if lm.plan}
        return report

    # -- main loop ----------------------------------------------------------
    def run(self) -> int:
        self.channel = BrokerChannel(self.ctx, self.endpoint, self._identity, self.curve_keys,
                                     self._unsent)
        self.poller = zmq.Poller()
        # by descriptor: zmq.Poller answers a plain socket's events under its fileno
        self.poller.register(self.channel.main_wake.fileno(), zmq.POLLIN)
        self._connect()
        compute = self._compute_thread = threading.Thread(target=self._compute_loop,
                                                          name="compute", daemon=True)
        for t in (compute, threading.Thread(target=self._loader_loop, name="loader",
                                            daemon=True)):
            t.start()
        next_beat = 0.0
        while self._exit is None:
            now = time.monotonic()
            if now >= next_beat:
                if self._retry_ready_s == math.inf:   # refused, it is nobody's worker yet
                    self._heartbeat()
                if self.alive is not None:
                    self.alive.beat()
                next_beat = now + self.heartbeat_s
            if not self._tick(now):
                break
            busy = self._busy_since
            reads = self._handed or (busy is not None and now - busy >= TAKEOVER_S)
            self._poll_socket(reads)
            wake_s = next_beat if reads or busy is None else min(next_beat, busy + TAKEOVER_S)
            wait_ms = 0 if self._inbox or (reads and self.channel.readable()) else max(
                1, int((wake_s - time.monotonic()) * 1000))
            events = dict(self.poller.poll(wait_ms))
            if self.channel.main_wake.fileno() in events:
                drain(self.channel.main_wake)
            self._handle_inbox()
            while reads and self._exit is None and self.channel.recv_into(self._route):
                self._handle_inbox()
        self._closing = True
        self.channel.wake_compute()
        self._loads.put(_STOP)
        compute.join(1.0)   # not longer: it may be stuck inside the model
        if self.models_client is not None:
            self.models_client.close()
        self.channel.close(compute_stopped=not compute.is_alive())
        return self._exit or 0

    def _tick(self, now: float) -> bool:
        """The main thread's timers; False when it must exit."""
        if now >= self._retry_ready_s:
            self._retry_ready_s = math.inf
            self._send_ready()
        self.notifier.watchdog(now)
        self._notify_ready_once()
        if now - self._last_heard > self.broker_expiry_s:
            if self.stopping:
                logger.warning("broker silent while draining; exiting")
                return False
            logger.warning("broker silent for %.1fs; reconnecting", now - self._last_heard)
            self._reconnect()
        if self.stopping and self._broker_stopped:
            logger.info("stopping; the broker is gone, nothing of its runs here")
            return False
        if self.stopping and not self._draining:
            # the broker decides when we go: alone, we drain and our work moves to
            # others; if it stops too, it keeps us until its queue is done
            self._draining = True
            self._stop_deadline = now + self.drain_timeout_s
            logger.info("draining before exit")
            self.notifier.stopping()
            self._send(self._leave())
        if now >= self._stop_deadline:
            logger.warning("drain did not finish within %.0fs; exiting", self.drain_timeout_s)
            return False
        return True

    def _handle_inbox(self) -> None:
        while self._exit is None and self._inbox:
            self.on_message(self._inbox.popleft())

    def _route(self, frames: list[Any]) -> bool:
        """Under the channel's lock, as either thread reads a message that is not its
        batch: a LOAD or UNLOAD straight to the loader, the rest to the main thread, each
        in the order read. A load on demand is then one wake-up (the loader's) rather
        than three (the main thread's, the loader's, the main thread's for the answer).
        True when it is the main thread's."""
        kind = _LOADER_KINDS.get(bytes(frames[0])) if frames else None
        if kind is None:
            self._inbox.append(frames)
            return True
        self._last_heard = time.monotonic()
        try:
            self._loads.put(p.decode(kind, p.unpack(frames)[1]))
        except (p.ProtocolError, KeyError, ValueError, TypeError) as exc:
            self._bad_log.log(logging.WARNING, "dropped a malformed message from the broker: %s",
                              str(exc)[:300])
        return False

    def on_message(self, frames: list[Any]) -> None:
        self._last_heard = time.monotonic()
        try:
            kind, header, bufs = p.unpack(frames)
            if kind is p.Kind.BATCH:
                self._jobs.append(self._job(header, bufs, self._last_heard))
                if self._busy_since is None:   # it finished meanwhile and may be asleep
                    self.channel.wake_compute()
            elif kind is p.Kind.STOP:
                stop = p.decode(p.Stop, header)
                with self._stops_lock:
                    if stop.batch_id in self._stops:   # else it is done already
                        self._stops[stop.batch_id].update(stop.items)
            elif kind is p.Kind.HEARTBEAT:
                self._on_heartbeat(p.decode(p.BrokerHeartbeat, header))
            elif kind is p.Kind.DISCONNECT:
                self._on_disconnect(p.decode(p.Disconnect, header))
            elif kind is p.Kind.LOG_SETTINGS:
                self._on_log_settings(p.decode(p.LogSettings, header))
        except (p.ProtocolError, KeyError, ValueError, TypeError) as exc:
            self._bad_log.log(logging.WARNING, "dropped a malformed message from the broker: %s",
                              str(exc)[:300])

    def _job(self, header: dict[str, Any], bufs: Any, received_s: float) -> Job:
        batch = p.decode_batch(header, bufs)
        # the budget is relative; turn it into our own clock's deadline on receipt
        start_by = received_s + batch.timeout_ms / 1000.0 \
            if batch.timeout_ms > 0 else float("inf")
        loaded = self.models.get((batch.model, batch.version))
        if loaded is not None and loaded.config.decoupled:
            with self._stops_lock:
                self._stops[batch.batch_id] = set()
        return batch, start_by

    def _on_log_settings(self, msg: p.LogSettings) -> None:
        try:
            self.log_settings.apply(msg.settings)
        except SettingsError as exc:  # the broker validated them: only a newer broker's keys
            logger.warning("log settings from the broker not applied: %s", exc)

    def _on_heartbeat(self, beat: p.BrokerHeartbeat) -> None:
        """The broker sets the pace: we heartbeat as often as it does, and count it lost
        only after more than its own expiry for us (so --heartbeat-s 4 works too)."""
        self._registered = True
        self._broker_stopped = False
        if beat.interval_s > 0:
            self.heartbeat_s = beat.interval_s
            self.broker_expiry_s = max(self.min_broker_expiry_s, 3 * beat.interval_s,
                                       1.5 * beat.expiry_s)

    def _leave(self) -> list[Any]:
        reason = p.LeaveReason.RECYCLE if self.recycle_reason else p.LeaveReason.SHUTDOWN
        return p.encode(p.Leave(reason, True, self.recycle_reason))

    def _on_disconnect(self, msg: p.Disconnect) -> None:
        reason = msg.reason
        if reason is p.DisconnectReason.DRAINED:
            logger.info("drained; exiting%s", " to be restarted" if msg.restart else "")
            self._exit = RECYCLE_EXIT_CODE if msg.restart or self.recycle_reason else 0
            return
        if msg.restart:
            logger.error("broker asks for a restart (%s)", reason.value)
            os._exit(RECYCLE_EXIT_CODE)  # the compute thread may be stuck inside the model
        if reason is p.DisconnectReason.BROKER_STOPPING:
            if self.stopping:
                logger.info("the broker stops too and released us; exiting")
                self._exit = 0
            self._broker_stopped = True
            return  # otherwise reconnect to the next broker when this one is gone
        if reason is p.DisconnectReason.DUPLICATE_ID:
            # a second server on this folder, or two workers given one index: say so and
            # keep trying, so the id is ours once the other process is gone
            self._bad_log.log(logging.ERROR, "refused by the broker: %s", msg.detail)
            self._retry_ready_s = time.monotonic() + self.broker_expiry_s
            return
        logger.info("broker does not know us; registering again")
        self._send_ready()
        if self._draining:
            self._send(self._leave())

    def _notify_ready_once(self) -> None:
        """READY=1 for systemd once the broker knows us and every load it asked for is
        done: its LOADs precede its first heartbeat on the same socket, so by then they
        are all queued."""
        if self.notifier.ready_sent or not self._registered or self._loads.unfinished_tasks:
            return   # (the loader sends each LOADED before it counts its load done)
        self.notifier.ready(f"serving {len(self.models)} model version(s)")

    def _heartbeat(self) -> None:
        rss = rss_bytes()
        self.m_memory.set(rss)
        report = self._plan_report()
        report.update(rss_bytes=rss, free_bytes=self._free_bytes(report["models"]))
        if self.m_gpu is not None:
            self.m_gpu.set(report["gpu_used_bytes"])
        seen = self.driver.read() if self.driver is not None else None
        if seen is not None and self.m_gpu_driver is not None:
            report["gpu"] = seen.report()
            self.m_gpu_driver.labels("used").set(seen.memory_used_bytes)
            self.m_gpu_driver.labels("total").set(seen.memory_total_bytes)
            if self.m_gpu_busy is not None and seen.utilization is not None:
                self.m_gpu_busy.set(seen.utilization)
        self._send(p.encode(p.WorkerHeartbeat(report, generate_latest(self.registry).decode())))

    # -- threads ------------------------------------------------------------
    def _compute_loop(self) -> None:
        wake = self.channel.compute_wake
        poller = select.poll()
        poller.register(wake.fileno(), select.POLLIN)
        polled = -1
        while not self._closing:
            if self._jobs:
                self._run(self._jobs.popleft())
                continue
            if self._tables:
                self._step()   # a step boundary: what came meanwhile ran or joined first
                continue
            try:
                job = self._read_batch()
            except (zmq.ZMQError, OSError) as exc:  # the main thread closed it: we are exiting
                logger.debug("compute thread stops reading: %s", exc)
                return
            if job is not None:
                self._run(job)
                continue
            if polled != self.channel.fd:   # a reconnect made a new socket
                if polled >= 0:
                    poller.unregister(polled)
                polled = self.channel.fd
                poller.register(polled, select.POLLIN)
            # bounded: a missed edge costs at most a second, never a hang
            if any(fd == wake.fileno() for fd, _ in poller.poll(1000)):
                drain(wake)

    def _read_batch(self) -> Job | None:
        """A batch from the socket if one is waiting; any other message goes to the main
        thread (in order, and while the lock is held, so before anything it reads)."""
        while not self._closing:
            frames = self.channel.recv_batch(_is_batch, self._route)
            if frames is None:
                return None
            self._last_heard = received_s = time.monotonic()
            try:
                kind, header, bufs = p.unpack(frames)
                return self._job(header, bufs, received_s)
            except (p.ProtocolError, KeyError, ValueError, TypeError) as exc:
                self._bad_log.log(logging.WARNING, "dropped a malformed batch from the "
                                  "broker: %s", str(exc)[:300])

    def _run(self, job: Job) -> None:
        batch, start_by = job
        taken_ns = time.monotonic_ns()
        self._busy_since = time.monotonic()
        loaded = self.models.get((batch.model, batch.version))
        if self._busy_since >= start_by:
            self.m_expired.inc(len(batch.items))
            result = p.BatchResult(batch.batch_id, [], 0.0, expired=True,
                                   error="deadline exceeded before the batch could start")
        elif loaded is None:
            result = p.BatchResult(batch.batch_id, [], 0.0, retry=True, error=(
                f"model {batch.model}/{batch.version} is not loaded on "
                f"worker {self.worker_id}"))
        elif loaded.config.max_sequences:
            self._table(loaded).join(batch, taken_ns)   # at the next step boundary
            self._handed = True   # the main thread reads meanwhile (STOPs, joins)
            self.channel.wake_main()
            return
        elif loaded.calls_models:
            # it may wait on models this very worker runs: off the compute thread
            self._callers.run(loaded, batch, start_by, taken_ns)
            self._settle()
            return
        else:
            units = batching.units(loaded, batch.items)
            if loaded.config.decoupled or self._long(batch, units):
                # the main thread reads meanwhile: at once, so that what the broker sends
                # behind it (a stream's STOPs, the next batches with their deadlines)
                # is read when it comes
                self._handed = True
                self.channel.wake_main()
            result = self._execute(loaded, batch)
            if not loaded.config.decoupled:
                self._last_run[(batch.model, batch.version)] = (result.compute_ms / 1e3, units)
        self._finish(batch, result, taken_ns)
        self._settle()
        del loaded, result  # hold no version between batches: unloads free it

    def _settle(self) -> None:
        """The compute thread is idle after a batch, or steps sequences on."""
        self._handed = bool(self._tables)
        self._busy_since = time.monotonic() if self._tables else None

    def _table(self, loaded: LoadedModel) -> SequenceTable:
        table = self._tables.get(id(loaded))
        if table is None:
            table = self._tables[id(loaded)] = SequenceTable(
                loaded, functools.partial(self._send_step, loaded), self._finish,
                self._stopped, self._seq_ids)
        return table

    def _send_step(self, loaded: LoadedModel, parts: list[p.Partial]) -> None:
        """A step's responses: one STEPS where the broker reads it (its LOAD said so),
        else a PARTIAL per batch."""
        if len(parts) > 1 and loaded.extra.get("steps"):
            for i in range(0, len(parts), p.MAX_BUNDLE):
                self._send_result(p.encode_steps(parts[i:i + p.MAX_BUNDLE]))
            return
        for part in parts:
            self._send_result(p.encode_partial(part))

    def _step(self) -> None:
        """One step of every iterative model with sequences; a table with none left
        goes (it holds its version)."""
        for key, table in list(self._tables.items()):
            name = table.loaded.name
            if table.step():
                self.m_steps.labels(name).inc()
            self.m_sequences.labels(name).set(table.running)
            if not table.busy:
                del self._tables[key]
        if not self._tables:
            self._settle()

    def _execute(self, loaded: LoadedModel, batch: p.Batch) -> p.BatchResult:
        """Run a batch (on the compute thread, or a caller thread: workers/callers.py)."""
        if loaded.config.decoupled:
            result = streaming.run_stream(
                loaded, batch, lambda part: self._send_result(p.encode_partial(part)),
                lambda: self._stopped(batch.batch_id))
        else:
            result = batching.run(loaded, batch)
        self.m_compute.labels(batch.model).observe(result.compute_ms / 1000.0)
        return result

    def _finish(self, batch: p.Batch, result: p.BatchResult, taken_ns: int) -> None:
        """Send a batch's result (from the thread that ran it), then its spans."""
        if self._stops:
            with self._stops_lock:
                self._stops.pop(batch.batch_id, None)
        done_ns = time.monotonic_ns()
        self._send_result(p.encode_result(result))
        if self.spans is not None and batch.trace is not None:   # after the answer
            self._emit_spans(batch, result, taken_ns, done_ns)

    def _waiting(self, batch_id: int) -> None:
        """From a caller thread: the batch waits on the models it called."""
        self._send(p.encode(p.Waiting(batch_id)))

    def _emit_spans(self, batch: p.Batch, result: p.BatchResult, taken_ns: int,
                    done_ns: int) -> None:
        try:
            self.spans.emit(batch, result, taken_ns, done_ns)
        except Exception as exc:  # tracing must never stop the compute thread
            self._bad_log.log(logging.WARNING, "batch %d's spans not emitted: %s",
                              batch.batch_id, exc)

    def _long(self, batch: p.Batch, units: float) -> bool:
        """Whether a batch may run past TAKEOVER_S: its version has not run here yet, or
        its last batch, scaled to this one's units (rows x length), took more than half
        of it. One that runs long all the same is found by the main thread within a
        heartbeat."""
        last = self._last_run.get((batch.model, batch.version))
        if last is None:
            return True
        seconds, last_units = last
        return seconds * units / max(1.0, last_units) > TAKEOVER_S / 2

    def _stopped(self, batch_id: int) -> frozenset[str]:
        with self._stops_lock:
            return frozenset(self._stops.get(batch_id, ()))

    def _loader_loop(self) -> None:
        while (job := self._loads.get()) is not _STOP:
            if isinstance(job, p.UnloadModel):
                self.unload_version(job.model, job.version)
            else:   # straight to the broker: a relay through the main thread cost a wake-up
                self._send(p.encode(self.load_version(job)))
            self._loads.task_done()

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
        self._last_run.pop((name, version), None)   # new files may run differently
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
        with self._models_lock:
            old = self.models.get((name, version))
            self.models[(name, version)] = loaded
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

    def unload_version(self, name: str, version: int) -> None:
        with self._models_lock:
            loaded = self.models.pop((name, version), None)
            later = [m.memory_bytes for m in self.models.values()
                     if loaded is not None and m.extra.get("seq", 0) > loaded.extra.get("seq", 0)]
        if loaded is None:
            return
        try:
            self.m_model_memory.remove(name, str(version))
        except KeyError:
            pass
        dropped = [loaded] if self.stopping else \
            self.host_cache.park(loaded, loaded.extra.get("config", {}))
        parked = all(d is not loaded for d in dropped)
        if not parked:   # a parked version keeps its timing: it moves back as it ran
            self._last_run.pop((name, version), None)
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
        if excess > self.memory_tolerance_bytes and not self.stopping:
            self.recycle_reason = (f"memory not returned after unloading {name}/{version}: "
                                   f"{excess / 1e6:.0f} MB above the tolerance of "
                                   f"{self.memory_tolerance_bytes / 1e6:.0f} MB")
            logger.warning("%s; draining to restart", self.recycle_reason)
            self.stopping = True  # the main loop drains through the broker, then exits

    def _free_bytes(self, footprints: dict[str, int]) -> int:
        """What is left for models: of the budget when one is set, else of the device."""
        if self.memory_budget_bytes:
            return max(0, self.memory_budget_bytes - sum(footprints.values()))
        if self.device.startswith("cuda"):
            return int(torch.cuda.mem_get_info()[0])
        return memory.proc_bytes("/proc/meminfo", "MemAvailable") or 0

    def _memory_probe(self) -> int:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
            return int(torch.cuda.memory_allocated())
        return rss_bytes()

    def install_signal_handlers(self) -> None:
        def stop(*_: Any) -> None:
            self.stopping = True
        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
