"""Every DEALER and ROUTER the project makes, in one place: the options each side needs,
Curve on tcp://, the identity and the high-water marks. The broker binds ROUTERs
(:func:`router`); workers, gateways and clients connect DEALERs (:func:`dealer`).

Both close with ``linger=0`` (shutdown is bounded by a drain, never by unsent frames)
and reconnect quickly (100 ms, backing off to 1 s) so a restarted broker is found at once.
"""

from __future__ import annotations

from typing import Any

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
