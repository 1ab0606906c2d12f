"""A small asyncio HTTP/1.1 keep-alive client for ``zeroserve bench``.

One :class:`HttpConnection` per concurrent stream, one request at a time on it (no
pipelining). It is an ``asyncio.Protocol`` rather than streams: a request is one
``transport.write`` and the answer is parsed from the buffer ``data_received`` fills,
which costs the load generator about half the CPU of StreamReader's readuntil and
readexactly per request (the generator shares the host with the server).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit


class HttpError(Exception):
    """The connection failed or the answer was not HTTP/1.1 we can read."""


@dataclass(frozen=True)
class Url:
    host: str
    port: int
    base_path: str

    @classmethod
    def parse(cls, url: str) -> "Url":
        parts = urlsplit(url if "//" in url else f"http://{url}")
        if parts.scheme != "http":
            raise ValueError(f"only http:// URLs are supported, not {url!r}")
        if not parts.hostname:
            raise ValueError(f"no host in {url!r}")
        return cls(parts.hostname, parts.port or 80, parts.path.rstrip("/"))

    @property
    def authority(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes


def request_bytes(url: Url, method: str, path: str, body: bytes = b"",
                  headers: dict[str, str] | None = None) -> bytes:
    """A whole request, built once and sent as is for every request of a level."""
    lines = [f"{method} {url.base_path}{path} HTTP/1.1", f"Host: {url.authority}",
             "Connection: keep-alive"]
    if body or method in ("POST", "PUT"):
        lines.append(f"Content-Length: {len(body)}")
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class HttpConnection(asyncio.Protocol):
    """One keep-alive connection; ``await conn.send(raw)`` returns the response."""

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._waiter: asyncio.Future[Response] | None = None
        self._head: tuple[int, dict[str, str], int] | None = None  # status, headers, body at
        self.closed = False

    @classmethod
    async def open(cls, url: Url, timeout_s: float = 5.0) -> "HttpConnection":
        loop = asyncio.get_running_loop()
        try:
            _, proto = await asyncio.wait_for(
                loop.create_connection(cls, url.host, url.port), timeout_s)
        except (OSError, asyncio.TimeoutError) as exc:
            raise HttpError(f"cannot connect to {url.authority}: {exc or 'timed out'}") from None
        return proto

    # -- asyncio.Protocol -------------------------------------------------
    def connection_made(self, transport: Any) -> None:
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        self._buf += data
        if self._waiter is not None and not self._waiter.done():
            self._parse()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(HttpError(f"connection closed: {exc or 'by the server'}"))

    # -- requests ---------------------------------------------------------
    async def send(self, raw: bytes, timeout_s: float = 30.0) -> Response:
        """Send one request and wait for its response; past ``timeout_s`` the connection
        is closed (an answer arriving late must not be read as the next one's)."""
        if self.closed or self._transport is None:
            raise HttpError("connection closed")
        assert self._waiter is None or self._waiter.done(), "one request at a time"
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[Response] = loop.create_future()
        self._waiter = waiter
        self._head = None
        self._transport.write(raw)
        if self._buf:  # never expected: the server spoke first
            self._parse()
        # call_later rather than asyncio.wait_for, which costs a task per request on 3.11
        timer = loop.call_later(timeout_s, self._time_out, waiter, timeout_s)
        try:
            return await waiter
        finally:
            timer.cancel()

    def _time_out(self, waiter: "asyncio.Future[Response]", timeout_s: float) -> None:
        if not waiter.done():
            waiter.set_exception(TimeoutError(f"no response within {timeout_s:g} s"))
            self.close()

    def close(self) -> None:
        if self._transport is not None and not self.closed:
            self._transport.close()
        self.closed = True

    def _parse(self) -> None:
        assert self._waiter is not None
        try:
            response = self._complete()
        except HttpError as exc:
            self._waiter.set_exception(exc)
            self.close()
            return
        if response is not None:
            if response.headers.get("connection", "").lower() == "close":
                self.close()
            self._waiter.set_result(response)

    def _complete(self) -> Response | None:
        """The response once the buffer holds all of it, else None."""
        if self._head is None:
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buf) > 65536:
                    raise HttpError("response headers over 64 KiB")
                return None
            self._head = _parse_head(bytes(self._buf[:end]), end + 4)
        status, headers, start = self._head
        if headers.get("transfer-encoding", "").lower() == "chunked":
            body = _dechunk(self._buf, start)
            if body is None:
                return None
            del self._buf[:body[1]]
            return Response(status, headers, body[0])
        length = int(headers.get("content-length", "0"))
        if len(self._buf) < start + length:
            return None
        body_bytes = bytes(self._buf[start:start + length])
        del self._buf[:start + length]
        return Response(status, headers, body_bytes)


def _parse_head(head: bytes, body_at: int) -> tuple[int, dict[str, str], int]:
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise HttpError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = headers.get("content-length")
    if length is not None and not length.isdigit():
        raise HttpError(f"bad Content-Length {length!r}")
    return int(parts[1]), headers, body_at


def _dechunk(buf: bytearray, pos: int) -> tuple[bytes, int] | None:
    """(body, end offset) of a complete chunked body starting at ``pos``, else None."""
    out = bytearray()
    while True:
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            return None
        try:
            size = int(bytes(buf[pos:eol]).split(b";")[0], 16)
        except ValueError:
            raise HttpError("bad chunk size") from None
        if size == 0:
            end = buf.find(b"\r\n\r\n", eol)  # trailers end with an empty line
            return (bytes(out), end + 4) if end >= 0 else None
        if len(buf) < eol + 2 + size + 2:
            return None
        out += buf[eol + 2:eol + 2 + size]
        pos = eol + 2 + size + 2


async def get(url: Url, path: str, timeout_s: float = 5.0) -> Response:
    """One GET on a connection of its own (metadata, metrics, health)."""
    conn = await HttpConnection.open(url, timeout_s)
    try:
        return await conn.send(request_bytes(url, "GET", path), timeout_s)
    except TimeoutError:
        raise HttpError(f"no answer from {url.authority}{path} within {timeout_s:g} s") from None
    finally:
        conn.close()
