"""HTTP helpers shared by every route module: JSON and error responses, status codes,
body reading with a size limit and request decompression, response compression."""

from __future__ import annotations

import gzip
import zlib
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from zeroserve.broker import wording
from zeroserve.gateway.errors import BadRequest, BodyTooLarge

__all__ = ["BadRequest", "BodyTooLarge", "json_response", "error_response", "read_body"]

# msgpack carries integers up to 64 bits; keep what the wire sees well inside that
MAX_INT = 2**31 - 1
# which build answered, on every inference answer: "<version>/<sha256 of its files>"
BUILD_HEADER = "X-Model-Build"


def build_headers(version: int, build: str) -> dict[str, str]:
    """The build header of an answer; none when the broker did not name the build."""
    return {BUILD_HEADER: f"{version}/{build}"} if build else {}


def json_response(doc: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY), status, headers,
                    media_type="application/json")


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return json_response({"error": message}, status, headers)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, decompressed per Content-Encoding; both sizes bounded by ``limit``."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit)
        chunks.append(chunk)
    body = b"".join(chunks)
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding in ("", "identity"):
        return body
    return decompress(body, encoding, limit)


def decompress(body: bytes, encoding: str, limit: int) -> bytes:
    """gzip or deflate (zlib-wrapped, as HTTP means it; raw deflate accepted too)."""
    if encoding == "gzip":
        wbits = [16 + zlib.MAX_WBITS]
    elif encoding == "deflate":
        wbits = [zlib.MAX_WBITS, -zlib.MAX_WBITS]
    else:
        raise BadRequest(f"unsupported Content-Encoding {encoding!r} (use gzip or deflate)")
    for i, bits in enumerate(wbits):
        d = zlib.decompressobj(bits)
        try:
            # max_length bounds what a small "zip bomb" can expand to
            out = d.decompress(body, limit + 1)
        except zlib.error as exc:
            if i + 1 < len(wbits):
                continue
            raise BadRequest(f"the {encoding} body does not decompress: {exc}") from None
        if len(out) > limit:
            raise BodyTooLarge(limit)
        if not d.eof:
            raise BadRequest(f"the {encoding} body is truncated")
        return out
    raise BadRequest(f"the {encoding} body does not decompress")  # pragma: no cover


def accepted_encoding(request: Request) -> str | None:
    """gzip or deflate when the client accepts one (first listed wins), else None."""
    return encoding_of(request.headers.get("accept-encoding"))


def encoding_of(raw: str | None) -> str | None:
    """The response encoding an Accept-Encoding value asks for (gzip, deflate, None)."""
    if not raw:
        return None
    for part in raw.split(","):
        name, _, params = part.strip().partition(";")
        name = name.strip().lower()
        if name in ("gzip", "deflate") and params.replace(" ", "") not in ("q=0", "q=0.0"):
            return name
    return None


def compressed(request: Request, body: bytes, status: int = 200,
               headers: dict[str, str] | None = None,
               media_type: str = "application/json") -> Response:
    """A response compressed as the client's Accept-Encoding asks. Level 1: the body is
    tensors, where higher levels buy little and cost a lot of CPU."""
    encoding = accepted_encoding(request)
    if encoding is None:
        return Response(body, status, headers, media_type=media_type)
    return Response(compress(body, encoding), status,
                    {**(headers or {}), "Content-Encoding": encoding, "Vary": "Accept-Encoding"},
                    media_type=media_type)


def compress(body: bytes, encoding: str) -> bytes:
    """Level 1 gzip or deflate (zlib-wrapped, as HTTP means it)."""
    if encoding == "gzip":
        return gzip.compress(body, compresslevel=1, mtime=0)
    return zlib.compress(body, 1)


def path_version(request: Request) -> int | None:
    return parse_version(request.path_params.get("version"))


def parse_version(raw: str | None) -> int | None:
    """A version path segment: None when absent, else a positive integer (BadRequest)."""
    if raw is None:
        return None
    number = raw[1:] if raw[:1] in "+-" else raw
    if not (number.isascii() and number.isdigit()) or int(number) > MAX_INT:
        raise BadRequest(wording.bad_version(raw))
    if raw.startswith("-") or int(number) < 1:
        raise BadRequest(wording.invalid_version(raw))
    return int(number)


def bounded_int(value: Any, name: str) -> int:
    """A non-negative integer parameter that fits the wire (priority, timeout)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value \
            or not 0 <= value <= 2**53:
        raise BadRequest(f"parameter {name!r} must be a non-negative number")
    return min(int(value), 2**53)


def header_int(request: Request, name: str) -> int:
    raw = request.headers.get(name)
    if raw is None:
        return 0
    try:
        return bounded_int(float(raw.strip()), name)
    except ValueError:
        raise BadRequest(f"header {name!r} must be a non-negative number, got {raw!r}") \
            from None
