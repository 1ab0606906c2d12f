"""What the direct clients (client.py: Client, AsyncClient) share: the typed errors and
results they raise and return, the broker's answers decoded, and their DEALER's
plumbing (its options, the monitor that hears a dropped connection or a refused key)."""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import msgspec
import numpy as np
import zmq

from zeroserve.broker import curve, protocol as p, sockets, tracing
from zeroserve.broker.protocol.codec import ReplyHeader
from zeroserve.broker.protocol.typed import Wire, tensors_of as tensors_of_frames
from zeroserve.broker.runtime import ELSEWHERE


class InferError(Exception):
    """A request that the server answered with an error (or that could not be sent)."""

    def __init__(self, code: p.ErrorCode, message: str,
                 retry_after_s: float | None = None) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s

    @property
    def retryable(self) -> bool:
        return self.code.retryable


class RowError(InferError):
    """One input of a request of several failed, and with it the request: ``row`` is its
    index, the code and message its own."""

    def __init__(self, row: int, cause: InferError) -> None:
        super().__init__(cause.code, f"input {row}: {cause.message}", cause.retry_after_s)
        self.row = row
        self.cause = cause


@dataclass
class InferResult:
    model: str
    version: int
    outputs: dict[str, np.ndarray]
    stats: dict[str, float] = field(default_factory=dict)
    # a traced request (``traceparent=``): Triton's JSON trace records of it, the broker's
    # and worker's timestamps on this process's monotonic clock (broker/tracing.py)
    trace: list[dict[str, Any]] | None = None
    build: str = ""   # the sha256 of the version's files that answered (InferReply.build)


def tensors_of(inputs: Mapping[str, np.ndarray] | Sequence[p.Tensor]) -> list[p.Tensor]:
    if isinstance(inputs, Mapping):
        return [p.from_numpy(name, np.asarray(arr)) for name, arr in inputs.items()]
    return list(inputs)


def to_result(reply: p.InferReply, traceparent: str = "", sent_ns: int = 0) -> InferResult:
    out = InferResult(reply.model, reply.version,
                      {t.meta.name: p.to_numpy(t) for t in reply.tensors}, dict(reply.stats),
                      build=reply.build)
    if reply.trace is not None:
        stamps = tracing.core_stamps(reply.trace, sent_ns, time.monotonic_ns())
        trace_id = int(reply.request_id) if reply.request_id.isdigit() else 0
        out.trace = tracing.records(trace_id, reply.model, reply.version, stamps,
                                    reply.request_id, traceparent)
    return out


def new_socket(ctx: zmq.Context[Any], endpoint: str,
                keys: curve.ClientKeys | None = None) -> zmq.Socket[Any]:
    # bounded, like the broker's side: past it a send fails at once (overloaded); and
    # nothing queued for a broker that is not there
    return sockets.dealer(ctx, endpoint, hwm=1000, immediate=True, keys=keys,
                          identity=f"c-{os.getpid()}-{uuid.uuid4().hex[:12]}".encode())


def watch(sock: zmq.Socket[Any]) -> zmq.Socket[Any]:
    """A monitor that reports when the connection to the broker drops: the broker's
    ROUTER forgets us then, so every request waiting on it will never be answered; and
    when a Curve handshake is refused, so the caller hears why instead of a timeout."""
    return sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | curve.REFUSAL_EVENTS,
                                   addr=f"inproc://zeroserve-monitor-{uuid.uuid4().hex}")


def unwatch(sock: zmq.Socket[Any], monitor: zmq.Socket[Any]) -> None:
    try:
        sock.disable_monitor()
    except zmq.ZMQError:
        pass
    monitor.close(linger=0)


LOST = "lost the connection to the broker (it may have restarted); retry"

def fd_of(sock: zmq.Socket[Any]) -> int:
    """The socket's descriptor, for the event loop (pyzmq types every option int | bytes)."""
    return int(sock.getsockopt(zmq.FD))


