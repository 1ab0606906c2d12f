"""uvicorn's httptools protocol with the infer route's answer written in one system call.

uvicorn writes a response's head when the app sends ``http.response.start`` and its body
on ``http.response.body``: two writes, two TCP segments, and a reader that may wake for
each. py-spy at C=64 on ``mlp`` found those two writes at 18% of the gateway's CPU. The
infer route sends both at once (gateway/routes/infer.py), so for it the head waits for
the body and both leave in one ``writelines`` (uvloop gathers them into one writev).
Other routes stream (generate, SSE) and keep uvicorn's writes as they are.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["HeadWithBody", "InferHttpProtocol"]

CONTINUE = b"HTTP/1.1 100 "


class HeadWithBody(asyncio.Transport):
    """A request's view of its connection: the response's head (the first write other
    than a 100 Continue) is held and leaves with the next write. A head never followed
    by a body (the app failed after starting) leaves when the connection closes."""

    __slots__ = ("transport", "head", "held")

    def __init__(self, transport: asyncio.Transport) -> None:
        super().__init__()
        self.transport = transport
        self.head: bytes | None = None
        self.held = False   # once the head has been seen, writes go straight through

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self.head is not None:
            head, self.head = self.head, None
            self.transport.writelines((head, data))
        elif self.held or data[:len(CONTINUE)] == CONTINUE:
            self.transport.write(data)
        else:
            self.head, self.held = bytes(data), True

    def close(self) -> None:
        if self.head is not None:
            head, self.head = self.head, None
            self.transport.write(head)
        self.transport.close()

    def is_closing(self) -> bool:
        return self.transport.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.transport.get_extra_info(name, default)


class InferHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol; a request to an infer route answers in one write."""

    def on_headers_complete(self) -> None:
        before = self.cycle
        super().on_headers_complete()
        # the request's cycle exists now and its task has not run yet (an upgrade
        # makes none)
        cycle = self.cycle
        if cycle is not before and cycle.scope["method"] == "POST" and \
                cycle.scope["path"].endswith("/infer"):
            cycle.transport = HeadWithBody(cycle.transport)
