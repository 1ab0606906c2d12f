"""The zeroserve wire protocol: the one place that builds and parses frames.

A message is a multipart ZeroMQ message::

    [kind (1 byte)] [header (msgpack map)] [tensor buffer] ...

ROUTER sockets prepend the peer's identity; callers strip it before decoding.
The header always carries ``v`` (the protocol version). Tensors never pass
through msgpack: a header lists ``[name, datatype, shape]`` triples and each
tensor's raw bytes follow as their own frame, in the same order.

Every message kind has a frozen dataclass here. Inference messages (request,
reply, error, batch, result) carry tensors and have their own codecs; the others
are declared with a field schema and go through :func:`encode` / :func:`decode`,
which validate every field's type and never ``assert``.

Time on the wire is a remaining budget (``timeout_ms``) computed when a message
is sent, so processes on different hosts need no shared clock.

Nothing here imports torch: the broker and gateway use it too.
"""

from __future__ import annotations

import enum
import functools
import math
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Callable, Sequence

import msgpack

from zeroserve.broker.tensors import (DTYPES, ITEM_BYTES, Buffer, ProtocolError, Tensor,
                                      TensorMeta, datatype_of, from_numpy,
                                      pack_bytes_elements, to_numpy, unpack_bytes_elements)

__all__ = ["DTYPES", "ITEM_BYTES", "Buffer", "ProtocolError", "Tensor", "TensorMeta",
           "datatype_of", "from_numpy", "pack_bytes_elements", "to_numpy",
           "unpack_bytes_elements"]

# Versions: each message is stamped with the version its kind first appeared in, so a
# peer that speaks only version 1 still reads every kind it knows; a receiver accepts
# every version it speaks and raises VersionMismatch for any other. Version 2 adds
# REQUESTS and REPLIES (several inference messages in one), sent only to a peer known
# to speak it: the broker's PONG lists ``versions``; a client that sent REQUESTS gets
# its replies as REPLIES. Version 3 adds WAITING (a handler's batch waits on the models
# it called, workers/bls.py), sent only to a broker whose LOAD listed version 3: an older
# broker drops it as malformed, and the nested-call deadlock it prevents would return.
# Version 4 adds STEPS (one step's responses of an iterative model's several batches in
# one message, workers/sequences.py), sent only to a broker whose LOAD listed version 4:
# an older one gets a PARTIAL per batch.
# Version 5 adds PAUSE (a running sequence sits out its steps for a request of a higher
# priority, workers/sequences.py), sent only to a worker whose READY listed version 5: an
# older one would drop it, so no sequence of its is preempted.
PROTOCOL_VERSION = 5
SUPPORTED_VERSIONS = (1, 2, 3, 4, 5)
WAITING_VERSION = 3
STEPS_VERSION = 4
PAUSE_VERSION = 5


class VersionMismatch(ProtocolError):
    """A well-formed message of a protocol version this peer does not speak; ``header``
    lets the receiver answer the request it names."""

    def __init__(self, header: dict[str, Any], message: str) -> None:
        super().__init__(message)
        self.header = header


class Kind(bytes, enum.Enum):
    # client <-> broker (frontend socket)
    REQUEST = b"\x01"
    REPLY = b"\x02"
    ERROR = b"\x03"
    CANCEL = b"\x04"
    PING = b"\x05"
    PONG = b"\x06"
    REQUESTS = b"\x07"    # version 2: several requests in one message
    REPLIES = b"\x08"     # version 2: several replies in one message
    PARTS = b"\x09"       # responses of streams (decoupled models), each marked final or not
    # worker <-> broker (backend socket)
    READY = b"\x10"
    HEARTBEAT = b"\x11"
    BATCH = b"\x12"
    RESULT = b"\x13"
    LOAD = b"\x14"
    LOADED = b"\x15"
    UNLOAD = b"\x16"
    DISCONNECT = b"\x17"   # broker -> worker
    LEAVE = b"\x18"        # worker -> broker
    LOG_SETTINGS = b"\x19" # broker -> worker
    PARTIAL = b"\x1a"      # worker -> broker: responses of a decoupled batch, as yielded
    STOP = b"\x1b"         # broker -> worker: requests of a running stream to stop
    WAITING = b"\x1c"      # worker -> broker: a batch waits on models it called (BLS)
    STEPS = b"\x1d"        # version 4, worker -> broker: one step's PARTIALs of several batches
    PAUSE = b"\x1e"        # version 5, broker -> worker: running sequences to pause
    # control (CLI, gateway metadata and metrics)
    CONTROL = b"\x20"
    CONTROL_REPLY = b"\x21"


