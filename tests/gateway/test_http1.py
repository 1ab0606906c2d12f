"""gateway/http1.py: an infer route's body is taken and its answer written in one write
through the request's OneWrite; other routes keep uvicorn's messages.

A real uvicorn server on loopback runs the gateway's protocol class. The app answers an
infer route with the OneWrite it finds in the scope (and says so in a header), and any
other route with a head, a pause, then its body, so a head written on its own reaches
the client a pause before the body.
"""

from __future__ import annotations

import asyncio
import gc
import socket
import threading
import time
from typing import Any, Iterator

import pytest
import uvicorn
import uvloop

from tests.conftest import free_port, wait_for
from zeroserve.gateway.http1 import ONE_WRITE, InferHttpProtocol

PAUSE_S = 1.0   # a reader stalled longer than this on a loaded host would see both
BODY = b'{"ok":true}'


async def app(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    one = scope.get(ONE_WRITE)
    if one is not None:
        got = one.body()
        if got is None:   # still on its way (100 Continue): read as uvicorn gives it
            got = b""
            while True:
                message = await receive()
                got += message.get("body", b"")
                if not message.get("more_body"):
                    break
        one.answer(200, b"application/json", BODY + got[:0],
                   [(b"x-echo-length", b"%d" % len(got))])
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", b"%d" % len(BODY))]})
    await asyncio.sleep(PAUSE_S)  # noqa: sleep-ok - the gap between head and body under test
    await send({"type": "http.response.body", "body": BODY})


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    config = uvicorn.Config(app, host="127.0.0.1", port=free_port(), loop="uvloop",
                            http=InferHttpProtocol, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, 10, "uvicorn to start")
        yield config.port
    finally:
        server.should_exit = True
        thread.join(10)
        assert not thread.is_alive()


def request(method: str, path: str, body: bytes = b"", close: bool = True) -> bytes:
    return (f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
            f"{'Connection: close' + chr(13) + chr(10) if close else ''}\r\n").encode() + body


def read_answer(sock: socket.socket, first: bytes = b"") -> bytes:
    got = first
    deadline = time.monotonic() + 10
    while not got.endswith(BODY) and time.monotonic() < deadline:
        chunk = sock.recv(65536)
        if not chunk:
            break
        got += chunk
    return got


def first_read(port: int, method: str, path: str, body: bytes = b"") -> tuple[bytes, bytes]:
    """What the first read of the answer holds, and the whole answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request(method, path, body))
        first = sock.recv(65536)
        return first, read_answer(sock, first)


@pytest.mark.parametrize("path", ["/v2/models/m/infer", "/v2/models/m/versions/2/infer"])
def test_infer_answer_leaves_in_one_write(port: int, path: str) -> None:
    first, whole = first_read(port, "POST", path, b"{}")
    assert first.startswith(b"HTTP/1.1 200 ") and first.endswith(BODY)
    assert first == whole
    head = first.split(b"\r\n\r\n")[0].lower().split(b"\r\n")
    assert b"content-length: %d" % len(BODY) in head and b"x-echo-length: 2" in head
    assert b"connection: close" in head and b"server: uvicorn" in head


@pytest.mark.parametrize("method, path", [("POST", "/v2/models/m/generate_stream"),
                                          ("GET", "/v2/models/m/infer")])
def test_other_routes_send_their_head_at_once(port: int, method: str, path: str) -> None:
    first, whole = first_read(port, method, path)
    assert first.startswith(b"HTTP/1.1 200 ") and first.endswith(b"\r\n\r\n")
    assert whole.endswith(BODY)


def test_keep_alive_serves_the_next_request_on_the_connection(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        for body in (b"{}", b"[1,2,3]"):
            sock.sendall(request("POST", "/v2/models/m/infer", body, close=False))
            answer = read_answer(sock)
            head = answer.split(b"\r\n\r\n")[0].lower().split(b"\r\n")
            assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(BODY)
            assert b"x-echo-length: %d" % len(body) in head
            assert b"connection: close" not in head


def test_expect_continue_then_one_write(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST /v2/models/m/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
                     b"Expect: 100-continue\r\nConnection: close\r\n\r\n")
        got = b""
        while b"\r\n\r\n" not in got:
            got += sock.recv(65536)
        assert got.startswith(b"HTTP/1.1 100 ")
        sock.sendall(b"{}")
        answer = read_answer(sock, got.split(b"\r\n\r\n", 1)[1])
        assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(BODY)
        assert b"x-echo-length: 2" in answer.lower()


def test_the_infer_route_leaves_no_cyclic_garbage() -> None:
    """Each request's objects go when it ends, by reference counting: a cycle through
    the scope (its OneWrite holds uvicorn's cycle, which holds the scope) left 11 objects
    a request to the cyclic collector, whose passes cost the gateway 11 us a request."""
    from tests.bench.bench_http1 import gateway_route, run

    async def garbage_of(n: int) -> int:
        route = gateway_route()
        await run(route, 20)   # first calls fill caches, which are not garbage
        gc.collect()
        gc.disable()
        try:
            _, writes = await run(route, n)
            assert writes == n
            return gc.collect()
        finally:
            gc.enable()

    assert uvloop.run(garbage_of(200)) < 20   # 2,200 before
