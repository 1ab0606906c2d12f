"""The zeroserve wire protocol: the one place that builds and parses frames.

A message is a multipart ZeroMQ message::

    [kind (1 byte)] [header (msgpack map)] [tensor buffer] ...

ROUTER sockets prepend the peer's identity; callers strip it before decoding.
The header always carries ``v`` (the protocol version). Tensors never pass
through msgpack: a header lists ``[name, datatype, shape]`` triples and each
tensor's raw bytes follow as their own frame, in the same order.

Time on the wire is a remaining budget (``timeout_ms``) computed when a message
is sent, so processes on different hosts need no shared clock.

Nothing here imports torch: the broker and gateway use it too.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Sequence

import msgpack
import numpy as np

PROTOCOL_VERSION = 1


class ProtocolError(ValueError):
    """A message that does not follow this protocol."""


class Kind(bytes, enum.Enum):
    # client <-> broker (frontend socket)
    REQUEST = b"\x01"
    REPLY = b"\x02"
    ERROR = b"\x03"
    CANCEL = b"\x04"
    PING = b"\x05"
    PONG = b"\x06"
    # worker <-> broker (backend socket)
    READY = b"\x10"
    HEARTBEAT = b"\x11"
    BATCH = b"\x12"
    RESULT = b"\x13"
    LOAD = b"\x14"
    LOADED = b"\x15"
    UNLOAD = b"\x16"
    DISCONNECT = b"\x17"
    # control (CLI, gateway metadata and metrics)
    CONTROL = b"\x20"
    CONTROL_REPLY = b"\x21"


_KINDS = {k.value: k for k in Kind}


class ErrorCode(str, enum.Enum):
    """Typed request errors; the gateway maps each to an HTTP status."""

    BAD_INPUT = "bad_input"
    NOT_FOUND = "not_found"
    DEADLINE = "deadline"
    OVERLOADED = "overloaded"
    QUOTA = "quota"
    NO_WORKER = "no_worker"
    MODEL_ERROR = "model_error"
    WORKER_LOST = "worker_lost"
    UNAVAILABLE = "unavailable"
    CANCELLED = "cancelled"
    INTERNAL = "internal"
    FORBIDDEN = "forbidden"          # management: not allowed (registration disabled, path)
    CONFLICT = "conflict"            # management: the model already exists

    @property
    def retryable(self) -> bool:
        return self in (ErrorCode.OVERLOADED, ErrorCode.NO_WORKER, ErrorCode.WORKER_LOST,
                        ErrorCode.UNAVAILABLE, ErrorCode.QUOTA)


# KServe v2 datatype -> numpy dtype. BF16 has no numpy dtype: it travels as raw
# 2-byte words and only workers (torch) interpret it.
DTYPES: dict[str, np.dtype[Any] | None] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype("<u1"), "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"), "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"), "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"), "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"), "FP32": np.dtype("<f4"), "FP64": np.dtype("<f8"),
    "BF16": None,
    "BYTES": None,
}
ITEM_BYTES = {name: (dt.itemsize if dt is not None else 2) for name, dt in DTYPES.items()
              if name != "BYTES"}


@dataclass(frozen=True)
class TensorMeta:
    name: str
    datatype: str
    shape: tuple[int, ...]

    def nbytes(self) -> int | None:
        """Exact byte size, or None for BYTES (variable length)."""
        if self.datatype == "BYTES":
            return None
        n = ITEM_BYTES[self.datatype]
        for d in self.shape:
            n *= d
        return n


Buffer = Any  # bytes, memoryview, zmq.Frame: anything with the buffer protocol


@dataclass(frozen=True)
class Tensor:
    meta: TensorMeta
    data: Buffer


@dataclass(frozen=True)
class InferRequest:
    """client -> broker. ``timeout_ms`` 0 means the model's default."""

    request_id: str
    model: str
    tensors: Sequence[Tensor]
    version: int | None = None
    priority: int = 0
    timeout_ms: float = 0.0
    tenant: str = ""
    outputs: Sequence[str] | None = None


@dataclass(frozen=True)
class InferReply:
    """broker -> client, and per request inside a worker's batch result."""

    request_id: str
    model: str
    version: int
    tensors: Sequence[Tensor]
    stats: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ErrorReply:
    request_id: str
    code: ErrorCode
    message: str
    retry_after_s: float | None = None


