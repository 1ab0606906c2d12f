"""The grpc transport of ``zeroserve bench``: Triton's ModelInfer over one HTTP/2
channel per load process, any number of calls in flight on it.

The request is encoded once, by hand (a few protobuf fields: model, version,
parameters, the inputs' name, datatype and shape, ``raw_input_contents``), and the
answer is not decoded, as the HTTP senders send prepared bytes and read only the
status: the figures are the server's, not a client library's. This keeps the bench
free of the gateway's generated messages (broker/ never imports gateway/) and of
tritonclient. grpcio is imported when a grpc sender starts, never before a fork.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from zeroserve.broker.bench import inputs as bi

METHOD = "/inference.GRPCInferenceService/ModelInfer"
INT32_MAX = 2**31 - 1


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (strings, bytes, messages, packed repeated)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _uint_param(key: str, value: int, kind: int) -> bytes:
    """One entry of map<string, InferParameter>: InferParameter's int64_param is field
    2, uint64_param field 5 (varints)."""
    param = _varint(kind << 3) + _varint(value)
    return _field(1, key.encode()) + _field(2, param)


def model_infer_request(inputs: dict[str, np.ndarray], opts: bi.RequestOptions) -> bytes:
    """A ModelInferRequest (grpc_service.proto) with every input raw."""
    out = _field(1, opts.model.encode())
    if opts.version is not None:
        out += _field(2, str(opts.version).encode())
    if opts.priority:
        out += _field(4, _uint_param("priority", opts.priority, 5))
    if opts.timeout_ms:
        out += _field(4, _uint_param("timeout", int(opts.timeout_ms * 1000), 2))
    raws = []
    for t in bi.tensors(inputs):
        shape = b"".join(_varint(d) for d in t.meta.shape)
        tensor = _field(1, t.meta.name.encode()) + _field(2, t.meta.datatype.encode()) + \
            _field(3, shape)
        out += _field(5, tensor)
        raws.append(bytes(t.data))
    return out + b"".join(_field(7, raw) for raw in raws)


class GrpcSender:
    def __init__(self, plan: Any) -> None:
        self.target = plan.grpc_url
        self.timeout_s = plan.client_timeout_s
        self.body = model_infer_request(plan.inputs, plan.options)
        self._channel: Any = None
        self._call: Any = None

    async def start(self) -> None:
        import grpc.aio
        self._channel = grpc.aio.insecure_channel(
            self.target, options=[("grpc.max_receive_message_length", INT32_MAX),
                                  ("grpc.max_send_message_length", INT32_MAX)])
        self._call = self._channel.unary_unary(METHOD)   # bytes in, bytes out

    async def prepare(self, streams: int) -> None:
        import asyncio
        try:
            await asyncio.wait_for(self._channel.channel_ready(), 5)
        except asyncio.TimeoutError:
            raise ConnectionError(f"no gRPC server at {self.target}") from None

    async def call(self) -> tuple[str | None, dict[str, float] | None]:
        import grpc
        try:
            await self._call(self.body, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code is grpc.StatusCode.DEADLINE_EXCEEDED:
                return "client_timeout", None
            return code.name, None
        return None, None

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

