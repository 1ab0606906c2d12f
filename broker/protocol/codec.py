r"""Encoders and decoders of every message kind: headers of named fields, each field's
type checked on the way in (a decoder never ``assert``\ s), tensors as frames of their own."""

from __future__ import annotations

import enum
import math
from dataclasses import MISSING, fields
from typing import Any, Callable, Sequence

from zeroserve.broker.protocol.envelope import (bundle, field_of, pack,
                                                unbundle)
from zeroserve.broker.protocol.messages import (MAX_BUNDLE, MESSAGES, Batch, BatchItem,
                                                BatchResult, BatchTrace, Caller,
                                                DisconnectReason, ErrorCode, ErrorReply,
                                                InferReply, InferRequest, Kind, LeaveReason,
                                                Partial, PartialItem, StreamPart)
from zeroserve.broker.tensors import (DTYPES, ITEM_BYTES, Buffer, ProtocolError, Tensor,
                                      TensorMeta)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_pairs(v: Any) -> bool:
    return isinstance(v, list) and all(
        isinstance(x, list) and len(x) == 2 and isinstance(x[0], str) and _is_int(x[1])
        for x in v)


_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "str": (lambda v: isinstance(v, str), "a string"),
    "int": (_is_int, "an integer"),
    "float": (lambda v: _is_number(v) and math.isfinite(v), "a finite number"),
    "bool": (lambda v: isinstance(v, bool), "a boolean"),
    "map": (lambda v: isinstance(v, dict), "a map"),
    "pairs": (_is_pairs, "a list of [name, version] pairs"),
    "ints": (lambda v: isinstance(v, list) and all(_is_int(x) for x in v), "a list of integers"),
    "strs": (lambda v: isinstance(v, list) and len(v) <= MAX_BUNDLE
             and all(isinstance(x, str) for x in v), "a list of strings"),
    "any": (lambda v: True, "anything"),
}


_WIRE = {"request_id": "id", "call_id": "id", "batch_id": "id"}
_TYPES = {"str": "str", "int": "int", "float": "float", "bool": "bool",
          "dict[str, Any]": "map", "list[list[Any]]": "pairs", "list[int]": "ints",
          "list[str]": "strs", "Any": "any"}
_ENUMS: dict[str, type[enum.Enum]] = {"DisconnectReason": DisconnectReason,
                                      "LeaveReason": LeaveReason}


def _schema(cls: type) -> list[tuple[str, str, Any, Any]]:
    """(field, wire name, check name or enum class, default) per field of a message."""
    out = []
    for f in fields(cls):
        typ = str(f.type)  # annotations are strings here (from __future__ import annotations)
        check: Any = _ENUMS.get(typ) or _TYPES[typ]
        default: Any = ...
        if f.default_factory is not MISSING:
            default = f.default_factory
        elif f.default is not MISSING:
            default = f.default
        out.append((f.name, _WIRE.get(f.name, f.name), check, default))
    return out



_SCHEMAS: dict[type, list[tuple[str, str, Any, Any]]] = {cls: _schema(cls) for cls in MESSAGES}


def encode(msg: Any) -> list[Buffer]:
    """Frames of a schema-declared message (everything but the inference messages)."""
    header: dict[str, Any] = {}
    for name, wire, _, _ in _SCHEMAS[type(msg)]:
        value = getattr(msg, name)
        header[wire] = value.value if isinstance(value, enum.Enum) else value
    return pack(msg.KIND, header)


def decode(cls: type, header: dict[str, Any]) -> Any:
    """A schema-declared message from its header; ProtocolError names a bad field."""
    values: dict[str, Any] = {}
    for name, wire, check, default in _SCHEMAS[cls]:
        if wire not in header or header[wire] is None:
            if default is ...:
                raise ProtocolError(f"{cls.__name__}: field {wire!r} is missing")
            values[name] = default() if callable(default) else default
            continue
        value = header[wire]
        if isinstance(check, type) and issubclass(check, enum.Enum):
            try:
                value = check(value)
            except (ValueError, TypeError):
                raise ProtocolError(f"{cls.__name__}: field {wire!r} is not one of "
                                    f"{', '.join(e.value for e in check)}") from None
        else:
            ok, what = _CHECKS[check]
            if not ok(value):
                raise ProtocolError(f"{cls.__name__}: field {wire!r} must be {what}, "
                                    f"got {type(value).__name__}")
            if check == "float":
                value = float(value)
        values[name] = value
    return cls(**values)


_MAX_DIM = 2**40