_KINDS = {k.value: k for k in Kind}
# the version a kind first appeared in
_SINCE = {Kind.REQUESTS: 2, Kind.REPLIES: 2, Kind.WAITING: WAITING_VERSION,
          Kind.STEPS: STEPS_VERSION, Kind.PAUSE: PAUSE_VERSION}
MAX_BUNDLE = 256    # inference messages in one REQUESTS or REPLIES at most


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
    UNAUTHORIZED = "unauthorized"    # control: a state-changing verb without the admin token
    UNSUPPORTED = "unsupported"      # the call does not fit the model (unary on a decoupled one)
    TOO_LARGE = "too_large"          # a message over the receiver's byte or length limits
    TOO_BIG = "too_big"              # a model no worker can hold even with nothing else

    @property
    def retryable(self) -> bool:
        return self in (ErrorCode.OVERLOADED, ErrorCode.NO_WORKER, ErrorCode.WORKER_LOST,
                        ErrorCode.UNAVAILABLE, ErrorCode.QUOTA)


class DisconnectReason(str, enum.Enum):
    """Why the broker tells a worker to go (broker -> worker DISCONNECT)."""

    UNKNOWN_WORKER = "unknown_worker"    # register again (the broker restarted, or purged it)
    DRAINED = "drained"                  # nothing of ours runs on you any more: exit
    HUNG = "hung"                        # a batch ran past max_execution_ms: exit now
    BROKER_STOPPING = "broker_stopping"  # exit if you are stopping too, else wait for the next
    DUPLICATE_ID = "duplicate_id"        # another live process holds your worker id: not you


class LeaveReason(str, enum.Enum):
    """Why a worker leaves (worker -> broker LEAVE)."""

    SHUTDOWN = "shutdown"    # SIGTERM: drain me, then I exit
    RECYCLE = "recycle"      # memory not returned: drain me, then I exit to be restarted


# ---------------------------------------------------------------------------
# inference messages (they carry tensors)

@dataclass(frozen=True)
class InferRequest:
    """client -> broker. ``timeout_ms`` 0 means the model's default."""

    request_id: str
    model: str
    tensors: Sequence[Tensor]
    version: int | None = None
    priority: int = 0
    timeout_ms: float = 0.0
    tenant: str = ""          # unused; the broker names the tenant from ``api_key``
    outputs: Sequence[str] | None = None
    api_key: str = ""         # who is calling, when the broker has a tenants file
    # the caller reads a response sequence (PARTS): required by a decoupled model, and
    # what tells the broker that this peer speaks PARTS (no protocol version needed)
    stream: bool = False
    # a traced request: the caller's W3C context (broker/tracing.py); absent otherwise
    trace: dict[str, str] | None = None
    # what sticks a caller to one version of a traffic split (docs/rollouts.md): empty
    # means the broker uses the API key, else the client's connection
    routing_key: str = ""
    # one input of a request of several (an embeddings call's texts, each its own row of
    # the batcher): its index there; tenants count the request once, at row 0
    row: int = 0


@dataclass(frozen=True)
class InferReply:
    """broker -> client, and per request inside a worker's batch result."""

    request_id: str
    model: str
    version: int
    tensors: Sequence[Tensor]
    stats: dict[str, float] = field(default_factory=dict)
    trace: dict[str, Any] | None = None   # a traced request's stamps (broker/tracing.py)
    # the sha256 of the version's files that answered (the catalog's), empty from a peer
    # that does not say
    build: str = ""


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
class BatchTrace:
    """A batch holding traced requests: each one's item index, wire context (as
    ``InferRequest.trace``) and arrival, and when the batch left, on the broker's clock
    (``boot``: broker/tracing.py), so a worker in opentelemetry mode can emit their queue
    spans and the batch's span (workers/spans.py)."""

    boot: str
    sent_ns: int
    items: Sequence[tuple[int, dict[str, str], int]]


@dataclass(frozen=True)
class Caller:
    """Who sent one item of a batch, for a handler that calls models (workers/bls.py):
    its priority level, its remaining budget when the batch left (0: none) and its key."""

    priority: int = 0
    timeout_ms: float = 0.0
    api_key: str = ""


