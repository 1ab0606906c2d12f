"""The envelope of every message: its kind frame, its header's version and the
receiver's limits, checked before anything else is decoded; and bundles (several
inference messages in one)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import msgpack
import msgspec

from zeroserve.broker.protocol.messages import (MAX_BUNDLE, PAUSE_VERSION, STEPS_VERSION,
                                                SUPPORTED_VERSIONS, WAITING_VERSION,
                                                ErrorCode, Kind)
from zeroserve.broker.tensors import Buffer, ProtocolError


class VersionMismatch(ProtocolError):
    """A well-formed message of a protocol version this peer does not speak; ``header``
    lets the receiver answer the request it names."""

    def __init__(self, header: dict[str, Any], message: str) -> None:
        super().__init__(message)
        self.header = header


_KINDS = {k.value: k for k in Kind}
# the version a kind first appeared in
_SINCE = {Kind.REQUESTS: 2, Kind.REPLIES: 2, Kind.WAITING: WAITING_VERSION,
          Kind.STEPS: STEPS_VERSION, Kind.PAUSE: PAUSE_VERSION}


@dataclass(frozen=True)
class Limits:
    """What one received message may hold. Checked before its header is decoded, so an
    oversized message costs its receiver nothing but the bytes it already holds: a
    header of a million keys took the broker's loop 0.7 s to decode, and its memory."""

    header_bytes: int = 256 << 10
    message_bytes: int = 256 << 20     # every frame together (tensors bounded by shapes)
    container_len: int = 1 << 16       # entries of any one map or list in a header


# for a peer that trusts its sender (a client reading its broker's answers, which may
# carry every worker's metrics): bounded by what msgpack can address, nothing more
TRUSTED = Limits(header_bytes=1 << 31, message_bytes=1 << 62, container_len=1 << 31)


class Refused(ProtocolError):
    """A message that names requests (or a control call) to answer: each id gets the
    error ``code`` with this message. Raised by :func:`unpack` and the bundle codecs."""

    def __init__(self, ids: Sequence[str], code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.ids = list(ids)
        self.code = code


_ID_SCAN_ENTRIES = 16   # a header's first entries looked at for its id (encoders put it first)


def ids_of(header: Any) -> list[str]:
    """Best effort: the ids a malformed header names (its own, and each bundled
    part's), so that each can be answered."""
    if not isinstance(header, dict):
        return []
    out = [rid] if (rid := request_id_of(header)) is not None else []
    for key in ("requests", "replies"):
        parts = header.get(key)
        if isinstance(parts, list):
            out.extend(r for part in parts[:MAX_BUNDLE * 4] if isinstance(part, dict)
                       and (r := request_id_of(part)) is not None)
    return out


def _scan_id(raw: Buffer) -> list[str]:
    """The ``id`` of a header too large (or too deep) to decode, read from its first few
    entries only, so the work stays bounded whatever the header holds."""
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=0)
    try:
        unpacker.feed(raw)
        for _ in range(min(unpacker.read_map_header(), _ID_SCAN_ENTRIES)):
            key = unpacker.unpack()
            if key == "id":
                value = unpacker.unpack()
                return [value] if isinstance(value, str) and len(value) <= 256 else []
            unpacker.skip()
    except Exception:  # noqa: BLE001 - anything msgpack raises means: no id to be had
        pass
    return []


def _nbytes(frame: Buffer) -> int:
    """A received frame's size: a zmq.Frame's or bytes' length, a memoryview's bytes."""
    return frame.nbytes if type(frame) is memoryview else len(frame)


@functools.lru_cache(maxsize=16)
def _decoder(limits: Limits) -> Callable[[Buffer], Any]:
    """msgpack's decoder with the limits bound once: keyword arguments parsed on every
    call cost the broker about 2 us a message."""
    return functools.partial(msgpack.unpackb, raw=False, strict_map_key=True,
                             max_map_len=limits.container_len,
                             max_array_len=limits.container_len,
                             max_str_len=limits.header_bytes, max_bin_len=limits.header_bytes)

def enc_hook(value: Any) -> Any:
    """What msgspec does not encode itself and msgpack did: a float's subclass (numpy's
    float64 in a worker's measurements)."""
    if isinstance(value, float):
        return float(value)
    raise NotImplementedError(f"{type(value).__name__} cannot travel in a header")


_encode = msgspec.msgpack.Encoder(enc_hook=enc_hook).encode


def pack(kind: Kind, header: dict[str, Any]) -> list[Buffer]:
    """A message's first two frames; ``v`` is stamped last, as every release has."""
    frame, header["v"] = _FRAME_OF[kind]
    return [frame, _encode(header)]


def peek_kind(frames: Sequence[Buffer]) -> Kind:
    if len(frames) < 2:
        raise ProtocolError(f"expected at least 2 frames, got {len(frames)}")
    raw = bytes(frames[0])
    kind = _KINDS.get(raw)
    if kind is None:
        raise ProtocolError(f"unknown message kind {raw[:8]!r}")
    return kind


