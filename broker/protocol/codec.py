r"""Encoders and decoders of the inference messages, those that carry tensors: headers
of named fields (a field at its default left off), each tensor's bytes a frame of its
own. A decoder converts the received map to the kind's wire shape (:mod:`.typed`),
checked in C, then pairs its tensors' metadata with their frames."""

from __future__ import annotations

from typing import Annotated, Any, Sequence

import msgspec

from zeroserve.broker.protocol.envelope import bundle, pack, unbundle
from zeroserve.broker.protocol.messages import (MAX_BUNDLE, Batch, BatchItem, BatchResult,
                                                BatchTrace, Caller, ErrorCode, ErrorReply,
                                                InferReply, InferRequest, Kind, Partial,
                                                PartialItem, StreamPart)
from zeroserve.broker.protocol.typed import Wire, convert, tensors_of
from zeroserve.broker.tensors import Buffer, ProtocolError, Tensor, TensorMeta

NonNegative = Annotated[float, msgspec.Meta(ge=0.0, le=1.7976931348623157e308)]


# ---------------------------------------------------------------------------
# client <-> broker

class TraceContext(Wire, frozen=True):
    """A traced request's W3C context (broker/tracing.py)."""

    traceparent: str
    tracestate: str = ""


class RequestHeader(Wire, frozen=True):
    request_id: str
    model: str
    tensors: list[TensorMeta]
    version: Annotated[int, msgspec.Meta(ge=1)] | None = None
    priority: int = 0
    timeout_ms: NonNegative = 0.0
    tenant: str = ""
    outputs: list[str] | None = None
    api_key: str = ""
    stream: bool = False
    trace: TraceContext | None = None
    routing_key: str = ""
    row: Annotated[int, msgspec.Meta(ge=0)] = 0


def encode_request(req: InferRequest) -> list[Buffer]:
    header, bufs = request_header(req)
    return pack(Kind.REQUEST, header) + bufs


def decode_request(header: dict[str, Any], frames: Sequence[Buffer]) -> InferRequest:
    h = convert(header, RequestHeader, "request")
    trace = None if h.trace is None else _context(h.trace)
    return InferRequest(h.request_id, h.model, tensors_of(h.tensors, frames), h.version,
                        h.priority, h.timeout_ms, h.tenant, h.outputs, h.api_key, h.stream,
                        trace, h.routing_key, h.row)


def _context(trace: TraceContext) -> dict[str, str]:
    return {"traceparent": trace.traceparent, "tracestate": trace.tracestate} \
        if trace.tracestate else {"traceparent": trace.traceparent}


def encode_requests(reqs: Sequence[InferRequest]) -> list[Buffer]:
    """Several requests in one message (version 2): each one's header as REQUEST has it,
    then every tensor frame in order. Only to a broker whose PONG listed version 2."""
    return bundle(Kind.REQUESTS, "requests", [request_header(r) for r in reqs])


def request_header(req: InferRequest) -> tuple[dict[str, Any], list[Buffer]]:
    """A request's header (without ``v``) and its tensor frames, to bundle. A field at
    its default stays off the wire: every peer's decoder defaults an absent one."""
    metas, bufs = [t.meta for t in req.tensors], [t.data for t in req.tensors]
    header: dict[str, Any] = {"id": req.request_id, "model": req.model, "tensors": metas}
    if req.version is not None:
        header["version"] = req.version
    if req.priority:
        header["priority"] = req.priority
    if req.timeout_ms:
        header["timeout_ms"] = float(req.timeout_ms)
    if req.tenant:
        header["tenant"] = req.tenant
    if req.outputs is not None:
        header["outputs"] = list(req.outputs)
    if req.row:
        header["row"] = req.row
    if req.api_key:
        header["api_key"] = req.api_key
    if req.stream:
        header["stream"] = True
    if req.trace is not None:
        header["trace"] = req.trace
    if req.routing_key:
        header["routing_key"] = req.routing_key
    return header, bufs