@dataclass(frozen=True)
class Batch:
    """broker -> worker: requests of one model version to run together."""

    batch_id: int
    model: str
    version: int
    items: Sequence[BatchItem]
    timeout_ms: float = 0.0
    # an item is traced: the result carries the worker's stamps
    trace: BatchTrace | None = None
    # a Python handler's batch: each item's caller, which the models it calls inherit
    callers: Sequence[Caller] | None = None


@dataclass(frozen=True)
class BatchResult:
    """worker -> broker. On failure ``error`` is set and ``replies`` is empty.
    ``phases_ms`` splits ``compute_ms`` into input assembly, the model call and output
    encoding (``input``, ``infer``, ``output``)."""

    batch_id: int
    replies: Sequence[InferReply]
    compute_ms: float = 0.0
    error: str | None = None
    retry: bool = False     # the batch never ran here (say, its model is not loaded)
    expired: bool = False   # never ran: its deadline passed before it could start
    phases_ms: dict[str, float] = field(default_factory=dict)
    trace: dict[str, Any] | None = None   # the worker's stamps, for a traced batch


@dataclass(frozen=True)
class StreamPart:
    """broker -> client: one response of a stream. ``index`` counts a request's responses
    from 0; the one with ``final`` ends it (it may carry no tensors: an empty final
    response). A request is answered at its final part, or by an ERROR."""

    request_id: str
    model: str
    version: int
    index: int
    final: bool
    tensors: Sequence[Tensor]
    stats: dict[str, float] = field(default_factory=dict)
    build: str = ""   # as InferReply.build


@dataclass(frozen=True)
class PartialItem:
    """One yielded response of one batch item (``item`` is its id in the batch)."""

    item: str
    final: bool
    tensors: Sequence[Tensor]


@dataclass(frozen=True)
class Partial:
    """worker -> broker: what one yield of a decoupled model's generator produced, sent
    as it is produced. The batch's RESULT follows the generator's end (or its error)."""

    batch_id: int
    parts: Sequence[PartialItem]


@dataclass(frozen=True)
class Stop:
    """broker -> worker: these items of a running batch are answered (cancelled, timed
    out): their generation stops at its next yield once no item of the batch is left."""

    KIND = Kind.STOP
    batch_id: int
    items: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Pause:
    """broker -> worker: these items of an iterative model's batch pause (a request of a
    higher priority takes their slot): they sit out the steps, their state kept, and
    resume once a slot is free there."""

    KIND = Kind.PAUSE
    batch_id: int
    items: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Waiting:
    """worker -> broker: this batch runs off the worker's compute thread and waits on
    models it called, so it holds none of the worker's credits until its result (no
    worker may wait on work only it can run: docs/bls.md)."""

    KIND = Kind.WAITING
    batch_id: int


# ---------------------------------------------------------------------------
# everything else: plain headers with a declared schema

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


@dataclass(frozen=True)
class Cancel:
    """client -> broker: withdraw a queued request."""
    KIND = Kind.CANCEL
    request_id: str


@dataclass(frozen=True)
class Ping:
    KIND = Kind.PING


@dataclass(frozen=True)
class Pong:
    """``versions``: those the sender speaks (absent from a version-1 peer's);
    ``settings`` and ``logs``: the versions of the trace settings and of the log settings
    the broker holds for the gateways (broker/tracesettings.py, broker/server/extverbs.py;
    0 from a broker without them)."""
    KIND = Kind.PONG
    versions: list[int] = field(default_factory=lambda: list(SUPPORTED_VERSIONS))
    settings: int = 0
    logs: int = 0


@dataclass(frozen=True)
class WorkerReady:
    """worker -> broker: register (again), with what is already loaded."""
    KIND = Kind.READY
    worker_id: str
    credits: int = 2
    pid: int = 0
    host: str = ""
    device: str = ""
    models: list[list[Any]] = field(default_factory=list)   # [[model, version], ...]
    memory_budget_bytes: int = 0
    # the memory planner's inputs, as in heartbeats: device, headroom_bytes, context_bytes,
    # gpu_free_bytes, models/plans of what is loaded (see models/footprint.py)
    memory: dict[str, Any] = field(default_factory=dict)
    # the protocol versions the worker speaks; absent from an older worker's READY,
    # which speaks version 1 only: the broker sends a worker a kind newer than that only
    # where it is listed here (WorkerPool.speaks), so hosts can be upgraded one by one
    versions: list[int] = field(default_factory=lambda: [1])


