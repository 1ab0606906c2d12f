"""Handlers that call models (Triton's BLS): the client a Python handler is given.

A handler asks for it by taking ``models`` in its ``load()``; its ``predict()`` then calls
``models.infer(...)``, ``await models.infer_async(...)`` or ``models.infer_many([...])``.
The client is a client of the broker like any other (one AsyncClient per worker process
on the broker's frontend, run on a thread of its own), so each call is queued, batched
and admitted with everyone else's calls to that model.

Every call inherits its caller's context (docs/bls.md): the batch's earliest deadline,
its highest priority, and the key and trace context of its first request (the one the
scheduler took first), or those of one request with ``item=i``. A call whose caller's
deadline has passed fails here, before it reaches the broker.

Such a handler's batches run on threads of their own (workers/callers.py), so the compute
thread keeps taking batches while one waits; the first call of a batch tells the broker
(``Waiting``) that it holds no credit until its result, so the models it waits on can run
on this very worker. No worker waits on work only it can run.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch
import zmq

from zeroserve.broker import curve, protocol as p
from zeroserve.broker.client import AsyncClient, InferError
from zeroserve.workers.batching import encode_output

__all__ = ["Call", "CallContext", "ModelCallError", "ModelsClient", "Origin"]

logger = logging.getLogger(__name__)

CONNECT_WAIT_S = 5.0    # the longest a call waits for the broker to answer our first ping
GRACE_S = 5.0           # past its deadline, the broker's answer (deadline exceeded) is due


class ModelCallError(Exception):
    """A call to another model failed: ``model``, the typed ``code`` (``p.ErrorCode``)
    and the ``message``. Uncaught, it fails the caller's requests with this text."""

    def __init__(self, model: str, code: p.ErrorCode, message: str) -> None:
        super().__init__(f"call to model {model!r} failed: {code.value}: {message}")
        self.model = model
        self.code = code
        self.message = message

    @property
    def retryable(self) -> bool:
        return self.code.retryable


@dataclass(frozen=True)
class Origin:
    """What calls made for a request inherit: its deadline on this process's monotonic
    clock (inf: none), its priority level, its API key and its W3C trace context."""

    deadline_s: float = math.inf
    priority: int = 0
    api_key: str = ""
    trace: dict[str, str] | None = None


@dataclass
class CallContext:
    """The context of one batch's predict(): ``batch`` is what a call inherits by
    default (the earliest deadline, the highest priority, the first request's key and
    trace); ``items`` each request's own. ``on_wait`` tells the broker, once, that the
    batch waits on calls."""

    batch_id: int
    batch: Origin
    items: tuple[Origin, ...]
    on_wait: Callable[[int], None] = field(default=lambda batch_id: None)
    _waited: bool = False

    def waiting(self) -> None:
        if not self._waited:
            self._waited = True
            self.on_wait(self.batch_id)

    def origin(self, item: int | None) -> Origin:
        if item is None:
            return self.batch
        if not 0 <= item < len(self.items):
            raise IndexError(f"item {item} is not in this batch of {len(self.items)}")
        return self.items[item]


def context_of(batch: p.Batch, received_s: float,
               on_wait: Callable[[int], None]) -> CallContext:
    """A batch's call context; deadlines count from when the batch was received."""
    traces = {i: ctx for i, ctx, _ in batch.trace.items} if batch.trace is not None else {}
    callers = batch.callers or [p.Caller() for _ in batch.items]
    items = tuple(Origin(received_s + c.timeout_ms / 1000.0 if c.timeout_ms > 0 else math.inf,
                         c.priority, c.api_key, traces.get(i) or None)
                  for i, c in enumerate(callers))
    if not items:
        return CallContext(batch.batch_id, Origin(), (), on_wait)
    # the first request is the one the scheduler took first: highest priority, then
    # earliest deadline; its key and trace speak for the batch
    first = items[0]
    levels = [o.priority for o in items if o.priority > 0]
    deadline = min(o.deadline_s for o in items)
    if batch.timeout_ms > 0:   # a broker that sends no callers still sends the tightest
        deadline = min(deadline, received_s + batch.timeout_ms / 1000.0)
    shared = Origin(deadline, min(levels, default=0), first.api_key,
                    first.trace or next((o.trace for o in items if o.trace), None))
    return CallContext(batch.batch_id, shared, items, on_wait)