def _metas(raw: Any) -> list[TensorMeta]:
    """Checked with ``type(..) is``: a header comes from msgpack, which makes exactly
    these types (bool is the one int it can make that is not an int here). This runs
    for every tensor a broker sees, twice a request; the generic checks cost twice as
    much."""
    if type(raw) is not list:
        raise ProtocolError("'tensors' must be a list")
    metas = []
    for entry in raw:
        if type(entry) is not list or len(entry) != 3:
            raise ProtocolError("each tensor must be [name, datatype, shape]")
        name, datatype, shape = entry
        if type(name) is not str or type(datatype) is not str or datatype not in DTYPES:
            raise ProtocolError(f"bad tensor name or datatype: {name!r} {datatype!r}"[:200])
        if type(shape) is not list:
            raise ProtocolError(f"tensor {name!r}: shape must be a list of ints >= 0")
        for d in shape:
            if type(d) is not int or not 0 <= d < _MAX_DIM:
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
        # a zmq.Frame (what a socket gives) has its buffer; bytes and views are their own
        buf = memoryview(frame) if type(frame) in _PLAIN else frame.buffer \
            if hasattr(frame, "buffer") else memoryview(frame)
        expected = ITEM_BYTES.get(meta.datatype)   # None: BYTES, whose length varies
        if expected is not None:
            for d in meta.shape:
                expected *= d
            if buf.nbytes != expected:
                raise ProtocolError(
                    f"tensor {meta.name!r}: {buf.nbytes} bytes for shape {list(meta.shape)} "
                    f"{meta.datatype} (expected {expected})")
        tensors.append(Tensor(meta, buf))
    return tensors


_PLAIN = (bytes, memoryview, bytearray)


# ---------------------------------------------------------------------------
# client <-> broker

def encode_request(req: InferRequest) -> list[Buffer]:
    header, bufs = request_header(req)
    return pack(Kind.REQUEST, header) + bufs


def decode_request(header: dict[str, Any], frames: Sequence[Buffer]) -> InferRequest:
    outputs = field_of(header, "outputs", list, None)
    if outputs is not None and not all(isinstance(o, str) for o in outputs):
        raise ProtocolError("'outputs' must be a list of names")
    version = field_of(header, "version", int, None)
    if version is not None and version < 1:
        raise ProtocolError(f"version must be a positive integer, got {version}")
    timeout_ms = float(field_of(header, "timeout_ms", (int, float), 0.0))
    if not math.isfinite(timeout_ms) or timeout_ms < 0:
        raise ProtocolError(f"timeout_ms must be a finite number >= 0 (0: the model's "
                            f"default), got {timeout_ms}")
    return InferRequest(
        request_id=field_of(header, "id", str),
        model=field_of(header, "model", str),
        tensors=_decode_tensors(header.get("tensors"), frames),
        version=version,
        priority=field_of(header, "priority", int, 0),
        timeout_ms=timeout_ms,
        tenant=field_of(header, "tenant", str, ""),
        outputs=outputs,
        api_key=field_of(header, "api_key", str, ""),
        stream=_stream_flag(header),
        trace=_trace_context(header),
        routing_key=field_of(header, "routing_key", str, ""),
        row=_row(header),
    )


def _row(header: dict[str, Any]) -> int:
    """Absent on a request of its own, so the common case is one dict lookup."""
    row = header.get("row", 0)
    if isinstance(row, bool) or not isinstance(row, int) or row < 0:
        raise ProtocolError(f"header field 'row' must be an integer >= 0, got {row!r}")
    return row


def _stream_flag(header: dict[str, Any]) -> bool:
    """Absent on unary requests, so the common case is one dict lookup."""
    stream = header.get("stream", False)
    if stream is not False and stream is not True:
        raise ProtocolError(f"header field 'stream' must be a boolean, got "
                            f"{type(stream).__name__}")
    return stream


def _trace_context(header: dict[str, Any]) -> dict[str, str] | None:
    raw = header.get("trace")
    if raw is None:
        return None
    if not (isinstance(raw, dict) and isinstance(raw.get("traceparent"), str)
            and isinstance(raw.get("tracestate", ""), str)):
        raise ProtocolError("'trace' must be {traceparent: str, tracestate: str}")
    return {k: raw[k] for k in ("traceparent", "tracestate") if k in raw}


def encode_requests(reqs: Sequence[InferRequest]) -> list[Buffer]:
    """Several requests in one message (version 2): each one's header as REQUEST has it,
    then every tensor frame in order. Only to a broker whose PONG listed version 2."""
    return bundle(Kind.REQUESTS, "requests", [request_header(r) for r in reqs])