@dataclass(frozen=True)
class WorkerHeartbeat:
    """worker -> broker: alive, with its memory and its metrics text."""
    KIND = Kind.HEARTBEAT
    memory: dict[str, Any] = field(default_factory=dict)
    metrics: str = ""


@dataclass(frozen=True)
class BrokerHeartbeat:
    """broker -> worker: alive. The worker heartbeats at ``interval_s`` too, and counts
    the broker lost after ``expiry_s`` of silence (the broker's own worker expiry)."""
    KIND = Kind.HEARTBEAT
    interval_s: float = 0.5
    expiry_s: float = 2.0


@dataclass(frozen=True)
class LoadModel:
    """broker -> worker: load (and warm up) a version; ``sha256`` is what the broker's
    repository holds (empty: not known)."""
    KIND = Kind.LOAD
    model: str
    version: int
    path: str
    config: dict[str, Any]
    sha256: str = ""
    # a registration's trial load: {"datatypes": [inputs whose datatype is a guess]};
    # the worker settles those and finds outputs the config lacks (workers/discovery.py)
    discover: dict[str, Any] = field(default_factory=dict)
    # the protocol versions the broker speaks (WorkerPool.load lists them); absent from an
    # older broker's LOAD, which speaks version 1 only as far as the worker may assume
    versions: list[int] = field(default_factory=lambda: [1])


@dataclass(frozen=True)
class ModelLoaded:
    """worker -> broker: the outcome of a LOAD."""
    KIND = Kind.LOADED
    model: str
    version: int
    ok: bool
    error: str = ""
    sha256: str = ""
    memory_bytes: int = 0
    load_s: float = 0.0
    # what warm-up measured: resident_bytes, the activation term, footprint_bytes
    memory: dict[str, Any] = field(default_factory=dict)
    # the config a LOAD with ``discover`` completed (datatypes and outputs found)
    config: dict[str, Any] = field(default_factory=dict)
    # a failure whose cause may pass (out of memory, I/O, a timeout): the broker retries
    transient: bool = False


@dataclass(frozen=True)
class UnloadModel:
    KIND = Kind.UNLOAD
    model: str
    version: int


@dataclass(frozen=True)
class Disconnect:
    """broker -> worker. ``restart``: exit so that the supervisor starts you again."""
    KIND = Kind.DISCONNECT
    reason: DisconnectReason
    restart: bool = False
    detail: str = ""


@dataclass(frozen=True)
class Leave:
    """worker -> broker: I am leaving; with ``drain``, once my batches are done."""
    KIND = Kind.LEAVE
    reason: LeaveReason
    drain: bool = True
    detail: str = ""


@dataclass(frozen=True)
class LogSettings:
    """broker -> worker: the logging extension's settings (the keys given change;
    validated by the broker, applied by the worker with zeroserve.broker.logsettings)."""
    KIND = Kind.LOG_SETTINGS
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ControlRequest:
    """CLI / gateway -> broker: a control verb. ``token`` is the admin token, needed for
    verbs that change state when the broker has one."""
    KIND = Kind.CONTROL
    call_id: str
    verb: str
    args: dict[str, Any] = field(default_factory=dict)
    token: str = ""


@dataclass(frozen=True)
class ControlReply:
    KIND = Kind.CONTROL_REPLY
    call_id: str
    ok: bool
    result: Any = None
    code: str = ""
    error: str = ""


# the wire names of fields whose Python name differs (kept short and stable on the wire)
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


MESSAGES = (Cancel, Ping, Pong, WorkerReady, WorkerHeartbeat, BrokerHeartbeat, LoadModel,
            ModelLoaded, UnloadModel, Disconnect, Leave, LogSettings, ControlRequest,
            ControlReply, Stop, Waiting, Pause)
_SCHEMAS: dict[type, list[tuple[str, str, Any, Any]]] = {cls: _schema(cls) for cls in MESSAGES}


def encode(msg: Any) -> list[Buffer]:
    """Frames of a schema-declared message (everything but the inference messages)."""
    header: dict[str, Any] = {}
    for name, wire, _, _ in _SCHEMAS[type(msg)]:
        value = getattr(msg, name)
        header[wire] = value.value if isinstance(value, enum.Enum) else value
    return _pack(msg.KIND, header)


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


# ---------------------------------------------------------------------------
# framing helpers

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

def _pack(kind: Kind, header: dict[str, Any]) -> list[Buffer]:
    header["v"] = _SINCE.get(kind, 1)
    return [kind.value, msgpack.packb(header, use_bin_type=True)]


