"""Every DEALER and ROUTER the project makes, in one place: the options each side needs,
Curve on tcp://, the identity and the high-water marks. The broker binds ROUTERs
(:func:`router`); workers, gateways and clients connect DEALERs (:func:`dealer`).

Both close with ``linger=0`` (shutdown is bounded by a drain, never by unsent frames)
and reconnect quickly (100 ms, backing off to 1 s) so a restarted broker is found at once.

The hot paths (the broker's loop, the clients' and the workers' channels) send and
receive through :func:`send_now`, :func:`send_routed`, :func:`receive` and
:func:`readable`, below pyzmq's Python layer.
"""

from __future__ import annotations

from typing import Any, Sequence, cast

import zmq

from zeroserve.broker import curve

RECONNECT_IVL_MS = 100
RECONNECT_IVL_MAX_MS = 1000


def router(ctx: zmq.Context[Any], endpoint: str, *, hwm: int,
           security: curve.ServerSecurity | None = None, domain: str = "") -> zmq.Socket[Any]:
    """A broker socket, bound. ``ROUTER_MANDATORY`` so a send to a vanished peer raises
    instead of vanishing; ``ROUTER_HANDOVER`` so a restarted peer takes its identity back.
    With ``security`` and a tcp:// endpoint it speaks Curve under the ZAP ``domain``."""
    sock: zmq.Socket[Any] = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    curve.secure_server(sock, security, endpoint, domain)
    sock.bind(endpoint)
    return sock


def dealer(ctx: zmq.Context[Any], endpoint: str, *, identity: bytes, hwm: int,
           keys: curve.ClientKeys | None = None, immediate: bool = False) -> zmq.Socket[Any]:
    """A peer's socket to the broker, connected. ``hwm`` 0 means no bound;
    ``immediate`` queues nothing while no broker is connected, so a send fails at once
    instead. Raises CurveError (the socket closed)
    for an endpoint beyond loopback without ``keys``."""
    sock: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if immediate:
        sock.setsockopt(zmq.IMMEDIATE, 1)
    sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.IDENTITY, identity)
    curve.secure_client(sock, keys, endpoint)
    sock.connect(endpoint)
    return sock


# The socket's own send, recv and get, below pyzmq's Python layer, with plain ints for
# flags: send_multipart and recv_multipart pass through Python per frame and combine
# enum flags (each ``|`` a Python call), and ``int & zmq.POLLIN`` calls the enum's.
# A 5-frame message over ipc, same process: sent 14.1 -> 5.3 us, received (with the
# EVENTS check) 10.7 -> 5.7 us.
_send = zmq.backend.Socket.send
_recv = zmq.backend.Socket.recv
_get = zmq.backend.Socket.get
_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)
_LAST = int(zmq.NOBLOCK)
_MORE_WAIT = int(zmq.SNDMORE)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_SRCFD = int(zmq.SRCFD)


def send_now(sock: zmq.Socket[Any], frames: Sequence[Any], block: bool = False) -> None:
    """``send_multipart(frames, NOBLOCK, copy=False)``: zmq.Again when it would block
    (with ``block``, ``send_multipart(frames, copy=False)``: it waits). A message's
    frames past its first are never refused (the high-water mark counts whole
    messages), so nothing leaves half sent."""
    more, last_flags = (_MORE_WAIT, 0) if block else (_MORE, _LAST)
    last = len(frames) - 1
    for i in range(last):
        _send(sock, frames[i], more, False)
    _send(sock, frames[last], last_flags, False)


def send_routed(sock: zmq.Socket[Any], identity: bytes, frames: Sequence[Any]) -> None:
    """A ROUTER's ``send_multipart([identity, *frames], NOBLOCK, copy=False)`` without
    the list: zmq.Again, or EHOSTUNREACH for a peer gone (``ROUTER_MANDATORY``), come
    from the identity's frame, before any of the message leaves."""
    _send(sock, identity, _MORE, False)
    send_now(sock, frames)


def readable(sock: zmq.Socket[Any]) -> bool:
    """Whether a message waits (ZMQ_EVENTS has POLLIN)."""
    return bool(cast(int, _get(sock, _EVENTS)) & _POLLIN)


def receive(sock: zmq.Socket[Any]) -> list[zmq.Frame]:
    """``recv_multipart(NOBLOCK, copy=False)``: one waiting message's frames; zmq.Again
    when none waits."""
    frame = _recv(sock, _LAST, False)
    frames = [frame]
    while frame.more:
        frame = _recv(sock, _LAST, False)
        frames.append(frame)
    return frames


def source_fd(frame: zmq.Frame) -> int:
    """The descriptor of the connection a received frame came on (``zmq.SRCFD``)."""
    return frame.get(_SRCFD)
