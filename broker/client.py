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
import collections
import itertools
import time
from functools import partial
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import zmq
from zmq.utils.monitor import parse_monitor_message

from zeroserve.broker import curve, protocol as p, tracing
from zeroserve.broker.clientbase import (LOST, InferError, InferResult, RowError,
                                         control_result, decode_answers, fd_of, keyed,
                                         new_socket, tensors_of, to_result, unreachable,
                                         unwatch, watch)
from zeroserve.broker.runtime import Endpoints
from zeroserve.broker.sockets import readable, receive, send_now
from zeroserve.broker.streamclient import AsyncStream, Stream, StreamResponse

__all__ = ["AsyncClient", "AsyncStream", "Client", "ErrorCode", "InferError", "InferResult",
           "RowError", "Stream", "StreamResponse"]

ErrorCode = p.ErrorCode


# Requests a loop turn sends at once rather than at its end: a gateway turn that parsed
# 64 bodies before sending any left the broker and the worker idle meanwhile, then gave
# them one big batch while it idled in turn. mlp at C=64, same runs: at the end of the
# turn HTTP JSON 5,240 req/s, direct 8,750 and p99 28 ms; every 16, 5,860 and 9,440 and
# 18 ms; with the collector tuned, every 32 against every 16: HTTP 6,720-7,160 against
# 6,240-6,400 req/s, direct level (10,160-10,480); 4, 8, 24, 40, 48 and 64 gained less.
FLUSH_AT = 32
# connected, yet the socket would block: the broker is not keeping up
_FULL = (p.ErrorCode.OVERLOADED, "the broker is not keeping up with requests (its queue "
         "to this client is full)", 1.0)