def peek_kind(frames: Sequence[Buffer]) -> Kind:
    if len(frames) < 2:
        raise ProtocolError(f"expected at least 2 frames, got {len(frames)}")
    raw = bytes(frames[0])
    kind = _KINDS.get(raw)
    if kind is None:
        raise ProtocolError(f"unknown message kind {raw[:8]!r}")
    return kind


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
        header = _decoder(limits)(raw)
    except ValueError as exc:
        if "exceeds max" in str(exc):   # msgpack's wording for its length limits
            raise Refused(_scan_id(raw), ErrorCode.TOO_LARGE, f"a header with a map or list "
                          f"of more than {limits.container_len} entries") from None
        raise ProtocolError(f"header is not msgpack: {type(exc).__name__}") from None
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"header is not msgpack: {type(exc).__name__}") from None
    if not isinstance(header, dict):
        raise ProtocolError("header is not a map")
    if len(frames) > 2:
        total = sum(map(_nbytes, frames[2:]))
        if total > limits.message_bytes:
            raise Refused(ids_of(header), ErrorCode.TOO_LARGE, f"a message of {total} bytes "
                          f"of tensors is over the limit of {limits.message_bytes}")
    version = header.get("v")
    if version not in SUPPORTED_VERSIONS or isinstance(version, bool):
        raise VersionMismatch(header, f"protocol version {version!r} is not supported (this "
                                      f"peer speaks {', '.join(map(str, SUPPORTED_VERSIONS))})")
    if version < _SINCE.get(kind, 1):
        raise Refused(ids_of(header), ErrorCode.BAD_INPUT, f"{kind.name} needs protocol "
                      f"version {_SINCE[kind]}, the message says {version}")
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
    return _pack(Kind.REQUEST, header) + bufs