def request_header(req: InferRequest) -> tuple[dict[str, Any], list[Buffer]]:
    """A request's header (without ``v``) and its tensor frames, to bundle."""
    metas, bufs = _encode_tensors(req.tensors)
    header: dict[str, Any] = {"id": req.request_id, "model": req.model, "version": req.version,
              "priority": req.priority, "timeout_ms": float(req.timeout_ms),
              "tenant": req.tenant, "tensors": metas,
              "outputs": list(req.outputs) if req.outputs is not None else None}
    if req.row:
        header["row"] = req.row
    if req.api_key:
        header["api_key"] = req.api_key
    if req.stream:   # absent otherwise: a unary request's header stays as it was
        header["stream"] = True
    if req.trace is not None:   # likewise: an untraced request carries nothing
        header["trace"] = req.trace
    if req.routing_key:   # likewise; an older broker ignores a field it does not know
        header["routing_key"] = req.routing_key
    return header, bufs



def reply_header(rep: InferReply) -> tuple[dict[str, Any], list[Buffer]]:
    return reply_part(rep.request_id, rep.model, rep.version, rep.tensors, rep.stats,
                      rep.trace, rep.build)


def reply_part(request_id: str, model: str, version: int, tensors: Sequence[Tensor],
               stats: dict[str, float], trace: dict[str, Any] | None = None,
               build: str = "") -> tuple[dict[str, Any], list[Buffer]]:
    """An InferReply's header and frames without the InferReply, for
    :func:`encode_reply_parts`: the broker makes one for every request it answers."""
    metas, bufs = _encode_tensors(tensors)
    header = {"id": request_id, "model": model, "version": version, "tensors": metas,
              "stats": stats}
    if trace is not None:
        header["trace"] = trace
    if build:
        header["build"] = build
    return header, bufs


def encode_reply_parts(parts: Sequence[tuple[dict[str, Any], list[Buffer]]]) -> list[Buffer]:
    """One reply as REPLY, several (to one client that speaks version 2) as REPLIES."""
    if len(parts) == 1:
        header, bufs = parts[0]
        return pack(Kind.REPLY, header) + bufs
    return bundle(Kind.REPLIES, "replies", parts)


def encode_reply(rep: InferReply) -> list[Buffer]:
    header, bufs = reply_header(rep)
    return pack(Kind.REPLY, header) + bufs


def encode_replies(reps: Sequence[InferReply]) -> list[Buffer]:
    """Several replies to one client in one message (version 2)."""
    return bundle(Kind.REPLIES, "replies", [reply_header(r) for r in reps])


def decode_replies(header: dict[str, Any], frames: Sequence[Buffer]) -> list[InferReply]:
    return [decode_reply(h, bufs) for h, bufs in unbundle(header, frames, "replies")]


def decode_reply(header: dict[str, Any], frames: Sequence[Buffer]) -> InferReply:
    return InferReply(
        request_id=field_of(header, "id", str),
        model=field_of(header, "model", str),
        version=field_of(header, "version", int),
        tensors=_decode_tensors(header.get("tensors"), frames),
        stats=field_of(header, "stats", dict, {}),
        trace=field_of(header, "trace", dict, None),
        build=field_of(header, "build", str, ""),
    )


def encode_error(err: ErrorReply) -> list[Buffer]:
    header = {"id": err.request_id, "code": err.code.value, "message": err.message,
              "retry_after_s": err.retry_after_s}
    return pack(Kind.ERROR, header)


def decode_error(header: dict[str, Any]) -> ErrorReply:
    try:
        code = ErrorCode(field_of(header, "code", str))
    except ValueError:
        code = ErrorCode.INTERNAL
    retry = field_of(header, "retry_after_s", (int, float), None)
    return ErrorReply(field_of(header, "id", str), code, field_of(header, "message", str),
                      float(retry) if retry is not None else None)


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
    if batch.trace is not None:
        t = batch.trace
        header["trace"] = {"boot": t.boot, "sent_ns": t.sent_ns,
                           "items": [[i, ctx, arrival] for i, ctx, arrival in t.items]}
    if batch.callers is not None:
        header["callers"] = [[c.priority, float(c.timeout_ms), c.api_key]
                             for c in batch.callers]
    return pack(Kind.BATCH, header) + bufs