class ReplyHeader(Wire, frozen=True):
    request_id: str
    model: str
    version: int
    tensors: list[TensorMeta]
    stats: dict[str, Any] = {}
    trace: dict[str, Any] | None = None
    build: str = ""


def reply_header(rep: InferReply) -> tuple[dict[str, Any], list[Buffer]]:
    return reply_part(rep.request_id, rep.model, rep.version, rep.tensors, rep.stats,
                      rep.trace, rep.build)


def reply_part(request_id: str, model: str, version: int, tensors: Sequence[Tensor],
               stats: dict[str, float], trace: dict[str, Any] | None = None,
               build: str = "") -> tuple[dict[str, Any], list[Buffer]]:
    """An InferReply's header and frames without the InferReply, for
    :func:`encode_reply_parts`: the broker makes one for every request it answers."""
    header = {"id": request_id, "model": model, "version": version,
              "tensors": [t.meta for t in tensors], "stats": stats}
    if trace is not None:
        header["trace"] = trace
    if build:
        header["build"] = build
    return header, [t.data for t in tensors]


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
    h = convert(header, ReplyHeader, "reply")
    return InferReply(h.request_id, h.model, h.version, tensors_of(h.tensors, frames), h.stats,
                      h.trace, h.build)


class ErrorHeader(Wire, frozen=True):
    request_id: str
    code: str
    message: str
    retry_after_s: float | None = None


def encode_error(err: ErrorReply) -> list[Buffer]:
    header = {"id": err.request_id, "code": err.code.value, "message": err.message,
              "retry_after_s": err.retry_after_s}
    return pack(Kind.ERROR, header)


def decode_error(header: dict[str, Any]) -> ErrorReply:
    """A code this peer does not know reads as ``internal``: newer brokers add codes."""
    h = convert(header, ErrorHeader, "error")
    try:
        code = ErrorCode(h.code)
    except ValueError:
        code = ErrorCode.INTERNAL
    return ErrorReply(h.request_id, code, h.message, h.retry_after_s)


# ---------------------------------------------------------------------------
# broker <-> worker

class ItemWire(msgspec.Struct, frozen=True, array_like=True):
    """A batch item on the wire: ``[id, tensors, outputs]``."""

    request_id: str
    tensors: list[TensorMeta]
    outputs: list[str] | None


class CallerWire(msgspec.Struct, frozen=True, array_like=True):
    """``[priority, timeout_ms, api_key]``."""

    priority: int
    timeout_ms: float
    api_key: str


class TracedItem(msgspec.Struct, frozen=True, array_like=True):
    """``[index, context, arrival_ns]``."""

    index: Annotated[int, msgspec.Meta(ge=0)]
    context: TraceContext
    arrival_ns: int


class BatchTraceWire(msgspec.Struct, frozen=True):
    boot: str
    sent_ns: int
    items: list[TracedItem]


class BatchHeader(Wire, frozen=True):
    batch_id: int
    model: str
    version: int
    items: list[ItemWire]
    timeout_ms: float = 0.0
    trace: BatchTraceWire | None = None
    callers: list[CallerWire] | None = None


def encode_batch(batch: Batch) -> list[Buffer]:
    items: list[list[Any]] = []
    bufs: list[Buffer] = []
    for item in batch.items:
        items.append([item.request_id, [t.meta for t in item.tensors],
                      list(item.outputs) if item.outputs is not None else None])
        bufs.extend(t.data for t in item.tensors)
    header: dict[str, Any] = {"id": batch.batch_id, "model": batch.model,
                              "version": batch.version, "items": items,
                              "timeout_ms": float(batch.timeout_ms)}
    if batch.trace is not None:
        t = batch.trace
        header["trace"] = {"boot": t.boot, "sent_ns": t.sent_ns,
                           "items": [[i, ctx, arrival] for i, ctx, arrival in t.items]}
    if batch.callers is not None:
        header["callers"] = [[c.priority, float(c.timeout_ms), c.api_key]
                             for c in batch.callers]
    return pack(Kind.BATCH, header) + bufs


