"""The worker's one DEALER to the broker, and who may use it when: said here, once.

Three threads use it:
  * the compute thread reads it while it is idle and runs each batch it reads at once,
    in the thread that received it; every other message it reads it routes
    (``forward``: to the loader or the main thread), in order. At one request at a time
    a hand-off to another thread cost a wake-up and the GIL's passing on every batch
    (mlp, direct C=1), which is why the socket is shared at all rather than owned by
    one thread;
  * the main thread sends (heartbeats) and reads the socket itself only while the
    compute thread is inside a batch that streams or may run long (``main_reads``), so
    a long or hung batch never leaves the broker unheard; what it reads it routes the
    same way, under the lock, so the order read is the order handled;
  * the loader thread sends each load's answer.

Every call on the socket holds one lock (a full memory barrier, which is what ZeroMQ asks
of a socket used by more than one thread). Its descriptor is edge-triggered: a call on the
socket can consume the edge the other thread polls, so after each call the caller wakes
whichever thread reads if a message is waiting (``_kick``). Each thread polls its own
wake-up pipe beside the descriptor.
"""

from __future__ import annotations

import socket
import threading
from typing import Any, Callable

import zmq

from zeroserve.broker import curve, sockets


def _pipe() -> tuple[socket.socket, socket.socket]:
    r, w = socket.socketpair()
    r.setblocking(False)
    w.setblocking(False)
    return r, w


def drain(r: socket.socket) -> None:
    try:
        r.recv(512)
    except BlockingIOError:
        pass


def _wake(w: socket.socket) -> None:
    try:
        w.send(b"\0")
    except (BlockingIOError, OSError):
        pass  # a wake-up is pending already, or we are exiting


class BrokerChannel:
    def __init__(self, ctx: zmq.Context[Any], endpoint: str, identity: bytes,
                 keys: curve.ClientKeys | None,
                 on_unsent: Callable[[], None]) -> None:
        self._ctx, self._endpoint, self._identity, self._keys = ctx, endpoint, identity, keys
        self._on_unsent = on_unsent   # a send found no connection (a refused Curve key)
        self._lock = threading.RLock()
        self.main_wake, self._main_wake_w = _pipe()
        self.compute_wake, self._compute_wake_w = _pipe()
        self._main_reads = False
        self.closed = False
        self.fd = -1

    def connect(self) -> None:
        # one identity per process, not the worker id: a second process claiming the id
        # must not take this one's connection over (ROUTER_HANDOVER would hand it over
        # before the broker could refuse it); reconnects of this process keep it
        with self._lock:
            self._sock = sockets.dealer(self._ctx, self._endpoint, hwm=0, keys=self._keys,
                                        identity=self._identity)
            # its descriptor, not the socket: polling a socket is a call on it, and the
            # other thread may be using it meanwhile
            self.fd = int(self._sock.getsockopt(zmq.FD))

    def reconnect(self) -> None:
        """A new socket; the compute thread is woken to poll its new descriptor. The main
        thread must have stopped polling the old one (``main_reads`` False)."""
        with self._lock:
            self._sock.close(linger=0)
            self.connect()
        _wake(self._compute_wake_w)

    @property
    def main_reads(self) -> bool:
        return self._main_reads

    def set_main_reads(self, on: bool) -> bool:
        """Whether the main thread reads the socket now; True if that changed (the main
        thread then registers or unregisters ``fd`` in its poller)."""
        changed = on != self._main_reads
        self._main_reads = on
        return changed

    # -- sending ------------------------------------------------------------------
    def send(self, frames: list[Any]) -> None:
        """From the main or the loader thread: never blocks (an unbounded queue only
        blocks with no connection at all)."""
        with self._lock:
            if self.closed:
                return
            try:
                sockets.send_now(self._sock, frames)
            except zmq.Again:  # a refused Curve key: ZeroMQ drops the pipe, stops retrying
                self._on_unsent()
            self._kick(self._compute_wake_w)
            if self._main_reads:
                self._kick(self._main_wake_w)

    def send_result(self, frames: list[Any], off_compute: bool = False) -> bool:
        """From the compute thread, or with ``off_compute`` from a caller thread
        (workers/callers.py), which may consume the edge the compute thread polls; False
        once the socket is closed (we are exiting)."""
        try:
            with self._lock:
                sockets.send_now(self._sock, frames, block=True)
                if self._main_reads:
                    self._kick(self._main_wake_w)
                if off_compute:
                    self._kick(self._compute_wake_w)
        except (zmq.ZMQError, OSError):
            return False
        return True

    # -- reading ------------------------------------------------------------------
    def readable(self) -> bool:
        with self._lock:
            return sockets.readable(self._sock)

    def recv(self) -> list[Any] | None:
        """A waiting message, or None; never blocks."""
        with self._lock:
            if self.closed or not sockets.readable(self._sock):
                return None
            return sockets.receive(self._sock)

    def recv_into(self, route: Callable[[list[Any]], bool]) -> bool:
        """From the main thread: hand a waiting message to ``route`` while the lock is
        held; False when none waits."""
        with self._lock:
            frames = self.recv()
            if frames is None:
                return False
            route(frames)
            return True

    def recv_batch(self, is_batch: Callable[[list[Any]], bool],
                   forward: Callable[[list[Any]], bool]) -> list[Any] | None:
        """From the compute thread: the first waiting batch, or None; any other message
        read on the way goes to ``forward`` while the lock is held, so before anything
        the main thread reads after it, and the main thread is woken when ``forward``
        says the message is its. ``is_batch`` is asked under the lock too, so what the
        compute thread records of its batch is there before the main thread reads on."""
        while True:
            with self._lock:
                frames = self.recv()
                if frames is None or is_batch(frames):
                    return frames
                if forward(frames):
                    _wake(self._main_wake_w)

    # -- wake-ups -----------------------------------------------------------------
    def wake_main(self) -> None:
        _wake(self._main_wake_w)

    def wake_compute(self) -> None:
        _wake(self._compute_wake_w)

    def _kick(self, w: socket.socket) -> None:
        """Under the lock, after a call on the socket: it may have consumed the edge of
        the descriptor the other thread polls; if a message waits, wake that thread."""
        if self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            _wake(w)

    def close(self, compute_stopped: bool) -> None:
        """The socket and the main thread's pipe; the compute thread's only once it has
        stopped (it may still be polling it, stuck inside a model)."""
        with self._lock:
            self.closed = True
            self._sock.close(linger=0)
        for end in (self.main_wake, self._main_wake_w) + (
                (self.compute_wake, self._compute_wake_w) if compute_stopped else ()):
            end.close()