def decode_batch(header: dict[str, Any], frames: Sequence[Buffer]) -> Batch:
    raw_items = field_of(header, "items", list)
    items, pos = [], 0
    for raw in raw_items:
        if not (isinstance(raw, list) and len(raw) == 3 and isinstance(raw[0], str)
                and isinstance(raw[1], list)):
            raise ProtocolError("each batch item must be [id, tensors, outputs]")
        n = len(raw[1])
        items.append(BatchItem(raw[0], _decode_tensors(raw[1], frames[pos:pos + n]), raw[2]))
        pos += n
    if pos != len(frames):
        raise ProtocolError(f"batch declares {pos} tensors but carries {len(frames)} frames")
    return Batch(field_of(header, "id", int), field_of(header, "model", str),
                 field_of(header, "version", int), items,
                 float(field_of(header, "timeout_ms", (int, float), 0.0)),
                 _batch_trace(header.get("trace"), len(items)),
                 _callers(header.get("callers"), len(items)))


def _callers(raw: Any, n_items: int) -> list[Caller] | None:
    if raw is None:
        return None
    if not isinstance(raw, list) or len(raw) != n_items:
        raise ProtocolError("a batch's 'callers' must be a list with one entry per item")
    out = []
    for entry in raw:
        if not (isinstance(entry, list) and len(entry) == 3 and _is_int(entry[0])
                and isinstance(entry[1], (int, float)) and isinstance(entry[2], str)):
            raise ProtocolError("each caller must be [priority, timeout_ms, api_key]")
        out.append(Caller(entry[0], float(entry[1]), entry[2]))
    return out


def _batch_trace(raw: Any, n_items: int) -> BatchTrace | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ProtocolError("a batch's 'trace' must be a map")
    items = []
    for entry in field_of(raw, "items", list):
        if not (isinstance(entry, list) and len(entry) == 3 and type(entry[0]) is int
                and 0 <= entry[0] < n_items and type(entry[2]) is int):
            raise ProtocolError("each traced item must be [index, context, arrival_ns]")
        items.append((entry[0], _trace_context({"trace": entry[1]}) or {}, entry[2]))
    return BatchTrace(field_of(raw, "boot", str), field_of(raw, "sent_ns", int), items)


def encode_result(result: BatchResult) -> list[Buffer]:
    replies, bufs = [], []
    for rep in result.replies:
        metas, rep_bufs = _encode_tensors(rep.tensors)
        replies.append([rep.request_id, metas])
        bufs.extend(rep_bufs)
    header = {"id": result.batch_id, "replies": replies, "compute_ms": result.compute_ms,
              "error": result.error, "retry": result.retry, "expired": result.expired,
              "phases_ms": result.phases_ms}
    if result.trace is not None:
        header["trace"] = result.trace
    return pack(Kind.RESULT, header) + bufs


def decode_result(header: dict[str, Any], frames: Sequence[Buffer],
                  model: str, version: int) -> BatchResult:
    replies, pos = [], 0
    for raw in field_of(header, "replies", list):
        if not (isinstance(raw, list) and len(raw) == 2 and isinstance(raw[0], str)
                and isinstance(raw[1], list)):
            raise ProtocolError("each reply must be [id, tensors]")
        n = len(raw[1])
        replies.append(InferReply(raw[0], model, version,
                                  _decode_tensors(raw[1], frames[pos:pos + n])))
        pos += n
    if pos != len(frames):
        raise ProtocolError(f"result declares {pos} tensors but carries {len(frames)} frames")
    phases = {str(k): _duration_ms(f"phases_ms[{k!r}]", v)
              for k, v in field_of(header, "phases_ms", dict, {}).items()}
    return BatchResult(field_of(header, "id", int), replies,
                       _duration_ms("compute_ms",
                                    field_of(header, "compute_ms", (int, float), 0.0)),
                       field_of(header, "error", str, None),
                       field_of(header, "retry", bool, False),
                       field_of(header, "expired", bool, False), phases,
                       field_of(header, "trace", dict, None))


MAX_DURATION_MS = 7 * 24 * 3600 * 1000.0   # a week: no batch runs longer


def _duration_ms(name: str, value: Any) -> float:
    """A time a worker measured: finite and within [0, a week], or the message is
    refused (a NaN once poisoned the latency model and lost its batch)."""
    if not _is_number(value) or not 0.0 <= value <= MAX_DURATION_MS:
        raise ProtocolError(f"{name} must be a finite number of ms in [0, "
                            f"{MAX_DURATION_MS:.0f}], got {value!r}"[:200])
    return float(value)


def result_batch_id(header: dict[str, Any]) -> int:
    return int(field_of(header, "id", int))


# ---------------------------------------------------------------------------
# streams (decoupled models)

def part_header(part: StreamPart) -> tuple[dict[str, Any], list[Buffer]]:
    metas, bufs = _encode_tensors(part.tensors)
    header: dict[str, Any] = {"id": part.request_id, "model": part.model,
                              "version": part.version, "index": part.index,
                              "final": part.final, "tensors": metas}
    if part.stats:
        header["stats"] = part.stats
    if part.build:
        header["build"] = part.build
    return header, bufs