def decode_batch(header: dict[str, Any], frames: Sequence[Buffer]) -> Batch:
    h = convert(header, BatchHeader, "batch")
    items, pos = [], 0
    for raw in h.items:
        n = len(raw.tensors)
        items.append(BatchItem(raw.request_id, tensors_of(raw.tensors, frames[pos:pos + n]),
                               raw.outputs))
        pos += n
    if pos != len(frames):
        raise ProtocolError(f"batch declares {pos} tensors but carries {len(frames)} frames")
    trace = None
    if h.trace is not None:
        if any(t.index >= len(items) for t in h.trace.items):
            raise ProtocolError("a traced item's index is past the batch's items")
        trace = BatchTrace(h.trace.boot, h.trace.sent_ns, [
            (t.index, _context(t.context), t.arrival_ns) for t in h.trace.items])
    callers = None
    if h.callers is not None:
        if len(h.callers) != len(items):
            raise ProtocolError("a batch's 'callers' must be a list with one entry per item")
        callers = [Caller(c.priority, c.timeout_ms, c.api_key) for c in h.callers]
    return Batch(h.batch_id, h.model, h.version, items, h.timeout_ms, trace, callers)


MAX_DURATION_MS = 7 * 24 * 3600 * 1000.0   # a week: no batch runs longer
# a time a worker measured: finite and within [0, a week], or the message is refused
# (a NaN once poisoned the latency model and lost its batch)
Duration = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_DURATION_MS)]


class ResultReply(msgspec.Struct, frozen=True, array_like=True):
    """One item's answer in a RESULT: ``[id, tensors]``."""

    request_id: str
    tensors: list[TensorMeta]


class ResultHeader(Wire, frozen=True):
    batch_id: int
    replies: list[ResultReply]
    compute_ms: Duration = 0.0
    error: str | None = None
    retry: bool = False
    expired: bool = False
    phases_ms: dict[str, Duration] = {}
    trace: dict[str, Any] | None = None


def encode_result(result: BatchResult) -> list[Buffer]:
    """A field at its default stays off the wire (an older broker defaults it too)."""
    replies: list[list[Any]] = []
    bufs: list[Buffer] = []
    for rep in result.replies:
        replies.append([rep.request_id, [t.meta for t in rep.tensors]])
        bufs.extend(t.data for t in rep.tensors)
    header: dict[str, Any] = {"id": result.batch_id, "replies": replies,
                              "compute_ms": result.compute_ms}
    if result.error is not None:
        header["error"] = result.error
    if result.retry:
        header["retry"] = True
    if result.expired:
        header["expired"] = True
    if result.phases_ms:
        header["phases_ms"] = result.phases_ms
    if result.trace is not None:
        header["trace"] = result.trace
    return pack(Kind.RESULT, header) + bufs


def decode_result(header: dict[str, Any], frames: Sequence[Buffer],
                  model: str, version: int) -> BatchResult:
    h = convert(header, ResultHeader, "result")
    replies, pos = [], 0
    for raw in h.replies:
        n = len(raw.tensors)
        replies.append(InferReply(raw.request_id, model, version,
                                  tensors_of(raw.tensors, frames[pos:pos + n])))
        pos += n
    if pos != len(frames):
        raise ProtocolError(f"result declares {pos} tensors but carries {len(frames)} frames")
    return BatchResult(h.batch_id, replies, h.compute_ms, h.error, h.retry, h.expired,
                       h.phases_ms, h.trace)


def result_batch_id(header: dict[str, Any]) -> int:
    batch_id = header.get("id")
    if type(batch_id) is not int:
        raise ProtocolError(f"header field 'id' must be an integer, got "
                            f"{type(batch_id).__name__}")
    return batch_id


# ---------------------------------------------------------------------------
# streams (decoupled models)

