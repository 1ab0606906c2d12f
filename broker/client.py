"""The public zeroserve client: talk to the broker over ZeroMQ, skipping HTTP.

Sync::

    from zeroserve.broker.client import Client
    with Client() as c:                          # finds the broker in the runtime folder
        out = c.infer("mlp", {"input": np.zeros((1, 256), np.float32)})
        out.outputs["output"]                    # numpy array

asyncio (one socket, one reader task, a future per request)::

    async with AsyncClient() as c:
        out = await c.infer("mlp", {"input": x}, priority=1, timeout_ms=50)

Errors raise :class:`InferError` with a typed ``code`` (``err.retryable`` says whether
trying again may succeed). Cancelling an awaiting ``infer`` withdraws the request
from the broker's queue. If the broker goes away, requests in flight fail with a
retryable ``unavailable`` error and the client reconnects by itself.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import zmq
import zmq.asyncio

from zeroserve.broker import protocol as p
from zeroserve.broker.runtime import Endpoints

ErrorCode = p.ErrorCode


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


@dataclass
class InferResult:
    model: str
    version: int
    outputs: dict[str, np.ndarray]
    stats: dict[str, float] = field(default_factory=dict)


def _tensors(inputs: Mapping[str, np.ndarray] | Sequence[p.Tensor]) -> list[p.Tensor]:
    if isinstance(inputs, Mapping):
        return [p.from_numpy(name, np.asarray(arr)) for name, arr in inputs.items()]
    return list(inputs)


def to_result(reply: p.InferReply) -> InferResult:
    return InferResult(reply.model, reply.version,
                       {t.meta.name: p.to_numpy(t) for t in reply.tensors}, dict(reply.stats))


def _new_socket(ctx: zmq.Context[Any], endpoint: str) -> zmq.Socket[Any]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IMMEDIATE, 1)   # queue nothing for a broker that is not there
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.IDENTITY, f"c-{os.getpid()}-{uuid.uuid4().hex[:12]}".encode())
    sock.connect(endpoint)
    return sock


def _decode_answer(frames: list[Any]) -> tuple[p.Kind, str, Any]:
    kind, header, bufs = p.unpack(frames)
    if kind is p.Kind.REPLY:
        reply = p.decode_reply(header, bufs)
        return kind, reply.request_id, reply
    if kind is p.Kind.ERROR:
        err = p.decode_error(header)
        return kind, err.request_id, InferError(err.code, err.message, err.retry_after_s)
    if kind is p.Kind.CONTROL_REPLY:
        return kind, str(header.get("id", "")), header
    return kind, "", header


def _control_result(header: dict[str, Any]) -> Any:
    if header.get("ok"):
        return header.get("result")
    code = header.get("code", "internal")
    try:
        ec = p.ErrorCode(code)
    except ValueError:
        ec = p.ErrorCode.INTERNAL
    raise InferError(ec, str(header.get("error")))


class Client:
    """Blocking client; one per thread (ZeroMQ sockets are not thread-safe)."""

    def __init__(self, endpoint: str | None = None, *, timeout_s: float = 30.0,
                 connect_timeout_s: float = 5.0, ctx: zmq.Context[Any] | None = None) -> None:
        self.endpoint = endpoint or Endpoints.in_dir().frontend
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._ctx = ctx or zmq.Context.instance()
        self._sock = _new_socket(self._ctx, self.endpoint)
        self._ids = itertools.count(1)

    def infer(self, model: str, inputs: Mapping[str, np.ndarray] | Sequence[p.Tensor], *,
              version: int | None = None, priority: int = 0, timeout_ms: float = 0.0,
              outputs: Sequence[str] | None = None, tenant: str = "") -> InferResult:
        rid = str(next(self._ids))
        req = p.InferRequest(rid, model, _tensors(inputs), version, priority, timeout_ms,
                             tenant, outputs)
        wait_s = timeout_ms / 1000.0 + 5.0 if timeout_ms else self.timeout_s
        answer = self._roundtrip(p.encode_request(req), rid, wait_s)
        if isinstance(answer, InferError):
            raise answer
        return to_result(answer)

    def control(self, verb: str, **args: Any) -> Any:
        rid = f"ctl-{next(self._ids)}"
        frames = p.encode_simple(p.Kind.CONTROL, id=rid, verb=verb, args=args)
        return _control_result(self._roundtrip(frames, rid, self.timeout_s))

    def _roundtrip(self, frames: list[Any], rid: str, wait_s: float) -> Any:
        deadline = time.monotonic() + wait_s
        # IMMEDIATE: writable only once connected, so a missing broker times out here
        if not self._sock.poll(int(min(wait_s, self.connect_timeout_s) * 1000), zmq.POLLOUT):
            raise InferError(p.ErrorCode.UNAVAILABLE,
                             f"broker at {self.endpoint} is not reachable")
        self._sock.send_multipart(frames, copy=False)
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not self._sock.poll(left_ms):
                # the broker may have restarted: start over on a fresh socket so a
                # late answer to this request can never be read as another's
                self._reset()
                raise InferError(p.ErrorCode.UNAVAILABLE,
                                 f"no answer from the broker within {wait_s:g} s")
            kind, got, answer = _decode_answer(self._sock.recv_multipart(copy=False))
            if got == rid:
                return answer

    def _reset(self) -> None:
        self._sock.close(linger=0)
        self._sock = _new_socket(self._ctx, self.endpoint)

    def close(self) -> None:
        self._sock.close(linger=0)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class AsyncClient:
    """asyncio client: one DEALER, one reader task, futures keyed by request id.

    ``broker_timeout_s`` bounds how long the broker may stay silent (it answers a
    ping every ``ping_s``) before pending requests fail as ``unavailable``.
    """

    def __init__(self, endpoint: str | None = None, *, ping_s: float = 0.5,
                 broker_timeout_s: float = 3.0, ctx: zmq.asyncio.Context | None = None) -> None:
        self.endpoint = endpoint or Endpoints.in_dir().frontend
        self.ping_s = ping_s
        self.broker_timeout_s = broker_timeout_s
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self._sock: zmq.asyncio.Socket | None = None
        self._ids = itertools.count(1)
        self._pending: dict[str, asyncio.Future[Any]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._last_heard = -float("inf")

    async def start(self) -> None:
        self._sock = _new_socket(self._ctx, self.endpoint)  # type: ignore[arg-type]
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._reader(), name="zeroserve-client-reader"),
                       loop.create_task(self._pinger(), name="zeroserve-client-pinger"),
                       loop.create_task(self._disconnects(), name="zeroserve-client-monitor")]

    @property
    def connected(self) -> bool:
        """Whether the broker answered within ``broker_timeout_s``."""
        return time.monotonic() - self._last_heard < self.broker_timeout_s

    async def wait_connected(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self.connected and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return self.connected

    async def infer_tensors(self, model: str, tensors: Sequence[p.Tensor], *,
                            version: int | None = None, priority: int = 0,
                            timeout_ms: float = 0.0, outputs: Sequence[str] | None = None,
                            tenant: str = "") -> p.InferReply:
        """Like :meth:`infer` but with raw tensors in and out (no numpy conversion)."""
        rid = str(next(self._ids))
        req = p.InferRequest(rid, model, tensors, version, priority, timeout_ms, tenant, outputs)
        answer = await self._call(p.encode_request(req), rid, cancel=True)
        if isinstance(answer, InferError):
            raise answer
        return answer  # type: ignore[no-any-return]

    async def infer(self, model: str, inputs: Mapping[str, np.ndarray] | Sequence[p.Tensor],
                    **kwargs: Any) -> InferResult:
        return to_result(await self.infer_tensors(model, _tensors(inputs), **kwargs))

    async def control(self, verb: str, **args: Any) -> Any:
        rid = f"ctl-{next(self._ids)}"
        header = await self._call(p.encode_simple(p.Kind.CONTROL, id=rid, verb=verb,
                                                  args=args), rid, cancel=False)
        if isinstance(header, InferError):
            raise header
        return _control_result(header)

    async def _call(self, frames: list[Any], rid: str, cancel: bool) -> Any:
        assert self._sock is not None, "call start() first"
        if not self.connected:
            raise InferError(p.ErrorCode.UNAVAILABLE, "broker is not reachable")
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        try:
            try:
                await self._sock.send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
            except zmq.Again:
                raise InferError(p.ErrorCode.UNAVAILABLE, "broker is not reachable") from None
            return await fut
        except asyncio.CancelledError:
            if cancel and self._sock is not None and not self._sock.closed:
                try:
                    self._sock.send_multipart(p.encode_simple(p.Kind.CANCEL, id=rid),
                                              flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass  # the broker is gone, and the request with it
            raise
        finally:
            self._pending.pop(rid, None)

    async def _reader(self) -> None:
        assert self._sock is not None
        try:
            while True:
                frames = await self._sock.recv_multipart(copy=False)
                self._last_heard = time.monotonic()
                try:
                    kind, rid, answer = _decode_answer(frames)
                except p.ProtocolError:
                    continue
                fut = self._pending.get(rid)
                if fut is not None and not fut.done():
                    fut.set_result(answer)
        except (asyncio.CancelledError, zmq.ZMQError):
            pass
        finally:
            self._fail_pending("client reader stopped")

    async def _pinger(self) -> None:
        assert self._sock is not None
        was_connected = False
        while True:
            try:
                await self._sock.send_multipart(p.encode_simple(p.Kind.PING), flags=zmq.NOBLOCK)
            except zmq.Again:
                pass  # not connected; IMMEDIATE queues nothing
            await asyncio.sleep(self.ping_s)
            if was_connected and not self.connected:
                self._fail_pending("lost contact with the broker")
            was_connected = self.connected

    async def _disconnects(self) -> None:
        """A dropped connection loses whatever the broker held for us; a broker that
        restarts at once answers pings again before ``broker_timeout_s``, so without
        this the requests sent to the old one would wait forever."""
        assert self._sock is not None
        monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            while True:
                await monitor.recv_multipart()
                self._fail_pending("lost the connection to the broker")
        except (asyncio.CancelledError, zmq.ZMQError):
            pass
        finally:
            self._sock.disable_monitor()
            monitor.close(linger=0)

    def _fail_pending(self, why: str) -> None:
        for fut in list(self._pending.values()):
            if not fut.done():
                fut.set_result(InferError(p.ErrorCode.UNAVAILABLE, why))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
        self._tasks = []
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    async def __aenter__(self) -> "AsyncClient":
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