_current: contextvars.ContextVar[CallContext | None] = contextvars.ContextVar(
    "zeroserve_call_context", default=None)


@contextlib.contextmanager
def calling(ctx: CallContext) -> Iterator[None]:
    """Within it, calls made on this thread (and tasks it starts) inherit ``ctx``."""
    token = _current.set(ctx)
    try:
        yield
    finally:
        _current.reset(token)


@dataclass(frozen=True)
class Call:
    """One call of :meth:`ModelsClient.infer_many`."""

    model: str
    inputs: Mapping[str, Any]
    version: int | None = None
    outputs: Sequence[str] | None = None
    item: int | None = None
    timeout_ms: float | None = None


def _tensors(inputs: Mapping[str, Any]) -> list[p.Tensor]:
    out = []
    for name, value in inputs.items():
        if isinstance(value, torch.Tensor):
            out.append(encode_output(name, value.detach().to("cpu").contiguous()))
        elif isinstance(value, np.ndarray) and value.dtype == object:
            out.append(encode_output(name, value))
        else:
            out.append(p.from_numpy(name, np.asarray(value)))
    return out


def _outputs(reply: p.InferReply, as_torch: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for t in reply.tensors:
        arr = p.to_numpy(t)
        # numpy's view of the reply's frame is read-only; torch wants its own memory
        out[t.meta.name] = torch.from_numpy(arr.copy()) if as_torch and arr.dtype != object \
            else arr
    return out


class ModelsClient:
    """The client a handler is given. Thread-safe: every call goes through one
    AsyncClient on the client's own thread and event loop."""

    def __init__(self, endpoint: str, *, curve_keys: curve.ClientKeys | None = None,
                 ctx: zmq.Context[Any] | None = None) -> None:
        self.endpoint = endpoint
        self._curve_keys = curve_keys
        self._ctx = ctx
        self._client: AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """Its thread and socket (at once: the broker's first PONG takes a round trip)."""
        with self._lock:
            if self._thread is not None:
                return
            loop = self._loop = asyncio.new_event_loop()
            self._client = AsyncClient(self.endpoint, curve_keys=self._curve_keys,
                                       ctx=self._ctx)
            self._thread = threading.Thread(target=loop.run_forever, daemon=True,
                                            name="zeroserve-models-client")
            self._thread.start()
            asyncio.run_coroutine_threadsafe(self._client.start(), loop).result()

    def close(self) -> None:
        with self._lock:
            loop, client, thread = self._loop, self._client, self._thread
            self._thread = None
        if loop is None or client is None or thread is None:
            return
        asyncio.run_coroutine_threadsafe(client.close(), loop).result(timeout=5.0)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5.0)
        loop.close()

    def census(self) -> dict[str, int]:
        return self._client.census() if self._client is not None else {}

    # -- the caller ---------------------------------------------------------------
    @staticmethod
    def caller(item: int | None = None) -> Origin:
        """What a call made now inherits (the batch's, or request ``item``'s); outside a
        predict() nothing: no deadline, the default priority, no key, no trace."""
        ctx = _current.get()
        return ctx.origin(item) if ctx is not None else Origin()

    def remaining_ms(self, item: int | None = None) -> float:
        """The caller's budget left, in ms (inf: it has no deadline)."""
        return (self.caller(item).deadline_s - time.monotonic()) * 1000.0

    # -- the calls ----------------------------------------------------------------
    def infer(self, model: str, inputs: Mapping[str, Any], *, version: int | None = None,
              outputs: Sequence[str] | None = None, item: int | None = None,
              timeout_ms: float | None = None, as_torch: bool = False) -> dict[str, Any]:
        """Call ``model`` and wait: its outputs by name (numpy; torch with ``as_torch``).
        Raises :class:`ModelCallError`."""
        call = Call(model, inputs, version, outputs, item, timeout_ms)
        fut, wait_s = self._submit(call)
        return _outputs(self._wait(call, fut, wait_s), as_torch)

    async def infer_async(self, model: str, inputs: Mapping[str, Any], *,
                          version: int | None = None, outputs: Sequence[str] | None = None,
                          item: int | None = None, timeout_ms: float | None = None,
                          as_torch: bool = False) -> dict[str, Any]:
        """As :meth:`infer`, awaited from the handler's own event loop (an ``async def
        predict``); cancelling it withdraws the call from the broker."""
        call = Call(model, inputs, version, outputs, item, timeout_ms)
        fut, _ = self._submit(call)
        try:
            answer = await asyncio.wrap_future(fut)
        except InferError as err:
            raise ModelCallError(model, err.code, err.message) from None
        return _outputs(answer, as_torch)

    def infer_many(self, calls: Sequence[Call | tuple[str, Mapping[str, Any]]], *,
                   as_torch: bool = False, return_errors: bool = False) -> list[Any]:
        """Several calls at once (they leave together and may batch with each other);
        their outputs in order. The first failure raises once all are answered, or
        with ``return_errors`` each failure takes its call's place as a
        :class:`ModelCallError`."""
        made = [c if isinstance(c, Call) else Call(c[0], c[1]) for c in calls]
        sent: list[tuple[Call, concurrent.futures.Future[Any] | ModelCallError, float]] = []
        for call in made:
            try:
                sent.append((call, *self._submit(call)))
            except ModelCallError as err:
                sent.append((call, err, 0.0))
        results: list[Any] = []
        for call, fut, wait_s in sent:
            try:
                if isinstance(fut, ModelCallError):
                    raise fut
                results.append(_outputs(self._wait(call, fut, wait_s), as_torch))
            except ModelCallError as err:
                results.append(err)
        if not return_errors:
            for r in results:
                if isinstance(r, ModelCallError):
                    raise r
        return results

    def _submit(self, call: Call) -> tuple[concurrent.futures.Future[Any], float]:
        """The call sent on the client's loop, and how long to wait for it at most."""
        ctx = _current.get()
        origin = ctx.origin(call.item) if ctx is not None else Origin()
        now = time.monotonic()
        left_ms = (origin.deadline_s - now) * 1000.0
        if left_ms <= 0:
            raise ModelCallError(call.model, p.ErrorCode.DEADLINE,
                                 "the caller's deadline has passed; the call was not sent")
        timeout_ms = min(left_ms, call.timeout_ms or math.inf)
        if self._thread is None:
            self.start()
        assert self._client is not None and self._loop is not None
        if ctx is not None:
            ctx.waiting()
        coro = self._call(call, origin, 0.0 if timeout_ms == math.inf else timeout_ms)
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        wait_s = timeout_ms / 1000.0 + GRACE_S if timeout_ms < math.inf else math.inf
        return fut, wait_s

    async def _call(self, call: Call, origin: Origin, timeout_ms: float) -> p.InferReply:
        client = self._client
        assert client is not None
        if not client.connected:
            await client.wait_connected(min(CONNECT_WAIT_S, timeout_ms / 1000.0 or math.inf))
        return await client.infer_tensors(
            call.model, _tensors(call.inputs), version=call.version, priority=origin.priority,
            timeout_ms=timeout_ms, outputs=call.outputs, api_key=origin.api_key,
            trace=origin.trace)

    @staticmethod
    def _wait(call: Call, fut: concurrent.futures.Future[Any], wait_s: float) -> p.InferReply:
        try:
            return fut.result(timeout=None if wait_s == math.inf else wait_s)  # type: ignore[no-any-return]
        except InferError as err:
            raise ModelCallError(call.model, err.code, err.message) from None
        except concurrent.futures.TimeoutError:
            fut.cancel()   # withdraws it from the broker
            raise ModelCallError(call.model, p.ErrorCode.DEADLINE,
                                 f"no answer within {wait_s:g} s") from None
