"""The message kinds and their types: what each message of the wire protocol holds.

Inference messages (request, reply, error, batch, result, stream parts) carry tensors
and have their own codecs (:mod:`.codec`); every other kind is declared with its fields
here and goes through :func:`.codec.encode` / :func:`.codec.decode`.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, ClassVar, Sequence

import msgspec
from msgspec import field

from zeroserve.broker.tensors import Tensor

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


# a number a peer measured or chose: finite (NaN fails both bounds), as JSON can say it
_FLOAT_MAX = 1.7976931348623157e308
Finite = Annotated[float, msgspec.Meta(ge=-_FLOAT_MAX, le=_FLOAT_MAX)]


class Message(msgspec.Struct, frozen=True, rename={"request_id": "id", "call_id": "id",
                                                  "batch_id": "id"}):
    """Every message type: immutable, cheap to build (msgspec builds and checks it in C),
    its id fields named ``id`` on the wire (short and stable)."""

    KIND: ClassVar[Kind]   # a message without tensors: its kind (each declares its own)


# ---------------------------------------------------------------------------
# inference messages (they carry tensors)

class InferRequest(Message, frozen=True):
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


class InferReply(Message, frozen=True):
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


class ErrorReply(Message, frozen=True):
    request_id: str
    code: ErrorCode
    message: str
    retry_after_s: float | None = None


class BatchItem(Message, frozen=True):
    request_id: str
    tensors: Sequence[Tensor]
    outputs: Sequence[str] | None = None


class BatchTrace(Message, frozen=True):
    """A batch holding traced requests: each one's item index, wire context (as
    ``InferRequest.trace``) and arrival, and when the batch left, on the broker's clock
    (``boot``: broker/tracing.py), so a worker in opentelemetry mode can emit their queue
    spans and the batch's span (workers/spans.py)."""

    boot: str
    sent_ns: int
    items: Sequence[tuple[int, dict[str, str], int]]


class Caller(Message, frozen=True):
    """Who sent one item of a batch, for a handler that calls models (workers/bls.py):
    its priority level, its remaining budget when the batch left (0: none) and its key."""

    priority: int = 0
    timeout_ms: float = 0.0
    api_key: str = ""


class Batch(Message, frozen=True):
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


class BatchResult(Message, frozen=True):
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


class StreamPart(Message, frozen=True):
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


class PartialItem(Message, frozen=True):
    """One yielded response of one batch item (``item`` is its id in the batch)."""

    item: str
    final: bool
    tensors: Sequence[Tensor]


class Partial(Message, frozen=True):
    """worker -> broker: what one yield of a decoupled model's generator produced, sent
    as it is produced. The batch's RESULT follows the generator's end (or its error)."""

    batch_id: int
    parts: Sequence[PartialItem]


class Stop(Message, frozen=True):
    """broker -> worker: these items of a running batch are answered (cancelled, timed
    out): their generation stops at its next yield once no item of the batch is left."""

    KIND: ClassVar[Kind] = Kind.STOP
    batch_id: int
    items: Annotated[list[str], msgspec.Meta(max_length=MAX_BUNDLE)] = field(default_factory=list)


class Pause(Message, frozen=True):
    """broker -> worker: these items of an iterative model's batch pause (a request of a
    higher priority takes their slot): they sit out the steps, their state kept, and
    resume once a slot is free there."""

    KIND: ClassVar[Kind] = Kind.PAUSE
    batch_id: int
    items: Annotated[list[str], msgspec.Meta(max_length=MAX_BUNDLE)] = field(default_factory=list)


class Waiting(Message, frozen=True):
    """worker -> broker: this batch runs off the worker's compute thread and waits on
    models it called, so it holds none of the worker's credits until its result (no
    worker may wait on work only it can run: docs/bls.md)."""

    KIND: ClassVar[Kind] = Kind.WAITING
    batch_id: int


class Cancel(Message, frozen=True):
    """client -> broker: withdraw a queued request."""
    KIND: ClassVar[Kind] = Kind.CANCEL
    request_id: str


class Ping(Message, frozen=True):
    KIND: ClassVar[Kind] = Kind.PING


class Pong(Message, frozen=True):
    """``versions``: those the sender speaks (absent from a version-1 peer's);
    ``settings`` and ``logs``: the versions of the trace settings and of the log settings
    the broker holds for the gateways (broker/tracesettings.py, broker/server/extverbs.py;
    0 from a broker without them)."""
    KIND: ClassVar[Kind] = Kind.PONG
    versions: list[int] = field(default_factory=lambda: list(SUPPORTED_VERSIONS))
    settings: int = 0
    logs: int = 0