class PartHeader(Wire, frozen=True):
    request_id: str
    model: str
    version: int
    index: Annotated[int, msgspec.Meta(ge=0)]
    final: bool
    tensors: list[TensorMeta]
    stats: dict[str, Any] = {}
    build: str = ""


def part_header(part: StreamPart) -> tuple[dict[str, Any], list[Buffer]]:
    header: dict[str, Any] = {"id": part.request_id, "model": part.model,
                              "version": part.version, "index": part.index,
                              "final": part.final, "tensors": [t.meta for t in part.tensors]}
    if part.stats:
        header["stats"] = part.stats
    if part.build:
        header["build"] = part.build
    return header, [t.data for t in part.tensors]


def encode_parts(parts: Sequence[StreamPart]) -> list[Buffer]:
    """Responses of streams to one client, in order, in one message."""
    return bundle(Kind.PARTS, "parts", [part_header(x) for x in parts])


def decode_part(header: dict[str, Any], frames: Sequence[Buffer]) -> StreamPart:
    h = convert(header, PartHeader, "response")
    return StreamPart(h.request_id, h.model, h.version, h.index, h.final,
                      tensors_of(h.tensors, frames), h.stats, h.build)


def decode_parts(header: dict[str, Any], frames: Sequence[Buffer]) -> list[StreamPart]:
    return [decode_part(h, bufs) for h, bufs in unbundle(header, frames, "parts")]


class PartialWire(msgspec.Struct, frozen=True, array_like=True):
    """One yielded response of a batch item: ``[item, final, tensors]``."""

    item: str
    final: bool
    tensors: list[TensorMeta]


Parts = Annotated[list[PartialWire], msgspec.Meta(max_length=MAX_BUNDLE)]


class PartialHeader(Wire, frozen=True):
    batch_id: int
    parts: Parts


class StepWire(msgspec.Struct, frozen=True, array_like=True):
    """One batch's PARTIAL inside a STEPS: ``[batch id, parts]``."""

    batch_id: int
    parts: Parts


class StepsHeader(Wire, frozen=True):
    batches: Annotated[list[StepWire], msgspec.Meta(max_length=MAX_BUNDLE)]


def _partial_parts(msg: Partial, bufs: list[Buffer]) -> list[list[Any]]:
    parts = []
    for item in msg.parts:
        parts.append([item.item, item.final, [t.meta for t in item.tensors]])
        bufs.extend(t.data for t in item.tensors)
    return parts


def encode_partial(msg: Partial) -> list[Buffer]:
    bufs: list[Buffer] = []
    parts = _partial_parts(msg, bufs)
    return pack(Kind.PARTIAL, {"id": msg.batch_id, "parts": parts}) + bufs


def _partial_items(raw: Sequence[PartialWire], frames: Sequence[Buffer]
                   ) -> tuple[list[PartialItem], int]:
    """A batch's parts, and how many of ``frames`` (from the first) their tensors took."""
    parts, pos = [], 0
    for part in raw:
        n = len(part.tensors)
        parts.append(PartialItem(part.item, part.final,
                                 tensors_of(part.tensors, frames[pos:pos + n])))
        pos += n
    return parts, pos


def decode_partial(header: dict[str, Any], frames: Sequence[Buffer]) -> Partial:
    """A PARTIAL whose every part is well formed, or ProtocolError (then none is used:
    the broker fails the batch, as for a malformed RESULT)."""
    h = convert(header, PartialHeader, "partial")
    parts, pos = _partial_items(h.parts, frames)
    if pos != len(frames):
        raise ProtocolError(f"partial declares {pos} tensors but carries {len(frames)} frames")
    return Partial(h.batch_id, parts)


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
    h = convert(header, StepsHeader, "steps")
    out, pos = [], 0
    for batch in h.batches:
        parts, used = _partial_items(batch.parts, frames[pos:])
        out.append(Partial(batch.batch_id, parts))
        pos += used
    if pos != len(frames):
        raise ProtocolError(f"steps declare {pos} tensors but carry {len(frames)} frames")
    return out