# msgspec's decoder, for a header of at most ``container_len`` bytes: no map or list in
# it can hold more entries than it has bytes, so the limit needs no check (msgpack's
# decoder, which checks it, takes twice as long on the broker's small headers)
_decode_small = msgspec.msgpack.Decoder().decode
# by the member, which hashes as its bytes: an Enum's ``.value`` is a Python-level
# descriptor (about 250 ns, several times a message), a lookup here 40
_SINCE_OF = {k: _SINCE.get(k, 1) for k in Kind}
_FRAME_OF = {k: (k.value, _SINCE_OF[k]) for k in Kind}   # the kind frame, plain bytes


def unpack(frames: Sequence[Buffer], limits: Limits = TRUSTED
           ) -> tuple[Kind, dict[str, Any], Sequence[Buffer]]:
    """Split a message into (kind, header, tensor frames); validate the envelope and the
    receiver's ``limits`` (:class:`Refused` when the message names what to answer)."""
    try:
        kind = peek_kind(frames)
    except ProtocolError as exc:
        small = len(frames) > 1 and _nbytes(frames[1]) <= limits.header_bytes
        raise Refused(_scan_id(frames[1]) if small else [], ErrorCode.BAD_INPUT,
                      str(exc)) from None
    raw = frames[1]
    size = _nbytes(raw)
    if size > limits.header_bytes:
        raise Refused(_scan_id(raw), ErrorCode.TOO_LARGE, f"a header of {size} bytes "
                      f"is over the limit of {limits.header_bytes}")
    try:
        header = _decode_small(raw) if size <= limits.container_len else \
            _decoder(limits)(raw)
    except ValueError as exc:
        if "exceeds max" in str(exc):   # msgpack's wording for its length limits
            raise Refused(_scan_id(raw), ErrorCode.TOO_LARGE, f"a header with a map or list "
                          f"of more than {limits.container_len} entries") from None
        raise ProtocolError(f"header is not msgpack: {type(exc).__name__}") from None
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"header is not msgpack: {type(exc).__name__}") from None
    if type(header) is not dict:
        raise ProtocolError("header is not a map")
    if len(frames) > 2:
        total = 0   # a loop: sum over map of a Python function costs more, every message
        for frame in frames[2:]:
            total += frame.nbytes if type(frame) is memoryview else len(frame)
        if total > limits.message_bytes:
            raise Refused(ids_of(header), ErrorCode.TOO_LARGE, f"a message of {total} bytes "
                          f"of tensors is over the limit of {limits.message_bytes}")
    version = header.get("v")
    if version not in SUPPORTED_VERSIONS or isinstance(version, bool):
        raise VersionMismatch(header, f"protocol version {version!r} is not supported (this "
                                      f"peer speaks {', '.join(map(str, SUPPORTED_VERSIONS))})")
    since = _SINCE_OF[kind]
    if version < since:
        raise Refused(ids_of(header), ErrorCode.BAD_INPUT, f"{kind.name} needs protocol "
                      f"version {since}, the message says {version}")
    return kind, header, frames[2:]



def field_of(header: dict[str, Any], name: str, typ: type | tuple[type, ...],
           default: Any = ...) -> Any:
    value = header.get(name, default)
    if value is ...:
        raise ProtocolError(f"header field {name!r} is missing")
    if value is default and default is not ...:
        return value
    if isinstance(value, bool) and typ is not bool and bool not in (
            typ if isinstance(typ, tuple) else (typ,)):
        raise ProtocolError(f"header field {name!r} must be {typ}, got bool")
    if not isinstance(value, typ):
        raise ProtocolError(f"header field {name!r} has type {type(value).__name__}")
    return value



def bundle(kind: Kind, key: str, parts: Sequence[tuple[dict[str, Any], list[Buffer]]]
           ) -> list[Buffer]:
    """One REQUESTS or REPLIES message of (header, frames) parts."""
    bufs: list[Buffer] = []
    for _, frames in parts:
        bufs.extend(frames)
    return pack(kind, {key: [h for h, _ in parts]}) + bufs


def unbundle(header: dict[str, Any], frames: Sequence[Buffer], key: str
             ) -> list[tuple[dict[str, Any], Sequence[Buffer]]]:
    """The (header, tensor frames) of each message in a REQUESTS or REPLIES. A part whose
    ``tensors`` is not a list owns no frame (decoding it names the error)."""
    parts = field_of(header, key, list)
    if len(parts) > MAX_BUNDLE:
        raise Refused(ids_of(header), ErrorCode.BAD_INPUT,
                      f"{len(parts)} messages in one, more than {MAX_BUNDLE}")
    out, pos = [], 0
    for part in parts:
        if not isinstance(part, dict):
            raise Refused(ids_of(header), ErrorCode.BAD_INPUT, f"each of {key!r} must be a map")
        tensors = part.get("tensors")
        n = len(tensors) if isinstance(tensors, list) else 0
        out.append((part, frames[pos:pos + n]))
        pos += n
    if pos != len(frames):
        raise Refused(ids_of(header), ErrorCode.BAD_INPUT,
                      f"{key} declare {pos} tensors but carry {len(frames)} frames")
    return out


def request_id_of(header: dict[str, Any]) -> str | None:
    """Best effort: the id of a request whose body failed to decode, to answer it."""
    rid = header.get("id")
    return rid if isinstance(rid, str) and len(rid) <= 256 else None

