"""KServe v2 (Open Inference Protocol) codec: JSON tensors and Triton's binary tensor
extension, for requests and responses. Pure functions over bytes and numpy."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import orjson

from zeroserve.broker import protocol as p

HEADER_LENGTH = "inference-header-content-length"


class DecodeError(ValueError):
    """A request body that does not follow the protocol (HTTP 400)."""


@dataclass
class RequestedOutput:
    name: str
    binary: bool


@dataclass
class V2Request:
    id: str | None
    tensors: list[p.Tensor]
    parameters: dict[str, Any] = field(default_factory=dict)
    outputs: list[RequestedOutput] | None = None
    binary_default: bool = False

    @property
    def output_names(self) -> list[str] | None:
        return [o.name for o in self.outputs] if self.outputs is not None else None


def _shape(raw: Any, where: str) -> tuple[int, ...]:
    if not isinstance(raw, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in raw):
        raise DecodeError(f"{where}: 'shape' must be a list of non-negative integers")
    return tuple(raw)


def _json_tensor(name: str, datatype: str, shape: tuple[int, ...], data: Any) -> p.Tensor:
    count = math.prod(shape)
    if datatype == "BF16":
        raise DecodeError(f"input {name!r}: BF16 data must use the binary tensor extension")
    if datatype == "BYTES":
        flat = _flatten(data)
        if len(flat) != count:
            raise DecodeError(f"input {name!r}: {len(flat)} elements for shape {list(shape)}")
        items = []
        for x in flat:
            if not isinstance(x, str):
                raise DecodeError(f"input {name!r}: BYTES data must be strings")
            items.append(x.encode())
        return p.Tensor(p.TensorMeta(name, "BYTES", shape), p.pack_bytes_elements(items))
    dtype = p.DTYPES[datatype]
    try:
        arr = np.asarray(data, dtype=dtype)
    except (ValueError, TypeError, OverflowError) as exc:
        raise DecodeError(f"input {name!r}: data is not {datatype}: {exc}") from None
    if arr.size != count:
        raise DecodeError(f"input {name!r}: {arr.size} elements for shape {list(shape)}")
    return p.from_numpy(name, arr.reshape(shape), datatype)


def _flatten(data: Any) -> list[Any]:
    if not isinstance(data, list):
        return [data]
    out: list[Any] = []
    stack = [iter(data)]
    while stack:
        for x in stack[-1]:
            if isinstance(x, list):
                stack.append(iter(x))
                break
            out.append(x)
        else:
            stack.pop()
    return out


def decode_request(body: bytes, header_length: int | None) -> V2Request:
    """Parse an infer body. ``header_length`` is Inference-Header-Content-Length."""
    if header_length is not None:
        if header_length < 0 or header_length > len(body):
            raise DecodeError(f"Inference-Header-Content-Length {header_length} exceeds the "
                              f"body of {len(body)} bytes")
        json_part, binary = memoryview(body)[:header_length], memoryview(body)[header_length:]
    else:
        json_part, binary = memoryview(body), memoryview(b"")
    try:
        doc = orjson.loads(json_part)
    except orjson.JSONDecodeError as exc:
        raise DecodeError(f"malformed JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise DecodeError("the request must be a JSON object")
    inputs = doc.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise DecodeError("'inputs' must be a non-empty list")
    params = doc.get("parameters") or {}
    if not isinstance(params, dict):
        raise DecodeError("'parameters' must be an object")
    tensors, pos = [], 0
    for i, inp in enumerate(inputs):
        where = f"inputs[{i}]"
        if not isinstance(inp, dict):
            raise DecodeError(f"{where} must be an object")
        name, datatype = inp.get("name"), inp.get("datatype")
        if not isinstance(name, str) or not name:
            raise DecodeError(f"{where}: 'name' must be a non-empty string")
        if not isinstance(datatype, str) or datatype not in p.DTYPES:
            raise DecodeError(f"input {name!r}: unknown datatype {datatype!r}")
        shape = _shape(inp.get("shape"), f"input {name!r}")
        iparams = inp.get("parameters") or {}
        if not isinstance(iparams, dict):
            raise DecodeError(f"input {name!r}: 'parameters' must be an object")
        if "shared_memory_region" in iparams:
            raise DecodeError("shared memory is not supported")
        size = iparams.get("binary_data_size")
        if size is not None:
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise DecodeError(f"input {name!r}: bad binary_data_size {size!r}")
            if pos + size > len(binary):
                raise DecodeError(f"input {name!r}: binary_data_size {size} runs past the body")
            raw = binary[pos:pos + size]
            pos += size
            meta = p.TensorMeta(name, datatype, shape)
            expected = meta.nbytes()
            if expected is not None and expected != size:
                raise DecodeError(f"input {name!r}: {size} bytes for shape {list(shape)} "
                                  f"{datatype} (expected {expected})")
            if expected is None:
                try:
                    p.unpack_bytes_elements(raw, math.prod(shape))
                except p.ProtocolError as exc:
                    raise DecodeError(f"input {name!r}: {exc}") from None
            tensors.append(p.Tensor(meta, raw))
        else:
            if "data" not in inp:
                raise DecodeError(f"input {name!r}: no 'data' and no binary_data_size")
            tensors.append(_json_tensor(name, datatype, shape, inp["data"]))
    if pos != len(binary):
        raise DecodeError(f"{len(binary) - pos} bytes of binary data are not claimed by any input")
    binary_default = bool(params.get("binary_data_output", False))
    outputs = None
    if doc.get("outputs") is not None:
        if not isinstance(doc["outputs"], list):
            raise DecodeError("'outputs' must be a list")
        outputs = []
        for out in doc["outputs"]:
            if not isinstance(out, dict) or not isinstance(out.get("name"), str):
                raise DecodeError("each of 'outputs' must be an object with a 'name'")
            oparams = out.get("parameters") or {}
            if not isinstance(oparams, dict):
                raise DecodeError(f"output {out['name']!r}: 'parameters' must be an object")
            if oparams.get("class_count"):
                raise DecodeError("classification outputs are not supported")
            if "shared_memory_region" in oparams:
                raise DecodeError("shared memory is not supported")
            outputs.append(RequestedOutput(out["name"],
                                           bool(oparams.get("binary_data", binary_default))))
    rid = doc.get("id")
    if rid is not None and not isinstance(rid, str):
        raise DecodeError("'id' must be a string")
    return V2Request(rid, tensors, params, outputs, binary_default)


def _json_data(t: p.Tensor) -> Any:
    if t.meta.datatype == "BYTES":
        return [b.decode("utf-8", "replace") for b in
                p.unpack_bytes_elements(t.data)]
    if t.meta.datatype == "BF16":
        raise DecodeError(f"output {t.meta.name!r} is BF16: request it as binary data")
    return p.to_numpy(t).reshape(-1)


def encode_response(model: str, version: int, request_id: str | None,
                    tensors: Sequence[p.Tensor], req: V2Request) -> tuple[bytes, int | None]:
    """Returns (body, json header length or None when the body is all JSON)."""
    binary_for = {o.name: o.binary for o in req.outputs} if req.outputs is not None else {}
    outs, blobs = [], []
    for t in tensors:
        entry: dict[str, Any] = {"name": t.meta.name, "datatype": t.meta.datatype,
                                 "shape": list(t.meta.shape)}
        if binary_for.get(t.meta.name, req.binary_default) or t.meta.datatype == "BF16" and \
                t.meta.name not in binary_for:
            raw = bytes(t.data)
            entry["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        else:
            entry["data"] = _json_data(t)
        outs.append(entry)
    doc: dict[str, Any] = {"model_name": model, "model_version": str(version), "outputs": outs}
    if request_id is not None:
        doc["id"] = request_id
    head = orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)
    if not blobs:
        return head, None
    return b"".join([head, *blobs]), len(head)