def encode_parts(parts: Sequence[StreamPart]) -> list[Buffer]:
    """Responses of streams to one client, in order, in one message."""
    return bundle(Kind.PARTS, "parts", [part_header(x) for x in parts])


def decode_part(header: dict[str, Any], frames: Sequence[Buffer]) -> StreamPart:
    index = field_of(header, "index", int)
    if index < 0:
        raise ProtocolError(f"a response index must be >= 0, got {index}")
    return StreamPart(field_of(header, "id", str), field_of(header, "model", str),
                      field_of(header, "version", int), index, field_of(header, "final", bool),
                      _decode_tensors(header.get("tensors"), frames),
                      field_of(header, "stats", dict, {}), field_of(header, "build", str, ""))


def decode_parts(header: dict[str, Any], frames: Sequence[Buffer]) -> list[StreamPart]:
    return [decode_part(h, bufs) for h, bufs in unbundle(header, frames, "parts")]


def _partial_parts(msg: Partial, bufs: list[Buffer]) -> list[list[Any]]:
    parts = []
    for item in msg.parts:
        metas, item_bufs = _encode_tensors(item.tensors)
        parts.append([item.item, item.final, metas])
        bufs.extend(item_bufs)
    return parts


def encode_partial(msg: Partial) -> list[Buffer]:
    bufs: list[Buffer] = []
    parts = _partial_parts(msg, bufs)
    return pack(Kind.PARTIAL, {"id": msg.batch_id, "parts": parts}) + bufs


def _decode_partial_items(raw_parts: Any, frames: Sequence[Buffer]
                          ) -> tuple[list[PartialItem], int]:
    """A batch's parts, and how many of ``frames`` (from the first) their tensors took."""
    if type(raw_parts) is not list:
        raise ProtocolError("a batch's parts must be a list")
    if len(raw_parts) > MAX_BUNDLE:
        raise ProtocolError(f"{len(raw_parts)} parts in one, more than {MAX_BUNDLE}")
    parts, pos = [], 0
    for raw in raw_parts:
        if not (type(raw) is list and len(raw) == 3 and type(raw[0]) is str
                and type(raw[1]) is bool and type(raw[2]) is list):
            raise ProtocolError("each part must be [item, final, tensors]")
        n = len(raw[2])
        parts.append(PartialItem(raw[0], raw[1], _decode_tensors(raw[2], frames[pos:pos + n])))
        pos += n
    return parts, pos


def decode_partial(header: dict[str, Any], frames: Sequence[Buffer]) -> Partial:
    """A PARTIAL whose every part is well formed, or ProtocolError (then none is used:
    the broker fails the batch, as for a malformed RESULT)."""
    parts, pos = _decode_partial_items(field_of(header, "parts", list), frames)
    if pos != len(frames):
        raise ProtocolError(f"partial declares {pos} tensors but carries {len(frames)} frames")
    return Partial(field_of(header, "id", int), parts)


def encode_steps(msgs: Sequence[Partial]) -> list[Buffer]:
    """One STEPS of at most MAX_BUNDLE batches' PARTIALs (the sender splits more)."""
    bufs: list[Buffer] = []
    batches = [[msg.batch_id, _partial_parts(msg, bufs)] for msg in msgs]
    return pack(Kind.STEPS, {"batches": batches}) + bufs


def steps_batch_ids(header: dict[str, Any]) -> list[int]:
    """Best effort: the batches a STEPS names, to fail them when it does not decode."""
    raw = header.get("batches")
    return [b[0] for b in raw if type(b) is list and b and type(b[0]) is int] \
        if isinstance(raw, list) else []


def decode_steps(header: dict[str, Any], frames: Sequence[Buffer]) -> list[Partial]:
    """Every batch's PARTIAL of a STEPS, each well formed, or ProtocolError (then none is
    used: the broker fails the batches it names)."""
    raw = field_of(header, "batches", list)
    if len(raw) > MAX_BUNDLE:
        raise ProtocolError(f"{len(raw)} batches in one, more than {MAX_BUNDLE}")
    out, pos = [], 0
    for batch in raw:
        if not (type(batch) is list and len(batch) == 2 and type(batch[0]) is int):
            raise ProtocolError("each batch must be [batch id, parts]")
        parts, used = _decode_partial_items(batch[1], frames[pos:])
        out.append(Partial(batch[0], parts))
        pos += used
    if pos != len(frames):
        raise ProtocolError(f"steps declare {pos} tensors but carry {len(frames)} frames")
    return out
