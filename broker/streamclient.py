"""The direct client's streams: one request to a decoupled model, many responses.

``Client.stream`` returns a :class:`Stream` (an iterator), ``AsyncClient.stream`` an
:class:`AsyncStream` (an async iterator)::

    with Client() as c:
        for r in c.stream("chargen", {"text_input": np.array([[b"ab"]], object)}):
            print(r.index, r.final, r.outputs["text_output"])

    async with AsyncClient() as c:
        async for r in c.stream("chargen", inputs, timeout_ms=500):
            ...

Each :class:`StreamResponse` is one response, in order (``index`` 0, 1, ...); the one
with ``final`` ends the iteration (it may carry no outputs: an empty final response).
An error, at any point, raises the client's ``InferError`` out of the iteration and
ends it. Leaving the iteration early (``break``, ``close()``, the ``with`` block's
end, or the iterator being dropped) cancels the request at the broker, which stops
the generation at its worker. A stream on a model that is not decoupled yields its
one reply as a single final response. The request leaves when ``stream()`` is called.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterator

import numpy as np

from zeroserve.broker import protocol as p


@dataclass
class StreamResponse:
    model: str
    version: int
    outputs: dict[str, np.ndarray]
    final: bool
    index: int
    stats: dict[str, float] = field(default_factory=dict)
    # the raw tensors (datatype and bytes as sent; BF16 has no numpy dtype), for front
    # ends that forward them without converting
    tensors: list[p.Tensor] = field(default_factory=list)
    build: str = ""   # the sha256 of the version's files that answered


def response_of(answer: p.StreamPart | p.InferReply) -> StreamResponse:
    tensors = list(answer.tensors)
    outputs = {t.meta.name: p.to_numpy(t) for t in tensors if t.meta.datatype != "BF16"}
    if isinstance(answer, p.InferReply):   # a model that is not decoupled: one reply
        return StreamResponse(answer.model, answer.version, outputs, True, 0,
                              dict(answer.stats), tensors, answer.build)
    return StreamResponse(answer.model, answer.version, outputs, answer.final, answer.index,
                          dict(answer.stats), tensors, answer.build)


# end(cancel): the client forgets the stream; with cancel, it tells the broker too
End = Callable[[bool], None]


class _Ending:
    """What both streams do at their end: tell the client once, cancelling the request
    at the broker when it had not finished."""

    def __init__(self, end: End) -> None:
        self._end = end
        self._done = False

    def _finish(self, cancel: bool) -> None:
        if not self._done:
            self._done = True
            self._end(cancel)

    def close(self) -> None:
        """Leave the stream now (no await needed): an unfinished request is cancelled."""
        self._finish(cancel=True)


class Stream(_Ending, Iterator[StreamResponse]):
    """A stream on the blocking client. ``receive(wait_s)`` returns the next answer or
    raises (an error answer, a timeout, a lost broker)."""

    def __init__(self, receive: Callable[[float], Any], end: End, first_wait_s: float,
                 gap_s: float) -> None:
        super().__init__(end)
        self._receive = receive
        self._wait_s = first_wait_s
        self._gap_s = gap_s

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> StreamResponse:
        if self._done:
            raise StopIteration
        try:
            answer = self._receive(self._wait_s)
        except BaseException:
            self._finish(cancel=False)   # answered with an error, or the request is gone
            raise
        self._wait_s = self._gap_s
        response = response_of(answer)
        if response.final:
            self._finish(cancel=False)
        return response

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - a finalizer must not raise (socket closed)
            pass


class AsyncStream(_Ending, AsyncIterator[StreamResponse]):
    """A stream on the asyncio client: its answers arrive in ``queue`` (an exception
    instance is raised out of the iteration). Cancelling a task awaiting it cancels
    the request too."""

    def __init__(self, queue: "asyncio.Queue[Any]", end: End) -> None:
        super().__init__(end)
        self._queue = queue

    def __aiter__(self) -> "AsyncStream":
        return self

    async def __anext__(self) -> StreamResponse:
        if self._done:
            raise StopAsyncIteration
        try:
            answer = await self._queue.get()
        except asyncio.CancelledError:
            self.close()
            raise
        if isinstance(answer, BaseException):
            self._finish(cancel=False)
            raise answer
        response = response_of(answer)
        if response.final:
            self._finish(cancel=False)
        return response

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> "AsyncStream":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - a finalizer must not raise (loop closed)
            pass
