"""The zeroserve wire protocol: the one place that builds and parses frames.

A message is a multipart ZeroMQ message::

    [kind (1 byte)] [header (msgpack map)] [tensor buffer] ...

ROUTER sockets prepend the peer's identity; callers strip it before decoding.
The header always carries ``v`` (the protocol version). Tensors never pass
through msgpack: a header lists ``[name, datatype, shape]`` triples and each
tensor's raw bytes follow as their own frame, in the same order.

Every message kind has a type in :mod:`.messages`. Inference messages (request,
reply, error, batch, result) carry tensors and have their own codecs; the others
are declared with a field schema and go through :func:`encode` / :func:`decode`,
which validate every field's type and never ``assert``.

Time on the wire is a remaining budget (``timeout_ms``) computed when a message
is sent, so processes on different hosts need no shared clock.

Nothing here imports torch: the broker and gateway use it too.

The package's rooms: :mod:`.messages` (the kinds, versions and message types),
:mod:`.envelope` (kind frame, version and the receiver's limits; bundles),
:mod:`.typed` (a header converted to its wire shape, checked in C; the messages without
tensors) and :mod:`.codec` (the inference messages' encoders and decoders). Everyone
imports this package (``from zeroserve.broker import protocol as p``); the names below
are its public face.
"""

from __future__ import annotations

from zeroserve.broker.protocol.codec import (
    MAX_DURATION_MS, decode_batch, decode_error, decode_part, decode_partial,
    decode_parts, decode_replies, decode_reply, decode_request, decode_result, decode_steps,
    encode_batch, encode_error, encode_partial, encode_parts, encode_replies,
    encode_reply, encode_reply_parts, encode_request, encode_requests, encode_result,
    encode_steps, part_header, reply_header, reply_part, request_header, result_batch_id,
    steps_batch_ids)
from zeroserve.broker.protocol.envelope import (
    TRUSTED, Limits, Refused, VersionMismatch, bundle, ids_of, peek_kind, request_id_of,
    unbundle, unpack)
from zeroserve.broker.protocol.messages import (
    MAX_BUNDLE, MESSAGES, PAUSE_VERSION, PROTOCOL_VERSION, STEPS_VERSION, SUPPORTED_VERSIONS,
    WAITING_VERSION, Batch, BatchItem, BatchResult, BatchTrace, BrokerHeartbeat, Caller, Cancel,
    ControlReply, ControlRequest, Disconnect, DisconnectReason, ErrorCode, ErrorReply, InferReply,
    InferRequest, Kind, Leave, LeaveReason, LoadModel, LogSettings, ModelLoaded, Partial,
    PartialItem, Pause, Ping, Pong, StreamPart, Stop, UnloadModel, Waiting, WorkerHeartbeat,
    WorkerReady)
from zeroserve.broker.protocol.typed import decode, encode
from zeroserve.broker.tensors import (DTYPES, ITEM_BYTES, Buffer, ProtocolError, Tensor,
                                      TensorMeta, datatype_of, from_numpy,
                                      pack_bytes_elements, to_numpy, unpack_bytes_elements)

__all__ = [
    "DTYPES", "ITEM_BYTES", "MAX_BUNDLE", "MAX_DURATION_MS", "MESSAGES", "PAUSE_VERSION",
    "PROTOCOL_VERSION", "STEPS_VERSION", "SUPPORTED_VERSIONS", "TRUSTED", "WAITING_VERSION",
    "Batch", "BatchItem",
    "BatchResult", "BatchTrace", "BrokerHeartbeat", "Buffer", "Caller", "Cancel",
    "ControlReply", "ControlRequest", "Disconnect", "DisconnectReason", "ErrorCode",
    "ErrorReply", "InferReply", "InferRequest", "Kind", "Leave", "LeaveReason", "Limits",
    "LoadModel", "LogSettings", "ModelLoaded", "Partial", "PartialItem", "Pause", "Ping",
    "Pong",
    "ProtocolError", "Refused", "StreamPart", "Stop", "Tensor", "TensorMeta", "UnloadModel",
    "VersionMismatch", "Waiting", "WorkerHeartbeat", "WorkerReady", "bundle", "datatype_of",
    "decode", "decode_batch", "decode_error", "decode_part", "decode_partial", "decode_parts",
    "decode_replies", "decode_reply", "decode_request", "decode_result", "decode_steps",
    "encode", "encode_batch", "encode_error", "encode_partial", "encode_parts",
    "encode_replies", "encode_reply", "encode_reply_parts", "encode_request",
    "encode_requests", "encode_result", "encode_steps", "from_numpy", "ids_of",
    "pack_bytes_elements", "part_header", "peek_kind", "reply_header", "reply_part",
    "request_header", "request_id_of", "result_batch_id", "steps_batch_ids", "to_numpy",
    "unbundle", "unpack", "unpack_bytes_elements"]
