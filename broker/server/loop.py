"""The broker's socket loop: it receives, hands over and ticks; it decides nothing.

One thread, one zmq.Poller whose timeout is the next thing due, which the heartbeat
bounds. A part's due time is one that time alone makes actionable: a wait that only a
message ends (a result, a load, a request) is none, since every message ends its turn
with a tick; asked anyway, it stays in the past once passed, a timeout of 0, and the
loop spins until the message comes. The backend is serviced first so results drain
before new work is taken. Whatever arrives, the loop survives: a handler that raises
is counted as a malformed message (by socket and reason) and logged at a bounded
rate, and the loop goes on.

Each socket has a monitor, so a peer whose connection closes is known at once: a
worker that died (its batches are retried without waiting for the heartbeat
expiry) and a direct client that went away (its queued requests are withdrawn).
A message's source descriptor (``zmq.SRCFD``) ties a connection to a peer id.
"""

from __future__ import annotations

import logging
import math
import socket
import time
from typing import TYPE_CHECKING, Any, Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from zeroserve.broker import curve, protocol as p
from zeroserve.broker.process import RateLimitedLog
from zeroserve.broker.runtime import Endpoints
from zeroserve.broker.sockets import receive, router, send_routed, source_fd

if TYPE_CHECKING:
    from zeroserve.broker.server.broker import Broker

logger = logging.getLogger(__name__)

# Finite high-water marks: a peer that floods, or stops reading its answers, meets a
# bound instead of growing the broker's memory (replies beyond it are dropped).
FRONTEND_HWM = 1000
BACKEND_HWM = 1000
DRAIN_BUDGET = 256   # messages per socket per turn, so no socket starves the others
_READY = p.Kind.READY.value


class Connections:
    """Which peer speaks on which connection, from a socket's monitor events."""

    def __init__(self, sock: zmq.Socket[Any]) -> None:
        self.monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._peer: dict[int, bytes] = {}
        self._fd: dict[bytes, int] = {}

    def note(self, identity: bytes, fd: int, fresh: bool = False) -> list[bytes]:
        """Record that ``identity`` speaks on ``fd``; returns peers found gone meanwhile.
        A new mapping, or a peer introducing itself (``fresh``: a worker's READY), reads
        the monitor first: a descriptor is reused only after its old connection's
        DISCONNECTED event was queued, so that event is never taken for the new
        connection's, even when a restarted worker comes back on the same descriptor."""
        if self._fd.get(identity) == fd and not fresh:
            return []
        gone = self.closed()
        old = self._fd.pop(identity, None)
        if old is not None and self._peer.get(old) == identity:
            del self._peer[old]
        self._peer[fd] = identity
        self._fd[identity] = fd
        return gone

    def forget(self, identity: bytes) -> None:
        fd = self._fd.pop(identity, None)
        if fd is not None and self._peer.get(fd) == identity:
            del self._peer[fd]

    def closed(self) -> list[bytes]:
        gone = []
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                identity = self._peer.pop(int(event["value"]), None)
                if identity is not None:
                    self._fd.pop(identity, None)
                    gone.append(identity)
        return gone

    def close(self, sock: zmq.Socket[Any]) -> None:
        try:
            sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(linger=0)


def _send(sock: zmq.Socket[Any], identity: bytes, frames: list[Any]) -> bool:
    try:
        send_routed(sock, identity, frames)
        return True
    except zmq.ZMQError as exc:  # EHOSTUNREACH: the peer went; EAGAIN: it stopped reading
        logger.debug("send to %r failed: %s", identity, exc)
        return False