class Client:
    """Blocking client; one per thread (ZeroMQ sockets are not thread-safe)."""

    def __init__(self, endpoint: str | None = None, *, timeout_s: float = 30.0,
                 connect_timeout_s: float = 5.0, ctx: zmq.Context[Any] | None = None,
                 admin_token: str = "", api_key: str = "",
                 curve_keys: curve.ClientKeys | None = None) -> None:
        self.endpoint = endpoint or Endpoints.in_dir().frontend
        self.curve_keys = curve_keys  # the broker's public key and ours, for tcp:// with Curve
        self._refused = 0  # the monitor event of a refused handshake, if one came
        self.timeout_s = timeout_s
        self.admin_token = admin_token
        self.api_key = api_key  # sent with every request (a tenant's key); infer(api_key=) wins
        self.connect_timeout_s = connect_timeout_s
        self._ctx = ctx or zmq.Context.instance()
        self._ids = itertools.count(1)
        # open streams' answers that arrived while another call waited, in order
        self._inbox: dict[str, collections.deque[Any]] = {}
        self._open()

    def _open(self) -> None:
        self._sock = new_socket(self._ctx, self.endpoint, self.curve_keys)
        self._monitor = watch(self._sock)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)

    def _disconnected(self) -> bool:
        """Whether the monitor reported a dropped connection (and forget its reports)."""
        lost = False
        while self._monitor.poll(0):
            event = parse_monitor_message(self._monitor.recv_multipart())
            lost = lost or event["event"] == zmq.EVENT_DISCONNECTED
            self._refused = event["event"] if curve.refusal(event) else self._refused
        return lost

    def _await_connection(self, wait_s: float) -> bool:
        """Wait until the socket can send (connected, handshake done), or a refusal."""
        deadline = time.monotonic() + wait_s
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLOUT)
        poller.register(self._monitor, zmq.POLLIN)
        while (left_ms := int((deadline - time.monotonic()) * 1000)) > 0:
            if self._sock in dict(poller.poll(left_ms)):
                return True
            self._disconnected()
            if self._refused == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                return False  # ZeroMQ does not retry a refused key: waiting is pointless
        return False

    def infer(self, model: str, inputs: Mapping[str, np.ndarray] | Sequence[p.Tensor], *,
              version: int | None = None, priority: int = 0, timeout_ms: float = 0.0,
              outputs: Sequence[str] | None = None, tenant: str = "",
              api_key: str | None = None, traceparent: str = "",
              tracestate: str = "", routing_key: str = "") -> InferResult:
        """``traceparent`` (W3C, with ``tracestate``) traces the request: the result's
        ``trace`` holds its records. ``routing_key`` keeps a caller on one version of a
        traffic split (docs/rollouts.md); without it the broker uses the API key, else
        this client's connection."""
        rid = str(next(self._ids))
        trace = tracing.context(traceparent, tracestate) if traceparent else None
        req = p.InferRequest(rid, model, tensors_of(inputs), version, priority, timeout_ms,
                             tenant, outputs, self.api_key if api_key is None else api_key,
                             trace=trace, routing_key=routing_key)
        wait_s = timeout_ms / 1000.0 + 5.0 if timeout_ms else self.timeout_s
        sent_ns = time.monotonic_ns()
        answer = self._roundtrip(p.encode_request(req), rid, wait_s)
        if isinstance(answer, InferError):
            raise answer
        return to_result(answer, traceparent, sent_ns)

    def control(self, verb: str, **args: Any) -> Any:
        rid = f"ctl-{next(self._ids)}"
        frames = p.encode(p.ControlRequest(rid, verb, keyed(args, self.api_key),
                                           self.admin_token))
        return control_result(self._roundtrip(frames, rid, self.timeout_s))

    def stream(self, model: str, inputs: Mapping[str, np.ndarray] | Sequence[p.Tensor], *,
               version: int | None = None, priority: int = 0, timeout_ms: float | None = None,
               outputs: Sequence[str] | None = None, tenant: str = "",
               api_key: str | None = None, traceparent: str = "",
               tracestate: str = "", routing_key: str = "") -> Stream:
        """A request whose responses come as a stream (a decoupled model's), iterated as
        :class:`StreamResponse` objects (see :mod:`zeroserve.broker.streamclient`).
        ``timeout_ms`` bounds the first response; each later one may take up to the
        client's ``timeout_s``. Other calls on this client may be made meanwhile.
        ``traceparent`` (W3C, with ``tracestate``) reaches the worker, whose spans it
        parents in opentelemetry mode (a stream has no Triton-mode record)."""
        rid = str(next(self._ids))
        trace = tracing.context(traceparent, tracestate) if traceparent else None
        req = p.InferRequest(rid, model, tensors_of(inputs), version, priority, timeout_ms or 0.0,
                             tenant, outputs, self.api_key if api_key is None else api_key,
                             stream=True, trace=trace, routing_key=routing_key)
        first_wait_s = timeout_ms / 1000.0 + 5.0 if timeout_ms else self.timeout_s
        self._send_request(p.encode_request(req), first_wait_s)
        self._inbox[rid] = collections.deque()
        return Stream(lambda wait_s: self._receive(rid, wait_s),
                      lambda cancel: self._end_stream(rid, cancel), first_wait_s, self.timeout_s)

    def _receive(self, rid: str, wait_s: float) -> Any:
        inbox = self._inbox.get(rid)
        answer = inbox.popleft() if inbox else self._await(rid, wait_s)
        if isinstance(answer, InferError):
            raise answer
        return answer

    def _end_stream(self, rid: str, cancel: bool) -> None:
        if self._inbox.pop(rid, None) is not None and cancel:
            try:
                self._sock.send_multipart(p.encode(p.Cancel(rid)), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass   # not connected: the broker withdrew it with the connection

    def _roundtrip(self, frames: list[Any], rid: str, wait_s: float) -> Any:
        self._send_request(frames, wait_s)
        return self._await(rid, wait_s)

    def _send_request(self, frames: list[Any], wait_s: float) -> None:
        # IMMEDIATE: writable only once connected, so a missing broker times out here
        if not self._sock.poll(0, zmq.POLLOUT) and \
                not self._await_connection(min(wait_s, self.connect_timeout_s)):
            raise unreachable(self.endpoint, self._refused)
        if not self._inbox:
            self._disconnected()  # a drop before this request says nothing about it
        self._sock.send_multipart(frames, copy=False)

    def _await(self, rid: str, wait_s: float) -> Any:
        """The answer to ``rid``; open streams' answers met meanwhile are kept."""
        deadline = time.monotonic() + wait_s
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            events = dict(self._poller.poll(left_ms)) if left_ms > 0 else {}
            if self._sock in events:
                # one message may hold answers to several requests (the parts one step of
                # a batch of streams made): each is kept, not only the one awaited
                mine: list[Any] = []
                for _, got, answer in decode_answers(self._sock.recv_multipart(copy=False)):
                    if got == rid and not mine:
                        mine.append(answer)
                    elif got in self._inbox:
                        self._inbox[got].append(answer)
                if mine:
                    return mine[0]
            elif self._monitor in events:
                if self._disconnected():
                    self._fail_streams(InferError(p.ErrorCode.UNAVAILABLE, LOST))
                    raise InferError(p.ErrorCode.UNAVAILABLE, LOST)
            else:
                # start over on a fresh socket so a late answer to this request can
                # never be read as another's
                self._reset()
                self._fail_streams(InferError(
                    p.ErrorCode.UNAVAILABLE, "the client's connection was reset while "
                    "another call waited too long; retry"))
                raise InferError(p.ErrorCode.UNAVAILABLE,
                                 f"no answer from the broker within {wait_s:g} s")

    def _fail_streams(self, err: InferError) -> None:
        """Every open stream ends with ``err`` after what it has already received."""
        for inbox in self._inbox.values():
            inbox.append(err)

    def _reset(self) -> None:
        self.close()
        self._open()

    def close(self) -> None:
        unwatch(self._sock, self._monitor)
        self._sock.close(linger=0)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class AsyncClient:
    """asyncio client: one DEALER, one reader callback, futures keyed by request id.

    The socket is a plain ZeroMQ socket read from the event loop's own selector
    (``add_reader`` on its file descriptor, drained while ZMQ_EVENTS says readable):
    zmq.asyncio's futures per message cost about a fifth of the gateway's CPU.

    Requests made in the same turn of the event loop leave in one REQUESTS message
    once the broker's PONG says it speaks protocol version 2 (and their replies come
    back bundled the same way): each message costs both ends a system call and its
    Python handling, whatever it holds. One made while nothing else is in flight leaves
    at once, as there is nothing to bundle it with. A turn that makes more than FLUSH_AT
    sends every FLUSH_AT at once, so the broker and the worker start on them while this
    process goes on with the rest.

    ``broker_timeout_s`` bounds how long the broker may stay silent (it answers a
    ping every ``ping_s``) before pending requests fail as ``unavailable``. ``on_pong``
    is given each PONG's header (the gateway reads the trace settings' version there).
    """

    def __init__(self, endpoint: str | None = None, *, ping_s: float = 0.5,
                 broker_timeout_s: float = 3.0, ctx: zmq.Context[Any] | None = None,
                 admin_token: str = "", api_key: str = "",
                 curve_keys: curve.ClientKeys | None = None,
                 on_pong: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.endpoint = endpoint or Endpoints.in_dir().frontend
        self.curve_keys = curve_keys
        self._refused = 0
        self.admin_token = admin_token
        self.api_key = api_key  # the default key; the gateway passes each caller's instead
        self.ping_s = ping_s
        self.broker_timeout_s = broker_timeout_s
        self.on_pong = on_pong
        self._ctx = ctx or zmq.Context.instance()
        self._sock: zmq.Socket[Any] | None = None
        self._monitor: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count(1)
        self._pending: dict[str, asyncio.Future[Any]] = {}
        self._streams: dict[str, asyncio.Queue[Any]] = {}   # open streams' answers
        self._tasks: list[asyncio.Task[None]] = []
        self._last_heard = -float("inf")
        self._bundles = False    # the broker speaks version 2: send REQUESTS
        self._outbox: dict[str, p.InferRequest] = {}   # to leave at the end of this turn
        self._flush_due = False

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._sock = new_socket(self._ctx, self.endpoint, self.curve_keys)
        self._monitor = watch(self._sock)
        self._loop.add_reader(fd_of(self._sock), self._drain)
        self._loop.add_reader(fd_of(self._monitor), self._drain_monitor)
        self._tasks = [self._loop.create_task(self._pinger(), name="zeroserve-client-pinger")]
        self._drain()
        self._drain_monitor()

    def census(self) -> dict[str, int]:
        """What this client holds of requests, by name: 0 once each has its answer."""
        return {"client.pending": len(self._pending), "client.outbox": len(self._outbox)}

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
                            tenant: str = "", api_key: str | None = None,
                            trace: dict[str, str] | None = None,
                            routing_key: str = "") -> p.InferReply:
        """Like :meth:`infer` but with raw tensors in and out (no numpy conversion);
        ``trace`` is the wire's trace context (:func:`zeroserve.broker.tracing.context`)."""
        rid = str(next(self._ids))
        req = p.InferRequest(rid, model, tensors, version, priority, timeout_ms, tenant, outputs,
                             self.api_key if api_key is None else api_key, trace=trace,
                             routing_key=routing_key)
        answer = await self._call(req, rid, cancel=True)
        if isinstance(answer, InferError):
            raise answer
        return answer  # type: ignore[no-any-return]

    async def infer_rows(self, model: str, rows: Sequence[Sequence[p.Tensor]], *,
                         version: int | None = None, priority: int = 0,
                         timeout_ms: float = 0.0, outputs: Sequence[str] | None = None,
                         api_key: str | None = None, trace: dict[str, str] | None = None,
                         routing_key: str = "") -> list[p.InferReply]:
        """The inputs of one request (an embeddings call's texts), each sent as a request
        of its own so that it is a row of the broker's batcher: batched with other
        requests' rows by priority and deadline, never waiting for a batch of its own.
        The answers come back in order once the last is in. The first input to fail
        fails the request (:class:`RowError`, naming it) at once, and every input not
        yet answered is withdrawn: nothing of the request stays in the broker."""
        assert self._loop is not None, "call start() first"
        if not self.connected:
            raise unreachable(self.endpoint, self._refused)
        key = self.api_key if api_key is None else api_key
        loop = self._loop
        whole: asyncio.Future[RowError | None] = loop.create_future()
        left = len(rows)
        futures: list[tuple[str, asyncio.Future[Any]]] = []

        def done(i: int, fut: asyncio.Future[Any]) -> None:
            nonlocal left
            left -= 1
            if whole.done():
                return
            answer = fut.result()
            if isinstance(answer, InferError):
                whole.set_result(RowError(i, answer))
            elif not left:
                whole.set_result(None)

        try:
            for i, tensors in enumerate(rows):
                rid = str(next(self._ids))
                fut: asyncio.Future[Any] = loop.create_future()
                fut.add_done_callback(partial(done, i))
                self._pending[rid] = fut
                futures.append((rid, fut))
                req = p.InferRequest(rid, model, tensors, version, priority, timeout_ms, "",
                                     outputs, key, trace=trace, routing_key=routing_key, row=i)
                if not self._submit(req, rid):
                    fut.set_result(InferError(*_FULL))
            if not rows:
                return []
            failed = await whole
            if failed is not None:
                raise failed
            return [fut.result() for _, fut in futures]
        finally:
            for rid, fut in futures:
                self._pending.pop(rid, None)
                if not fut.done():
                    fut.cancel()
                    if self._outbox.pop(rid, None) is None and self._sock is not None:
                        self._send(p.encode(p.Cancel(rid)))

    async def infer(self, model: str, inputs: Mapping[str, np.ndarray] | Sequence[p.Tensor],
                    traceparent: str = "", tracestate: str = "", **kwargs: Any) -> InferResult:
        if traceparent:
            kwargs["trace"] = tracing.context(traceparent, tracestate)
        sent_ns = time.monotonic_ns()
        reply = await self.infer_tensors(model, tensors_of(inputs), **kwargs)
        return to_result(reply, traceparent, sent_ns)

    def stream(self, model: str, inputs: Mapping[str, np.ndarray] | Sequence[p.Tensor], *,
               version: int | None = None, priority: int = 0, timeout_ms: float | None = None,
               outputs: Sequence[str] | None = None, tenant: str = "",
               api_key: str | None = None, traceparent: str = "", tracestate: str = "",
               trace: dict[str, str] | None = None, routing_key: str = "") -> AsyncStream:
        """A request whose responses come as a stream, iterated with ``async for`` as
        :class:`StreamResponse` objects (see :mod:`zeroserve.broker.streamclient`);
        errors, the broker's refusal included, are raised out of the iteration.
        ``timeout_ms`` (the broker's deadline) bounds the first response. ``traceparent``
        as for :meth:`Client.stream`; ``trace`` is the wire's trace context instead
        (:func:`zeroserve.broker.tracing.context`)."""
        if traceparent:
            trace = tracing.context(traceparent, tracestate)
        assert self._loop is not None, "call start() first"
        rid = str(next(self._ids))
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._streams[rid] = queue
        if not self.connected:
            queue.put_nowait(unreachable(self.endpoint, self._refused))
        else:
            tensors = list(inputs) if not isinstance(inputs, Mapping) else tensors_of(inputs)
            req = p.InferRequest(rid, model, tensors, version, priority, timeout_ms or 0.0,
                                 tenant, outputs, self.api_key if api_key is None else api_key,
                                 stream=True, trace=trace, routing_key=routing_key)
            if not self._submit(req, rid):
                queue.put_nowait(InferError(*_FULL))
        return AsyncStream(queue, lambda cancel: self._end_stream(rid, cancel))

    def _end_stream(self, rid: str, cancel: bool) -> None:
        if self._streams.pop(rid, None) is not None and cancel:
            if self._outbox.pop(rid, None) is None and self._sock is not None:
                self._send(p.encode(p.Cancel(rid)))

    async def control(self, verb: str, **args: Any) -> Any:
        rid = f"ctl-{next(self._ids)}"
        msg = p.ControlRequest(rid, verb, keyed(args, self.api_key), self.admin_token)
        header = await self._call(p.encode(msg), rid, cancel=False)
        if isinstance(header, InferError):
            raise header
        return control_result(header)

    async def _call(self, msg: list[Any] | p.InferRequest, rid: str, cancel: bool) -> Any:
        assert self._sock is not None and self._loop is not None, "call start() first"
        if not self.connected:
            raise unreachable(self.endpoint, self._refused)
        fut: asyncio.Future[Any] = self._loop.create_future()
        self._pending[rid] = fut
        try:
            if not self._submit(msg, rid):
                raise InferError(*_FULL)
            return await fut
        except asyncio.CancelledError:
            if self._outbox.pop(rid, None) is None and cancel and self._sock is not None:
                self._send(p.encode(p.Cancel(rid)))
            raise
        finally:
            self._pending.pop(rid, None)

    def _submit(self, msg: list[Any] | p.InferRequest, rid: str) -> bool:
        """Send now, or with this turn's bundle; False if the socket would block."""
        assert self._loop is not None
        # alone in flight, a request leaves now: waiting for the turn's end to bundle it
        # with nothing cost it a turn of the event loop (mlp, direct C=1)
        if isinstance(msg, p.InferRequest) and self._bundles and (
                self._outbox or len(self._pending) + len(self._streams) > 1):
            self._outbox[rid] = msg
            if len(self._outbox) >= FLUSH_AT:
                self._flush()
            elif not self._flush_due:
                self._flush_due = True
                self._loop.call_soon(self._flush)
            return True
        return self._send(p.encode_request(msg) if isinstance(msg, p.InferRequest) else msg)

    def _flush(self) -> None:
        """The requests of this turn of the event loop, in as few messages as allowed."""
        self._flush_due = False
        reqs, self._outbox = list(self._outbox.values()), {}
        for i in range(0, len(reqs), p.MAX_BUNDLE):
            chunk = reqs[i:i + p.MAX_BUNDLE]
            frames = (p.encode_request(chunk[0]) if len(chunk) == 1
                      else p.encode_requests(chunk))
            if self._sock is None or not self._send(frames):
                for req in chunk:
                    self._answer(req.request_id, InferError(*_FULL))

    def _send(self, frames: list[Any]) -> bool:
        assert self._sock is not None and self._loop is not None
        try:
            send_now(self._sock, frames)
        except zmq.ZMQError:  # Again: not connected (IMMEDIATE queues nothing)
            return False
        # ZeroMQ's descriptor is edge-triggered and a send can consume the edge:
        # look for answers that arrived meanwhile, or the reader may never wake.
        if readable(self._sock):
            self._loop.call_soon(self._drain)
        return True

    def _drain(self) -> None:
        sock = self._sock
        if sock is None:
            return
        while readable(sock):
            frames = receive(sock)
            self._last_heard = time.monotonic()
            try:
                answers = decode_answers(frames)
            except p.ProtocolError:
                continue
            for kind, rid, answer in answers:
                if kind is p.Kind.PONG:
                    versions = answer.get("versions")
                    self._bundles = isinstance(versions, list) and 2 in versions
                    if self.on_pong is not None:
                        self.on_pong(answer)
                    continue
                self._answer(rid, answer)

    def _drain_monitor(self) -> None:
        """A dropped connection fails every pending request at once (retryable): the
        broker that had them is gone or has forgotten us."""
        monitor = self._monitor
        while monitor is not None and monitor.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            event = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
            self._refused = event["event"] if curve.refusal(event) else self._refused
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._last_heard = -float("inf")  # not connected until it answers again
                self._bundles = False             # the next broker says what it speaks
                self._fail_pending(LOST)

    async def _pinger(self) -> None:
        was_connected = False
        while True:
            self._send(p.encode(p.Ping()))
            await asyncio.sleep(self.ping_s)
            # belt and braces for the edge-triggered descriptors: a missed edge costs
            # at most one ping interval, never a hang
            self._drain()
            self._drain_monitor()
            if was_connected and not self.connected:
                self._fail_pending("lost contact with the broker")
            was_connected = self.connected

    def _answer(self, rid: str, answer: Any) -> None:
        fut = self._pending.get(rid)
        if fut is not None:
            if not fut.done():
                fut.set_result(answer)
            return
        queue = self._streams.get(rid)
        if queue is not None:
            queue.put_nowait(answer)

    def _fail_pending(self, why: str) -> None:
        self._outbox.clear()   # failed here: they must not leave for the broker later
        for fut in list(self._pending.values()):
            if not fut.done():
                fut.set_result(InferError(p.ErrorCode.UNAVAILABLE, why))
        for queue in self._streams.values():
            queue.put_nowait(InferError(p.ErrorCode.UNAVAILABLE, why))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
        self._tasks = []
        if self._sock is not None and self._loop is not None:
            self._loop.remove_reader(fd_of(self._sock))
            self._loop.remove_reader(fd_of(self._monitor))
            unwatch(self._sock, self._monitor)
            self._sock.close(linger=0)
            self._sock = None
        self._fail_pending("client closed")

    async def __aenter__(self) -> "AsyncClient":
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
