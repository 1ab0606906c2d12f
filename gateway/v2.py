"""KServe v2 (Open Inference Protocol) codec: JSON tensors and Triton's binary tensor
extension, for requests and responses. Pure functions over bytes and numpy."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import orjson

from zeroserve.broker import protocol as p
from zeroserve.broker import wording
from zeroserve.gateway import v2json

HEADER_LENGTH = "inference-header-content-length"
# Below this a document goes through orjson and a Python list: simdjson's fixed cost per
# document (the proxies, the proof that no array hides among the numbers) outweighs what
# it saves per number until about 500 FP32 values (tests/bench/bench_json_decode.py:
# 64 values 2.9 against 8.5 us, 256 values 9.4 against 12.2, 1,024 values 35.7 against
# 26.7, a [1,3,64,64] tensor 500 against 303).
SIMDJSON_FROM_BYTES = 8 << 10


class DecodeError(ValueError):
    """A request body that does not follow the protocol (HTTP 400)."""


# (region, offset, byte_size) -> the bytes, or DecodeError naming the region
ShmReader = Callable[[str, int, int], bytes]
# (region, offset, byte_size, data): data into the region, or DecodeError naming it
ShmWriter = Callable[[str, int, int, memoryview], None]

SHM_REGION = "shared_memory_region"
SHM_OFFSET = "shared_memory_offset"
SHM_SIZE = "shared_memory_byte_size"


@dataclass(frozen=True)
class ShmPlace:
    region: str
    offset: int
    byte_size: int


@dataclass
class RequestedOutput:
    name: str
    binary: bool
    classification: int = 0           # top N as "value:index[:label]", 0 = the tensor
    shm: ShmPlace | None = None       # written into a registered region, not the body


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

    @property
    def classified(self) -> dict[str, int]:
        return {o.name: o.classification for o in self.outputs or () if o.classification}


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
    if isinstance(data, np.ndarray):   # numeric data v2json read straight into numpy
        arr = data
    else:
        try:
            arr = np.asarray(data, dtype=dtype)
        except (ValueError, TypeError, OverflowError) as exc:
            raise DecodeError(f"input {name!r}: data is not {datatype}: {exc}") from None
    if arr.size != count:
        raise DecodeError(f"input {name!r}: {arr.size} elements for shape {list(shape)}")
    if arr.dtype is not dtype or not arr.flags.c_contiguous:
        return p.from_numpy(name, arr.reshape(shape), datatype)
    # what from_numpy makes of it (a flat byte view), without its conversions: the array
    # is the datatype's own and contiguous already (np.asarray made it so); a 1-D
    # memoryview casts to bytes whatever its length (2.2 -> 0.4 us, timed alone)
    row = arr if arr.ndim == 1 else arr.reshape(-1)
    return p.Tensor(p.TensorMeta(name, datatype, shape), row.data.cast("B"))


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


def _count(where: str, key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise DecodeError(f"{where}: {key} must be a non-negative integer, got {value!r}")
    return value


def shm_place(where: str, params: dict[str, Any]) -> ShmPlace:
    region = params[SHM_REGION]
    if not isinstance(region, str) or not region:
        raise DecodeError(f"{where}: {SHM_REGION} must name a registered region")
    if SHM_SIZE not in params:
        raise DecodeError(f"{where}: {SHM_REGION} needs {SHM_SIZE}")
    return ShmPlace(region, _count(where, SHM_OFFSET, params.get(SHM_OFFSET, 0)),
                    _count(where, SHM_SIZE, params[SHM_SIZE]))


def raw_tensor(name: str, datatype: str, shape: tuple[int, ...], raw: Any,
                what: str) -> p.Tensor:
    """A tensor from raw little-endian bytes, checked against its shape and datatype."""
    meta = p.TensorMeta(name, datatype, shape)
    expected = meta.nbytes()
    if expected is not None and expected != len(raw):
        raise DecodeError(f"input {name!r}: {len(raw)} bytes of {what} for shape "
                          f"{list(shape)} {datatype} (expected {expected})")
    if expected is None:
        try:
            p.unpack_bytes_elements(raw, math.prod(shape))
        except p.ProtocolError as exc:
            raise DecodeError(f"input {name!r}: {exc}") from None
    return p.Tensor(meta, raw)


def decode_request(body: bytes, header_length: int | None,
                   shm: ShmReader | None = None) -> V2Request:
    """Parse an infer body. ``header_length`` is Inference-Header-Content-Length;
    ``shm`` reads inputs that name a shared-memory region (None: the extension is off)."""
    return decode_document(*parse_document(body, header_length), shm)


def parse_document(body: bytes, header_length: int | None) -> tuple[dict[str, Any], memoryview]:
    """The JSON document of an infer body (plain Python; numeric tensor data already
    numpy, see v2json) and the binary part after it (a view into the body, no copy);
    the tensors are not built nor checked yet (see decode_document)."""
    if header_length is not None:
        if header_length < 0 or header_length > len(body):
            raise DecodeError(f"Inference-Header-Content-Length {header_length} exceeds the "
                              f"body of {len(body)} bytes")
        json_part, binary = bytes(body[:header_length]), memoryview(body)[header_length:]
    else:
        json_part, binary = bytes(body), memoryview(b"")
    try:
        doc = v2json.loads(json_part) if len(json_part) >= SIMDJSON_FROM_BYTES \
            else orjson.loads(json_part)
    except orjson.JSONDecodeError as exc:
        raise DecodeError(wording.bad_json(exc.msg, exc.pos)) from None
    if not isinstance(doc, dict):
        raise DecodeError("the request must be a JSON object")
    return doc, binary


def parameters_of(doc: dict[str, Any]) -> dict[str, Any]:
    params = doc.get("parameters") or {}
    if not isinstance(params, dict):
        raise DecodeError("'parameters' must be an object")
    return params


def decode_document(doc: dict[str, Any], binary: memoryview,
                    shm: ShmReader | None = None) -> V2Request:
    """The request of a parsed document: numeric JSON data as v2json read it into
    numpy (else one ``np.asarray`` per tensor), binary data as views into the body."""
    inputs = doc.get("inputs")
    if not isinstance(inputs, list):   # an empty one: the broker names what is missing
        raise DecodeError("'inputs' must be a list")
    params = parameters_of(doc)
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
        size = iparams.get("binary_data_size")
        if SHM_REGION in iparams:
            if shm is None:
                raise DecodeError(f"input {name!r} names a shared-memory region, but "
                                  "shared memory is off (gateway --allow-shared-memory)")
            place = shm_place(f"input {name!r}", iparams)
            raw: bytes | memoryview = shm(place.region, place.offset, place.byte_size)
            tensors.append(raw_tensor(name, datatype, shape, raw,
                                       f"shared-memory region {place.region!r}"))
        elif size is not None:
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise DecodeError(f"input {name!r}: bad binary_data_size {size!r}")
            if pos + size > len(binary):
                raise DecodeError(f"input {name!r}: binary_data_size {size} runs past the body")
            raw = binary[pos:pos + size]
            pos += size
            tensors.append(raw_tensor(name, datatype, shape, raw, "binary data"))
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
        outputs = [_requested_output(out, binary_default, shm is not None)
                   for out in doc["outputs"]]
    rid = doc.get("id")
    if rid is not None and not isinstance(rid, str):
        raise DecodeError("'id' must be a string")
    return V2Request(rid, tensors, params, outputs, binary_default)


def _requested_output(out: Any, binary_default: bool, shm_on: bool) -> RequestedOutput:
    if not isinstance(out, dict) or not isinstance(out.get("name"), str):
        raise DecodeError("each of 'outputs' must be an object with a 'name'")
    where = f"output {out['name']!r}"
    oparams = out.get("parameters") or {}
    if not isinstance(oparams, dict):
        raise DecodeError(f"{where}: 'parameters' must be an object")
    classes = _count(where, "classification", oparams.get("classification", 0))
    place = None
    if SHM_REGION in oparams:
        if not shm_on:
            raise DecodeError(f"{where} names a shared-memory region, but shared memory "
                              "is off (gateway --allow-shared-memory)")
        if classes:
            raise DecodeError(f"{where}: a classification cannot go to shared memory")
        place = shm_place(where, oparams)
    return RequestedOutput(out["name"], bool(oparams.get("binary_data", binary_default)),
                           classes, place)


def _json_data(t: p.Tensor) -> Any:
    if t.meta.datatype == "BYTES":
        return [b.decode("utf-8", "replace") for b in
                p.unpack_bytes_elements(t.data)]
    if t.meta.datatype == "BF16":
        raise DecodeError(f"output {t.meta.name!r} is BF16: request it as binary data")
    return p.to_numpy(t).reshape(-1)


def encode_response(model: str, version: int, request_id: str | None,
                    tensors: Sequence[p.Tensor], req: V2Request,
                    shm: ShmWriter | None = None,
                    parameters: dict[str, Any] | None = None) -> tuple[bytes, int | None]:
    """Returns (body, json header length or None when the body is all JSON). Outputs
    placed in shared memory are written through ``shm`` and carry no data.
    ``parameters`` become the response's own (what the server changed, say)."""
    binary_for = {o.name: o.binary for o in req.outputs} if req.outputs is not None else {}
    places = {o.name: o.shm for o in req.outputs or () if o.shm is not None}
    outs, blobs = [], []
    for t in tensors:
        entry: dict[str, Any] = {"name": t.meta.name, "datatype": t.meta.datatype,
                                 "shape": list(t.meta.shape)}
        place = places.get(t.meta.name)
        if place is not None and shm is not None:
            data = memoryview(t.data).cast("B")
            if data.nbytes > place.byte_size:
                raise DecodeError(f"output {t.meta.name!r} is {data.nbytes} bytes, more than "
                                  f"the {place.byte_size} {SHM_SIZE} given for region "
                                  f"{place.region!r}")
            shm(place.region, place.offset, data.nbytes, data)
            entry["parameters"] = {SHM_REGION: place.region, SHM_SIZE: data.nbytes,
                                   **({SHM_OFFSET: place.offset} if place.offset else {})}
        elif binary_for.get(t.meta.name, req.binary_default) or t.meta.datatype == "BF16" and \
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
    if parameters:
        doc["parameters"] = parameters
    head = orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)
    if not blobs:
        return head, None
    return b"".join([head, *blobs]), len(head)