class BrokerLoop:
    def __init__(self, endpoints: Endpoints, ctx: zmq.Context[Any],
                 security: curve.ServerSecurity | None = None) -> None:
        self.endpoints = endpoints
        self.ctx = ctx
        self.frontend = router(ctx, endpoints.frontend, hwm=FRONTEND_HWM, security=security,
                               domain="frontend")
        self.backend = router(ctx, endpoints.backend, hwm=BACKEND_HWM, security=security,
                              domain="backend")
        self.control = router(ctx, endpoints.control, hwm=FRONTEND_HWM)
        self.clients = Connections(self.frontend)
        self.workers = Connections(self.backend)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.poller = zmq.Poller()
        self.poller.register(self.backend, zmq.POLLIN)
        self.poller.register(self.workers.monitor, zmq.POLLIN)
        self.poller.register(self.frontend, zmq.POLLIN)
        self.poller.register(self.clients.monitor, zmq.POLLIN)
        self.poller.register(self.control, zmq.POLLIN)
        # by descriptor: zmq.Poller answers a plain socket's events under its fileno, so
        # `self._wake_r in events` never held and an unread signal byte spun the loop
        self.poller.register(self._wake_r.fileno(), zmq.POLLIN)
        self._bad_log = RateLimitedLog(logger, per_s=1.0)

    @property
    def wakeup_fd(self) -> int:
        return self._wake_w.fileno()

    def to_client(self, identity: bytes, frames: list[Any]) -> bool:
        return _send(self.frontend, identity, frames)

    def to_worker(self, identity: bytes, frames: list[Any]) -> bool:
        return _send(self.backend, identity, frames)

    def to_controller(self, identity: bytes, frames: list[Any]) -> bool:
        return _send(self.control, identity, frames)

    def run(self, broker: "Broker", clock: Callable[[], float] = time.monotonic) -> None:
        while not broker.finished(clock()):
            now = clock()
            timeout_s = broker.next_due(now) - now
            events = dict(self.poller.poll(max(0, math.ceil(timeout_s * 1000))))
            if self._wake_r.fileno() in events:
                try:
                    self._wake_r.recv(512)
                except BlockingIOError:
                    pass
            if self.workers.monitor in events:
                for identity in self.workers.closed():
                    broker.worker_connection_closed(identity)
            if self.backend in events:
                self._drain(self.backend, broker.on_backend, broker, "backend",
                            self.workers, broker.worker_connection_closed)
            if self.clients.monitor in events:
                for identity in self.clients.closed():
                    broker.client_gone(identity)
            if self.frontend in events:
                self._drain(self.frontend, broker.on_frontend, broker, "frontend",
                            self.clients, broker.client_gone)
            if self.control in events:
                self._drain(self.control, broker.on_control, broker, "control")
            broker.on_events(events)
            broker.tick(clock())

    def _drain(self, sock: zmq.Socket[Any], handler: Callable[[bytes, list[Any]], None],
               broker: "Broker", where: str, conns: Connections | None = None,
               gone: Callable[[bytes], None] | None = None) -> None:
        for _ in range(DRAIN_BUDGET):
            try:
                frames = receive(sock)
            except zmq.Again:
                return
            try:
                identity = frames[0].bytes
                if conns is not None and gone is not None:
                    fresh = len(frames) > 1 and frames[1].bytes == _READY
                    for peer in conns.note(identity, source_fd(frames[0]), fresh):
                        gone(peer)
                if len(frames) < 2:
                    raise p.ProtocolError("a message without a body")
                handler(identity, frames[1:])
            except Exception as exc:  # noqa: BLE001 - no input may end the loop
                self.bad_message(broker, where, exc)

    def bad_message(self, broker: "Broker", where: str, exc: Exception) -> None:
        if isinstance(exc, p.VersionMismatch):
            reason = "version"
        elif isinstance(exc, p.ProtocolError):
            reason = "malformed"
        else:
            reason = "internal"
        broker.metrics.bad_message(where, reason)
        if reason == "internal":  # a bug of ours, not the sender's: keep the traceback
            self._bad_log.log(logging.ERROR, "error handling a message on %s: %s", where, exc,
                              exc_info=exc)
        else:
            self._bad_log.log(logging.WARNING, "dropped a malformed message on %s: %s", where,
                              str(exc)[:300])

    def close(self, linger_ms: int = 1000) -> None:
        """Close the sockets; the last answers (shutdown errors) get ``linger_ms`` to
        leave, since a linger of 0 would drop them unsent."""
        self.clients.close(self.frontend)
        self.workers.close(self.backend)
        for sock in (self.frontend, self.backend, self.control):
            sock.close(linger=linger_ms)
        self._wake_r.close()
        self._wake_w.close()