def decode_request(header: dict[str, Any], frames: Sequence[Buffer]) -> InferRequest:
    outputs = _field(header, "outputs", list, None)
    if outputs is not None and not all(isinstance(o, str) for o in outputs):
        raise ProtocolError("'outputs' must be a list of names")
    version = _field(header, "version", int, None)
    if version is not None and version < 1:
        raise ProtocolError(f"version must be a positive integer, got {version}")
    timeout_ms = float(_field(header, "timeout_ms", (int, float), 0.0))
    if not math.isfinite(timeout_ms) or timeout_ms < 0:
        raise ProtocolError(f"timeout_ms must be a finite number >= 0 (0: the model's "
                            f"default), got {timeout_ms}")
    return InferRequest(
        request_id=_field(header, "id", str),
        model=_field(header, "model", str),
        tensors=_decode_tensors(header.get("tensors"), frames),
        version=version,
        priority=_field(header, "priority", int, 0),
        timeout_ms=timeout_ms,
        tenant=_field(header, "tenant", str, ""),
        outputs=outputs,
        api_key=_field(header, "api_key", str, ""),
        stream=_stream_flag(header),
        trace=_trace_context(header),
        routing_key=_field(header, "routing_key", str, ""),
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


def bundle(kind: Kind, key: str, parts: Sequence[tuple[dict[str, Any], list[Buffer]]]
           ) -> list[Buffer]:
    """One REQUESTS or REPLIES message of (header, frames) parts."""
    bufs: list[Buffer] = []
    for _, frames in parts:
        bufs.extend(frames)
    return _pack(kind, {key: [h for h, _ in parts]}) + bufs


def unbundle(header: dict[str, Any], frames: Sequence[Buffer], key: str
             ) -> list[tuple[dict[str, Any], Sequence[Buffer]]]:
    """The (header, tensor frames) of each message in a REQUESTS or REPLIES. A part whose
    ``tensors`` is not a list owns no frame (decoding it names the error)."""
    parts = _field(header, key, list)
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
        return _pack(Kind.REPLY, header) + bufs
    return bundle(Kind.REPLIES, "replies", parts)


def encode_reply(rep: InferReply) -> list[Buffer]:
    header, bufs = reply_header(rep)
    return _pack(Kind.REPLY, header) + bufs


def encode_replies(reps: Sequence[InferReply]) -> list[Buffer]:
    """Several replies to one client in one message (version 2)."""
    return bundle(Kind.REPLIES, "replies", [reply_header(r) for r in reps])


def decode_replies(header: dict[str, Any], frames: Sequence[Buffer]) -> list[InferReply]:
    return [decode_reply(h, bufs) for h, bufs in unbundle(header, frames, "replies")]


def decode_reply(header: dict[str, Any], frames: Sequence[Buffer]) -> InferReply:
    return InferReply(
        request_id=_field(header, "id", str),
        model=_field(header, "model", str),
        version=_field(header, "version", int),
        tensors=_decode_tensors(header.get("tensors"), frames),
        stats=_field(header, "stats", dict, {}),
        trace=_field(header, "trace", dict, None),
        build=_field(header, "build", str, ""),
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
    return _pack(Kind.BATCH, header) + bufs


def decode_batch(header: dict[str, Any], frames: Sequence[Buffer]) -> Batch:
    raw_items = _field(header, "items", list)
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
    return Batch(_field(header, "id", int), _field(header, "model", str),
                 _field(header, "version", int), items,
                 float(_field(header, "timeout_ms", (int, float), 0.0)),
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
    for entry in _field(raw, "items", list):
        if not (isinstance(entry, list) and len(entry) == 3 and type(entry[0]) is int
                and 0 <= entry[0] < n_items and type(entry[2]) is int):
            raise ProtocolError("each traced item must be [index, context, arrival_ns]")
        items.append((entry[0], _trace_context({"trace": entry[1]}) or {}, entry[2]))
    return BatchTrace(_field(raw, "boot", str), _field(raw, "sent_ns", int), items)


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
    return _pack(Kind.RESULT, header) + bufs


def decode_result(header: dict[str, Any], frames: Sequence[Buffer],
                  model: str, version: int) -> BatchResult:
    replies, pos = [], 0
    for raw in _field(header, "replies", list):
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
              for k, v in _field(header, "phases_ms", dict, {}).items()}
    return BatchResult(_field(header, "id", int), replies,
                       _duration_ms("compute_ms", _field(header, "compute_ms", (int, float), 0.0)),
                       _field(header, "error", str, None), _field(header, "retry", bool, False),
                       _field(header, "expired", bool, False), phases,
                       _field(header, "trace", dict, None))


MAX_DURATION_MS = 7 * 24 * 3600 * 1000.0   # a week: no batch runs longer


def _duration_ms(name: str, value: Any) -> float:
    """A time a worker measured: finite and within [0, a week], or the message is
    refused (a NaN once poisoned the latency model and lost its batch)."""
    if not _is_number(value) or not 0.0 <= value <= MAX_DURATION_MS:
        raise ProtocolError(f"{name} must be a finite number of ms in [0, "
                            f"{MAX_DURATION_MS:.0f}], got {value!r}"[:200])
    return float(value)


def result_batch_id(header: dict[str, Any]) -> int:
    return int(_field(header, "id", int))


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
    index = _field(header, "index", int)
    if index < 0:
        raise ProtocolError(f"a response index must be >= 0, got {index}")
    return StreamPart(_field(header, "id", str), _field(header, "model", str),
                      _field(header, "version", int), index, _field(header, "final", bool),
                      _decode_tensors(header.get("tensors"), frames),
                      _field(header, "stats", dict, {}), _field(header, "build", str, ""))


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
    return _pack(Kind.PARTIAL, {"id": msg.batch_id, "parts": parts}) + bufs


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
    parts, pos = _decode_partial_items(_field(header, "parts", list), frames)
    if pos != len(frames):
        raise ProtocolError(f"partial declares {pos} tensors but carries {len(frames)} frames")
    return Partial(_field(header, "id", int), parts)


def encode_steps(msgs: Sequence[Partial]) -> list[Buffer]:
    """One STEPS of at most MAX_BUNDLE batches' PARTIALs (the sender splits more)."""
    bufs: list[Buffer] = []
    batches = [[msg.batch_id, _partial_parts(msg, bufs)] for msg in msgs]
    return _pack(Kind.STEPS, {"batches": batches}) + bufs


def steps_batch_ids(header: dict[str, Any]) -> list[int]:
    """Best effort: the batches a STEPS names, to fail them when it does not decode."""
    raw = header.get("batches")
    return [b[0] for b in raw if type(b) is list and b and type(b[0]) is int] \
        if isinstance(raw, list) else []


def decode_steps(header: dict[str, Any], frames: Sequence[Buffer]) -> list[Partial]:
    """Every batch's PARTIAL of a STEPS, each well formed, or ProtocolError (then none is
    used: the broker fails the batches it names)."""
    raw = _field(header, "batches", list)
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
