"""uvicorn's httptools protocol with a short way in and out for the infer route.

uvicorn hands a request's body to the app as ``http.request`` messages and writes its
answer as the app sends ``http.response.start`` (the head, checked and built header by
header) and ``http.response.body``: two writes, two TCP segments, a reader that may wake
for each, and Python work per header and per message that py-spy at C=64 on ``mlp``
put at a fifth of the gateway's CPU with the writes. For ``POST .../infer`` this
protocol puts a :class:`OneWrite` in the scope (``scope[ONE_WRITE]``): the endpoint
takes the body at once when it has all arrived, and answers with one call that builds
the head from the few headers it has and writes head and body together (uvloop gathers
them into one writev). Everything else about the connection stays uvicorn's: keep-alive,
pipelining, flow control, 100 Continue (a body still on its way is read through
``receive``), the disconnect, shutdown. Other routes (generate, SSE) keep uvicorn's
messages as they are, and so does an app served by any other server.
"""

from __future__ import annotations

import asyncio
from typing import Sequence

from uvicorn.protocols.http.httptools_impl import (HEADER_VALUE_RE, STATUS_LINE,
                                                   HttpToolsProtocol, RequestResponseCycle)
from uvicorn.protocols.utils import get_client_addr, get_path_with_query_string

__all__ = ["ONE_WRITE", "InferHttpProtocol", "OneWrite"]

ONE_WRITE = "zeroserve.one_write"   # the scope key of a request's OneWrite


class OneWrite:
    """One infer request's body and answer on its uvicorn cycle, without ASGI messages.
    It keeps the cycle's own state as uvicorn's ``receive`` and ``send`` would.
    ``loop`` is the connection's, which runs the request's task: the endpoint finds its
    task with it (``asyncio.current_task(loop)``: 0.11 us, against 0.30 us without, which
    asks for the running loop, a ``getpid`` system call on CPython 3.11)."""

    __slots__ = ("cycle", "loop")

    def __init__(self, cycle: RequestResponseCycle, loop: asyncio.AbstractEventLoop) -> None:
        self.cycle = cycle
        self.loop = loop

    def body(self) -> bytes | None:
        """The whole body when it has all arrived (its ``receive`` would give it in one
        message), else None: read it with ``receive`` (100 Continue, a large body)."""
        cycle = self.cycle
        if cycle.more_body or cycle.disconnected or cycle.response_complete:
            return None
        body = bytes(cycle.body)
        cycle.body = bytearray()
        cycle.waiting_for_100_continue = False   # the body came without it
        # as receive does: the next receive (the disconnect watch) waits for news
        cycle.message_event.clear()
        cycle.flow.resume_reading()
        return body

    def answer(self, status: int, content_type: bytes, body: bytes,
               headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
        """The whole answer in one write, the response completed as ``send`` completes
        it (a client gone already gets nothing, as there)."""
        cycle = self.cycle
        if cycle.disconnected or cycle.response_started:
            return
        cycle.response_started = cycle.response_complete = True
        cycle.waiting_for_100_continue = False
        if cycle.access_log:   # the gateway runs without; uvicorn's line where it is on
            scope = cycle.scope
            cycle.access_logger.info('%s - "%s %s HTTP/%s" %d', get_client_addr(scope),
                                     scope["method"], get_path_with_query_string(scope),
                                     scope["http_version"], status)
        head = [STATUS_LINE[status]]
        for name, value in cycle.default_headers:
            head += (name, b": ", value, b"\r\n")
        head += (b"content-type: ", content_type, b"\r\ncontent-length: ",
                 b"%d" % len(body), b"\r\n")
        for name, value in headers:
            if HEADER_VALUE_RE.search(value):   # as uvicorn: no header splits the answer
                raise RuntimeError("Invalid HTTP header value.")
            head += (name, b": ", value, b"\r\n")
        if not cycle.keep_alive:
            head.append(b"connection: close\r\n")
        head.append(b"\r\n")
        cycle.transport.writelines((b"".join(head), body))
        cycle.message_event.set()
        if not cycle.keep_alive:
            cycle.transport.close()
        cycle.on_response()


class InferHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol; a request to an infer route gets a OneWrite."""

    def on_headers_complete(self) -> None:
        before = self.cycle
        super().on_headers_complete()
        # the request's cycle exists now and its task has not run yet (an upgrade
        # makes none)
        cycle = self.cycle
        if cycle is not before and cycle.scope["method"] == "POST" and \
                cycle.scope["path"].endswith("/infer"):
            cycle.scope[ONE_WRITE] = OneWrite(cycle, self.loop)  # type: ignore[literal-required]