class WorkerReady(Message, frozen=True):
    """worker -> broker: register (again), with what is already loaded."""
    KIND: ClassVar[Kind] = Kind.READY
    worker_id: str
    credits: int = 2
    pid: int = 0
    host: str = ""
    device: str = ""
    models: list[tuple[str, int]] = field(default_factory=list)   # [[model, version], ...]
    memory_budget_bytes: int = 0
    # the memory planner's inputs, as in heartbeats: device, headroom_bytes, context_bytes,
    # gpu_free_bytes, models/plans of what is loaded (see models/footprint.py)
    memory: dict[str, Any] = field(default_factory=dict)
    # the protocol versions the worker speaks; absent from an older worker's READY,
    # which speaks version 1 only: the broker sends a worker a kind newer than that only
    # where it is listed here (WorkerPool.speaks), so hosts can be upgraded one by one
    versions: list[int] = field(default_factory=lambda: [1])


class WorkerHeartbeat(Message, frozen=True):
    """worker -> broker: alive, with its memory and its metrics text."""
    KIND: ClassVar[Kind] = Kind.HEARTBEAT
    memory: dict[str, Any] = field(default_factory=dict)
    metrics: str = ""


class BrokerHeartbeat(Message, frozen=True):
    """broker -> worker: alive. The worker heartbeats at ``interval_s`` too, and counts
    the broker lost after ``expiry_s`` of silence (the broker's own worker expiry)."""
    KIND: ClassVar[Kind] = Kind.HEARTBEAT
    interval_s: Finite = 0.5
    expiry_s: Finite = 2.0


class LoadModel(Message, frozen=True):
    """broker -> worker: load (and warm up) a version; ``sha256`` is what the broker's
    repository holds (empty: not known)."""
    KIND: ClassVar[Kind] = Kind.LOAD
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


class ModelLoaded(Message, frozen=True):
    """worker -> broker: the outcome of a LOAD."""
    KIND: ClassVar[Kind] = Kind.LOADED
    model: str
    version: int
    ok: bool
    error: str = ""
    sha256: str = ""
    memory_bytes: int = 0
    load_s: Finite = 0.0
    # what warm-up measured: resident_bytes, the activation term, footprint_bytes
    memory: dict[str, Any] = field(default_factory=dict)
    # the config a LOAD with ``discover`` completed (datatypes and outputs found)
    config: dict[str, Any] = field(default_factory=dict)
    # a failure whose cause may pass (out of memory, I/O, a timeout): the broker retries
    transient: bool = False


class UnloadModel(Message, frozen=True):
    KIND: ClassVar[Kind] = Kind.UNLOAD
    model: str
    version: int


class Disconnect(Message, frozen=True):
    """broker -> worker. ``restart``: exit so that the supervisor starts you again."""
    KIND: ClassVar[Kind] = Kind.DISCONNECT
    reason: DisconnectReason
    restart: bool = False
    detail: str = ""


class Leave(Message, frozen=True):
    """worker -> broker: I am leaving; with ``drain``, once my batches are done."""
    KIND: ClassVar[Kind] = Kind.LEAVE
    reason: LeaveReason
    drain: bool = True
    detail: str = ""


class LogSettings(Message, frozen=True):
    """broker -> worker: the logging extension's settings (the keys given change;
    validated by the broker, applied by the worker with zeroserve.broker.logsettings)."""
    KIND: ClassVar[Kind] = Kind.LOG_SETTINGS
    settings: dict[str, Any] = field(default_factory=dict)


class ControlRequest(Message, frozen=True):
    """CLI / gateway -> broker: a control verb. ``token`` is the admin token, needed for
    verbs that change state when the broker has one."""
    KIND: ClassVar[Kind] = Kind.CONTROL
    call_id: str
    verb: str
    args: dict[str, Any] = field(default_factory=dict)
    token: str = ""


class ControlReply(Message, frozen=True):
    KIND: ClassVar[Kind] = Kind.CONTROL_REPLY
    call_id: str
    ok: bool
    result: Any = None
    code: str = ""
    error: str = ""


MESSAGES = (Cancel, Ping, Pong, WorkerReady, WorkerHeartbeat, BrokerHeartbeat, LoadModel,
            ModelLoaded, UnloadModel, Disconnect, Leave, LogSettings, ControlRequest,
            ControlReply, Stop, Waiting, Pause)
