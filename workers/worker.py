"""The worker process: one per GPU (or N on a CPU host).

Threads, so heartbeats flow while a batch runs, one class each:
  * the compute thread (workers/compute.py) reads the DEALER to the broker while it is
    idle and runs each batch it reads at once, in the thread that received it, then
    sends the result. A LOAD or UNLOAD it reads goes to the loader, every other message
    to the main thread;
  * the main thread (``Worker``, here) registers, heartbeats, keeps the timers (broker
    expiry, drain, watchdog) and handles everything but batches. It reads the DEALER
    itself while a batch runs that streams (its STOPs must be read meanwhile), or that
    may run past TAKEOVER_S (its version's last batch says so, or it is the first), or
    that has run past it (found within a heartbeat): so a long or hung batch never
    leaves the broker unheard (its restart order is read), and what comes behind it is
    read on arrival, where deadlines count from. Batches it reads queue for the compute
    thread;
  * the loader thread (workers/loading.py) loads and warms up versions, so the old
    version keeps serving while a new one loads, and sends each answer itself.
The versions they share are workers/loaded.py's map (the loader writes it). How the
threads share the broker's socket is workers/channel.py's to say and to keep. torch
releases the GIL inside its kernels, so the threads overlap.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import secrets
import signal
import socket
import time
from typing import Any

import torch
import zmq
from prometheus_client import CollectorRegistry

from zeroserve.broker import curve, protocol as p
from zeroserve.broker.liveness import AliveFile
from zeroserve.broker.logsettings import LogSettings, SettingsError
from zeroserve.broker.process import Notifier, RateLimitedLog
from zeroserve.workers import bls
from zeroserve.workers.channel import BrokerChannel, drain
from zeroserve.workers.compute import TAKEOVER_S, Compute
from zeroserve.workers.hostcache import DEFAULT_HOST_CACHE_BYTES
from zeroserve.workers.loaded import LoadedModels
from zeroserve.workers.loading import Loader, Stopping
from zeroserve.workers.report import Report

logger = logging.getLogger(__name__)

# How far memory may stay above its pre-load level after an unload before the worker is
# recycled; tests/workers/test_memory.py measures the real drift of mlp cycles (a few MB).
DEFAULT_MEMORY_TOLERANCE_BYTES = 64 << 20
RECYCLE_EXIT_CODE = 75

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
        self.worker_id = worker_id
        self.credits = credits
        self.heartbeat_s = heartbeat_s
        self.min_broker_expiry_s = self.broker_expiry_s = broker_expiry_s
        self.device = device or ("cuda:0" if torch.cuda.is_available() else "cpu")
        self.ctx = ctx or zmq.Context.instance()
        self.models = LoadedModels()
        # what either thread read that is neither its batch nor the loader's, for the main
        # thread, in order
        self._inbox: collections.deque[list[Any]] = collections.deque()
        self.drain_timeout_s = drain_timeout_s
        # set by a signal, or by the loader to recycle a worker that leaks memory
        self._stopping = Stopping()
        self._draining = False
        self._stop_deadline = float("inf")
        self._exit: int | None = None
        self.notifier = Notifier()
        self.log_settings = LogSettings()
        self._registered = False  # the broker has heartbeated us since our READY
        self._identity = f"{worker_id}#{os.getpid()}.{secrets.token_hex(4)}".encode()
        self._retry_ready_s = math.inf   # refused as a duplicate id: when to try again
        self._broker_stopped = False  # it said BROKER_STOPPING and no broker spoke since
        self.memory_budget_bytes = memory_budget_bytes
        self._bad_log = RateLimitedLog(logger)
        # handlers that call models: their client (on the broker's frontend, as any
        # client); the threads their batches run on are the compute thread's
        self.models_client = bls.ModelsClient(frontend, curve_keys=curve_keys, ctx=self.ctx) \
            if frontend else None
        r = self.registry = CollectorRegistry()
        self.compute = Compute(self.models, worker_id, r, spans=spans, bad_log=self._bad_log)
        self.report = Report(self.models, self.device, r,
                             memory_budget_bytes=memory_budget_bytes,
                             memory_headroom_bytes=memory_headroom_bytes)
        self.loader = Loader(self.models, self.device, r, stopping=self._stopping,
                             forget=self.compute.forget,
                             memory_tolerance_bytes=memory_tolerance_bytes,
                             host_cache_bytes=host_cache_bytes, models_client=self.models_client,
                             context=self.report.context)

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

    def _poll_socket(self, on: bool) -> None:
        """Whether the main thread's poller waits on the socket (the compute thread's
        does whenever it is idle)."""
        if self.channel.set_main_reads(on):
            if on:
                self.poller.register(self.channel.fd, zmq.POLLIN)
            else:
                self.poller.unregister(self.channel.fd)

    def _send_ready(self) -> None:
        self._last_heard = time.monotonic()
        self._send(p.encode(p.WorkerReady(
            self.worker_id, self.credits, os.getpid(), socket.gethostname(), self.device,
            [[m, v] for (m, v), _ in self.models.items()], self.memory_budget_bytes,
            self.report.plan(), list(p.SUPPORTED_VERSIONS))))

    # -- main loop ----------------------------------------------------------
    def run(self) -> int:
        self.channel = BrokerChannel(self.ctx, self.endpoint, self._identity, self.curve_keys,
                                     self._unsent)
        self.poller = zmq.Poller()
        # by descriptor: zmq.Poller answers a plain socket's events under its fileno
        self.poller.register(self.channel.main_wake.fileno(), zmq.POLLIN)
        self._connect()
        compute = self.compute.start(self.channel, self)
        self.loader.start(self.channel)
        next_beat = 0.0
        while self._exit is None:
            now = time.monotonic()
            if now >= next_beat:
                if self._retry_ready_s == math.inf:   # refused, it is nobody's worker yet
                    self._send(p.encode(self.report.heartbeat()))
                if self.alive is not None:
                    self.alive.beat()
                next_beat = now + self.heartbeat_s
            if not self._tick(now):
                break
            busy = self.compute.busy_since
            reads = self.compute.handed or (busy is not None and now - busy >= TAKEOVER_S)
            self._poll_socket(reads)
            wake_s = next_beat if reads or busy is None else min(next_beat, busy + TAKEOVER_S)
            wait_ms = 0 if self._inbox or (reads and self.channel.readable()) else max(
                1, int((wake_s - time.monotonic()) * 1000))
            events = dict(self.poller.poll(wait_ms))
            if self.channel.main_wake.fileno() in events:
                drain(self.channel.main_wake)
            self._handle_inbox()
            while reads and self._exit is None and self.channel.recv_into(self.route):
                self._handle_inbox()
        self.compute.close()
        self.loader.stop()
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
            if self._stopping.is_set():
                logger.warning("broker silent while draining; exiting")
                return False
            logger.warning("broker silent for %.1fs; reconnecting", now - self._last_heard)
            self._reconnect()
        if self._stopping.is_set() and self._broker_stopped:
            logger.info("stopping; the broker is gone, nothing of its runs here")
            return False
        if self._stopping.is_set() and not self._draining:
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

    # -- routing ------------------------------------------------------------
    def _handle_inbox(self) -> None:
        while self._exit is None and self._inbox:
            self.on_message(self._inbox.popleft())

    def route(self, frames: list[Any]) -> bool:
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
            self.loader.put(p.decode(kind, p.unpack(frames)[1]))
        except (p.ProtocolError, KeyError, ValueError, TypeError) as exc:
            self._bad_log.log(logging.WARNING, "dropped a malformed message from the broker: %s",
                              str(exc)[:300])
        return False

    def heard(self, now: float) -> None:
        """From the compute thread: it read a batch."""
        self._last_heard = now

    def on_message(self, frames: list[Any]) -> None:
        self._last_heard = time.monotonic()
        try:
            kind, header, bufs = p.unpack(frames)
            if kind is p.Kind.BATCH:
                self.compute.queue(header, bufs, self._last_heard)
            elif kind is p.Kind.STOP:
                self.compute.stop(p.decode(p.Stop, header))
            elif kind is p.Kind.PAUSE:
                self.compute.pause(p.decode(p.Pause, header))
            elif kind is p.Kind.HEARTBEAT:
                self._on_heartbeat(p.decode(p.BrokerHeartbeat, header))
            elif kind is p.Kind.DISCONNECT:
                self._on_disconnect(p.decode(p.Disconnect, header))
            elif kind is p.Kind.LOG_SETTINGS:
                self._on_log_settings(p.decode(p.LogSettings, header))
        except (p.ProtocolError, KeyError, ValueError, TypeError) as exc:
            self._bad_log.log(logging.WARNING, "dropped a malformed message from the broker: %s",
                              str(exc)[:300])

    def _on_log_settings(self, msg: p.LogSettings) -> None:
        try:
            self.log_settings.apply(msg.settings)
        except SettingsError as exc:  # the broker validated them: only a newer broker's keys
            logger.warning("log settings from the broker not applied: %s", exc)

    # -- registration and heartbeats ------------------------------------------
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
        reason = p.LeaveReason.RECYCLE if self.loader.recycle_reason else p.LeaveReason.SHUTDOWN
        return p.encode(p.Leave(reason, True, self.loader.recycle_reason))

    def _on_disconnect(self, msg: p.Disconnect) -> None:
        reason = msg.reason
        if reason is p.DisconnectReason.DRAINED:
            logger.info("drained; exiting%s", " to be restarted" if msg.restart else "")
            self._exit = RECYCLE_EXIT_CODE if msg.restart or self.loader.recycle_reason else 0
            return
        if msg.restart:
            logger.error("broker asks for a restart (%s)", reason.value)
            os._exit(RECYCLE_EXIT_CODE)  # the compute thread may be stuck inside the model
        if reason is p.DisconnectReason.BROKER_STOPPING:
            if self._stopping.is_set():
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
        if self.notifier.ready_sent or not self._registered or self.loader.pending:
            return   # (the loader sends each LOADED before it counts its load done)
        self.notifier.ready(f"serving {len(self.models)} model version(s)")

    def install_signal_handlers(self) -> None:
        def stop(*_: Any) -> None:
            self._stopping.set()
        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