def unreachable(endpoint: str, refused: int) -> InferError:
    """Why no connection came up: a refused Curve key is not worth retrying."""
    if refused == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return InferError(p.ErrorCode.UNAUTHORIZED, f"broker at {endpoint}: "
                          f"{curve.REFUSALS[refused]}")
    why = f": {curve.REFUSALS[refused]}" if refused else ""
    if not why and endpoint.startswith("ipc://"):
        why = f" ({ELSEWHERE})"
    return InferError(p.ErrorCode.UNAVAILABLE, f"broker at {endpoint} is not reachable{why}")


class _Reply(ReplyHeader, frozen=True, kw_only=True):
    """A REPLY's header as it arrives, its version with it."""

    v: int


class _Replies(Wire, frozen=True):
    """A REPLIES header as it arrives."""

    v: int
    replies: list[ReplyHeader]


_decode_reply = msgspec.msgpack.Decoder(_Reply).decode
_decode_replies = msgspec.msgpack.Decoder(_Replies).decode
_REPLY, _REPLIES = p.Kind.REPLY.value, p.Kind.REPLIES.value


def replies_of(frames: list[Any]) -> list[p.InferReply] | None:
    """The replies of a well-formed REPLY or REPLIES, decoded straight into their wire
    shapes (checked in C as decode_reply checks them), without the header's map between:
    3.4 -> 1.5 us a reply in bundles of 3, what the gateway's client mostly gets at C=64.
    None for anything else, and for anything amiss, which the general path decodes or
    refuses with its reasons; a tensor's frame of the wrong size raises ProtocolError
    here, as there."""
    if len(frames) < 2:
        return None
    kind = bytes(frames[0])
    try:
        if kind == _REPLIES:
            bundle = _decode_replies(frames[1])
            headers, version = bundle.replies, bundle.v
            if version < 2 or len(headers) > p.MAX_BUNDLE:
                return None
        elif kind == _REPLY:
            one = _decode_reply(frames[1])
            headers, version = [one], one.v
        else:
            return None
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    if version not in p.SUPPORTED_VERSIONS or \
            sum(len(h.tensors) for h in headers) != len(frames) - 2:
        return None
    out, pos = [], 2
    for h in headers:
        end = pos + len(h.tensors)
        out.append(p.InferReply(h.request_id, h.model, h.version,
                                tensors_of_frames(h.tensors, frames[pos:end]), h.stats,
                                h.trace, h.build))
        pos = end
    return out


def decode_answers(frames: list[Any]) -> list[tuple[p.Kind, str, Any]]:
    """(kind, id, answer) of each answer in a message: one, or a REPLIES bundle's."""
    replies = replies_of(frames)
    if replies is not None:
        return [(p.Kind.REPLY, r.request_id, r) for r in replies]
    kind, header, bufs = p.unpack(frames)
    if kind is p.Kind.REPLIES:
        return [(p.Kind.REPLY, r.request_id, r) for r in p.decode_replies(header, bufs)]
    if kind is p.Kind.PARTS:
        return [(kind, part.request_id, part) for part in p.decode_parts(header, bufs)]
    return [decode_answer(kind, header, bufs)]


def decode_answer(kind: p.Kind, header: dict[str, Any], bufs: Any) -> tuple[p.Kind, str, Any]:
    if kind is p.Kind.REPLY:
        reply = p.decode_reply(header, bufs)
        return kind, reply.request_id, reply
    if kind is p.Kind.ERROR:
        err = p.decode_error(header)
        return kind, err.request_id, InferError(err.code, err.message, err.retry_after_s)
    if kind is p.Kind.CONTROL_REPLY:
        return kind, str(header.get("id", "")), header
    return kind, "", header


def keyed(args: dict[str, Any], api_key: str) -> dict[str, Any]:
    """A control call's args with the client's API key, unless it names one: with a
    tenants file the broker shows a tenant only its own models (broker/server/scope.py)."""
    return {"api_key": api_key, **args} if api_key else args


def control_result(header: dict[str, Any]) -> Any:
    if header.get("ok"):
        return header.get("result")
    code = header.get("code", "internal")
    try:
        ec = p.ErrorCode(code)
    except ValueError:
        ec = p.ErrorCode.INTERNAL
    raise InferError(ec, str(header.get("error")))