@dataclass(frozen=True)
class BatchItem:
    request_id: str
    tensors: Sequence[Tensor]
    outputs: Sequence[str] | None = None


@dataclass(frozen=True)
class Batch:
    """broker -> worker: requests of one model version to run together."""

    batch_id: int
    model: str
    version: int
    items: Sequence[BatchItem]
    timeout_ms: float = 0.0


@dataclass(frozen=True)
class BatchResult:
    """worker -> broker. On failure ``error`` is set and ``replies`` is empty."""

    batch_id: int
    replies: Sequence[InferReply]
    compute_ms: float = 0.0
    error: str | None = None
    retry: bool = False     # the batch never ran here (say, its model is not loaded)
    expired: bool = False   # never ran: its deadline passed before it could start


# ---------------------------------------------------------------------------
# framing helpers

def _pack(kind: Kind, header: dict[str, Any]) -> list[Buffer]:
    header["v"] = PROTOCOL_VERSION
    return [kind.value, msgpack.packb(header, use_bin_type=True)]


def peek_kind(frames: Sequence[Buffer]) -> Kind:
    if len(frames) < 2:
        raise ProtocolError(f"expected at least 2 frames, got {len(frames)}")
    raw = bytes(frames[0])
    kind = _KINDS.get(raw)
    if kind is None:
        raise ProtocolError(f"unknown message kind {raw!r}")
    return kind


def unpack(frames: Sequence[Buffer]) -> tuple[Kind, dict[str, Any], Sequence[Buffer]]:
    """Split a message into (kind, header, tensor frames); validate the envelope."""
    kind = peek_kind(frames)
    try:
        header = msgpack.unpackb(bytes(frames[1]), raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"header is not msgpack: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError("header is not a map")
    version = header.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {version!r} not supported (this peer speaks {PROTOCOL_VERSION})")
    return kind, header, frames[2:]


def _field(header: dict[str, Any], name: str, typ: type | tuple[type, ...],
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


def _metas(raw: Any) -> list[TensorMeta]:
    if not isinstance(raw, list):
        raise ProtocolError("'tensors' must be a list")
    metas = []
    for entry in raw:
        if not (isinstance(entry, list) and len(entry) == 3):
            raise ProtocolError("each tensor must be [name, datatype, shape]")
        name, datatype, shape = entry
        if not isinstance(name, str) or datatype not in DTYPES:
            raise ProtocolError(f"bad tensor name or datatype: {name!r} {datatype!r}")
        if not (isinstance(shape, list) and all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
            raise ProtocolError(f"tensor {name!r}: shape must be a list of ints >= 0")
        metas.append(TensorMeta(name, datatype, tuple(shape)))
    return metas


def _encode_tensors(tensors: Sequence[Tensor]) -> tuple[list[list[Any]], list[Buffer]]:
    metas = [[t.meta.name, t.meta.datatype, list(t.meta.shape)] for t in tensors]
    return metas, [t.data for t in tensors]


def _decode_tensors(raw: Any, frames: Sequence[Buffer]) -> list[Tensor]:
    metas = _metas(raw)
    if len(metas) != len(frames):
        raise ProtocolError(f"{len(metas)} tensors declared but {len(frames)} frames sent")
    tensors = []
    for meta, frame in zip(metas, frames):
        buf = frame.buffer if hasattr(frame, "buffer") else memoryview(frame)
        expected = meta.nbytes()
        if expected is not None and buf.nbytes != expected:
            raise ProtocolError(
                f"tensor {meta.name!r}: {buf.nbytes} bytes for shape {list(meta.shape)} "
                f"{meta.datatype} (expected {expected})")
        tensors.append(Tensor(meta, buf))
    return tensors


# ---------------------------------------------------------------------------
# client <-> broker

def encode_request(req: InferRequest) -> list[Buffer]:
    metas, bufs = _encode_tensors(req.tensors)
    header = {"id": req.request_id, "model": req.model, "version": req.version,
              "priority": req.priority, "timeout_ms": float(req.timeout_ms),
              "tenant": req.tenant, "tensors": metas,
              "outputs": list(req.outputs) if req.outputs is not None else None}
    return _pack(Kind.REQUEST, header) + bufs


def decode_request(header: dict[str, Any], frames: Sequence[Buffer]) -> InferRequest:
    outputs = _field(header, "outputs", list, None)
    if outputs is not None and not all(isinstance(o, str) for o in outputs):
        raise ProtocolError("'outputs' must be a list of names")
    version = _field(header, "version", int, None)
    return InferRequest(
        request_id=_field(header, "id", str),
        model=_field(header, "model", str),
        tensors=_decode_tensors(header.get("tensors"), frames),
        version=version,
        priority=_field(header, "priority", int, 0),
        timeout_ms=float(_field(header, "timeout_ms", (int, float), 0.0)),
        tenant=_field(header, "tenant", str, ""),
        outputs=outputs,
    )


def request_id_of(header: dict[str, Any]) -> str | None:
    """Best effort: the id of a request whose body failed to decode, to answer it."""
    rid = header.get("id")
    return rid if isinstance(rid, str) else None


def encode_reply(rep: InferReply) -> list[Buffer]:
    metas, bufs = _encode_tensors(rep.tensors)
    header = {"id": rep.request_id, "model": rep.model, "version": rep.version,
              "tensors": metas, "stats": rep.stats}
    return _pack(Kind.REPLY, header) + bufs


def decode_reply(header: dict[str, Any], frames: Sequence[Buffer]) -> InferReply:
    return InferReply(
        request_id=_field(header, "id", str),
        model=_field(header, "model", str),
        version=_field(header, "version", int),
        tensors=_decode_tensors(header.get("tensors"), frames),
        stats=_field(header, "stats", dict, {}),
    )


def encode_error(err: ErrorReply) -> list[Buffer]:
    header = {"id": err.request_id, "code": err.code.value, "message": err.message,
              "retry_after_s": err.retry_after_s}
    return _pack(Kind.ERROR, header)


def decode_error(header: dict[str, Any]) -> ErrorReply:
    try:
        code = ErrorCode(_field(header, "code", str))
    except ValueError:
        code = ErrorCode.INTERNAL
    retry = _field(header, "retry_after_s", (int, float), None)
    return ErrorReply(_field(header, "id", str), code, _field(header, "message", str),
                      float(retry) if retry is not None else None)


def encode_simple(kind: Kind, **header: Any) -> list[Buffer]:
    """Messages whose header is a plain map: cancel, ping, ready, heartbeat, load, control."""
    return _pack(kind, header)


# ---------------------------------------------------------------------------
# broker <-> worker

def encode_batch(batch: Batch) -> list[Buffer]:
    items, bufs = [], []
    for item in batch.items:
        metas, item_bufs = _encode_tensors(item.tensors)
        items.append([item.request_id, metas,
                      list(item.outputs) if item.outputs is not None else None])
        bufs.extend(item_bufs)
    header = {"id": batch.batch_id, "model": batch.model, "version": batch.version,
              "items": items, "timeout_ms": float(batch.timeout_ms)}
    return _pack(Kind.BATCH, header) + bufs


def decode_batch(header: dict[str, Any], frames: Sequence[Buffer]) -> Batch:
    raw_items = _field(header, "items", list)
    items, pos = [], 0
    for raw in raw_items:
        if not (isinstance(raw, list) and len(raw) == 3 and isinstance(raw[0], str)):
            raise ProtocolError("each batch item must be [id, tensors, outputs]")
        n = len(raw[1]) if isinstance(raw[1], list) else 0
        items.append(BatchItem(raw[0], _decode_tensors(raw[1], frames[pos:pos + n]), raw[2]))
        pos += n
    if pos != len(frames):
        raise ProtocolError(f"batch declares {pos} tensors but carries {len(frames)} frames")
    return Batch(_field(header, "id", int), _field(header, "model", str),
                 _field(header, "version", int), items,
                 float(_field(header, "timeout_ms", (int, float), 0.0)))


def encode_result(result: BatchResult) -> list[Buffer]:
    replies, bufs = [], []
    for rep in result.replies:
        metas, rep_bufs = _encode_tensors(rep.tensors)
        replies.append([rep.request_id, metas])
        bufs.extend(rep_bufs)
    header = {"id": result.batch_id, "replies": replies, "compute_ms": result.compute_ms,
              "error": result.error, "retry": result.retry, "expired": result.expired}
    return _pack(Kind.RESULT, header) + bufs


def decode_result(header: dict[str, Any], frames: Sequence[Buffer],
                  model: str, version: int) -> BatchResult:
    replies, pos = [], 0
    for raw in _field(header, "replies", list):
        if not (isinstance(raw, list) and len(raw) == 2 and isinstance(raw[0], str)):
            raise ProtocolError("each reply must be [id, tensors]")
        n = len(raw[1]) if isinstance(raw[1], list) else 0
        replies.append(InferReply(raw[0], model, version,
                                  _decode_tensors(raw[1], frames[pos:pos + n])))
        pos += n
    if pos != len(frames):
        raise ProtocolError(f"result declares {pos} tensors but carries {len(frames)} frames")
    return BatchResult(_field(header, "id", int), replies,
                       float(_field(header, "compute_ms", (int, float), 0.0)),
                       _field(header, "error", str, None), _field(header, "retry", bool, False),
                       _field(header, "expired", bool, False))


def result_batch_id(header: dict[str, Any]) -> int:
    return int(_field(header, "id", int))


# ---------------------------------------------------------------------------
# BYTES tensors: each element a 4-byte little-endian length, then its bytes
# (the same layout as the HTTP binary extension).

def pack_bytes_elements(items: Sequence[bytes]) -> bytes:
    out = bytearray()
    for item in items:
        out += len(item).to_bytes(4, "little")
        out += item
    return bytes(out)


def unpack_bytes_elements(buf: Buffer, count: int | None = None) -> list[bytes]:
    data = memoryview(buf).cast("B")
    items, pos = [], 0
    while pos < len(data):
        if pos + 4 > len(data):
            raise ProtocolError("BYTES tensor: truncated length prefix")
        n = int.from_bytes(data[pos:pos + 4], "little")
        pos += 4
        if pos + n > len(data):
            raise ProtocolError("BYTES tensor: element runs past the end of the buffer")
        items.append(bytes(data[pos:pos + n]))
        pos += n
    if count is not None and len(items) != count:
        raise ProtocolError(f"BYTES tensor: {len(items)} elements, shape needs {count}")
    return items


def to_numpy(tensor: Tensor) -> np.ndarray:
    """A read-only numpy view of a tensor (BYTES -> object array of bytes)."""
    meta = tensor.meta
    if meta.datatype == "BYTES":
        count = int(np.prod(meta.shape)) if meta.shape else 1
        arr = np.empty(count, dtype=object)
        arr[:] = unpack_bytes_elements(tensor.data, count)
        return arr.reshape(meta.shape)
    dtype = DTYPES[meta.datatype]
    if dtype is None:
        raise ProtocolError(f"{meta.datatype} has no numpy dtype")
    return np.frombuffer(tensor.data, dtype=dtype).reshape(meta.shape)


def from_numpy(name: str, arr: np.ndarray, datatype: str | None = None) -> Tensor:
    """Wrap a numpy array as a tensor; the array is made C-contiguous if needed."""
    if datatype is None:
        datatype = datatype_of(arr.dtype)
    if datatype == "BYTES":
        flat = [x if isinstance(x, bytes) else str(x).encode() for x in arr.reshape(-1)]
        return Tensor(TensorMeta(name, "BYTES", tuple(arr.shape)), pack_bytes_elements(flat))
    arr = np.ascontiguousarray(arr, dtype=DTYPES[datatype])
    return Tensor(TensorMeta(name, datatype, tuple(arr.shape)), memoryview(arr).cast("B"))


def datatype_of(dtype: np.dtype[Any]) -> str:
    if dtype == np.object_ or dtype.kind in ("S", "U"):
        return "BYTES"
    native = dtype.newbyteorder("<") if dtype.byteorder == ">" else dtype
    for name, dt in DTYPES.items():
        if dt is not None and dt == native:
            return name
    raise ProtocolError(f"numpy dtype {dtype} has no KServe datatype")
