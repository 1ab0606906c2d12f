"""ModelInferRequest and ModelInferResponse, to and from the broker's tensors.

Inputs come as ``raw_input_contents`` (little-endian bytes, one entry per input that
is not in shared memory, in input order; BYTES as 4-byte lengths and bytes, as on the
wire) or as typed ``contents``, never both in one request (Triton's rule and wording).
Outputs go out in ``raw_output_contents``, one entry per output in the order of the
response's outputs, empty for an output written to shared memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from zeroserve.broker import protocol as p
from zeroserve.gateway import v2
from zeroserve.gateway.errors import BadRequest
from zeroserve.gateway.http import parse_version
from zeroserve.models.proto import grpc_service_pb2 as pb

# the typed field of InferTensorContents per datatype (FP16 and BF16 have none)
CONTENTS = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents",
            "INT32": "int_contents", "INT64": "int64_contents", "UINT8": "uint_contents",
            "UINT16": "uint_contents", "UINT32": "uint_contents",
            "UINT64": "uint64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents",
            "BYTES": "bytes_contents"}
MAX_INT = 2**53   # priority and timeout: what the wire's numbers carry exactly


def value(param: Any) -> Any:
    """The one value an InferParameter holds (None when unset)."""
    kind = param.WhichOneof("parameter_choice")
    return None if kind is None else getattr(param, kind)


def parameters(params: Any) -> dict[str, Any]:
    return {key: value(param) for key, param in params.items()}


@dataclass
class GrpcRequest:
    """What the broker needs of a ModelInferRequest, and what its answer needs."""

    model: str
    version: int | None
    id: str
    tensors: list[p.Tensor]
    priority: int = 0
    timeout_us: int = 0
    outputs: list[v2.RequestedOutput] | None = None
    parameters: dict[str, Any] = field(default_factory=dict)

    @property
    def output_names(self) -> list[str] | None:
        return [o.name for o in self.outputs] if self.outputs is not None else None

    @property
    def classified(self) -> dict[str, int]:
        return {o.name: o.classification for o in self.outputs or () if o.classification}


def _count(params: dict[str, Any], name: str) -> int:
    got = params.get(name, 0)
    if got is None:
        return 0
    if isinstance(got, bool) or not isinstance(got, int) or got < 0:
        raise BadRequest(f"invalid value type for '{name}' parameter, expected "
                         "int64_param or uint64_param.")
    return min(got, MAX_INT)


def decode(req: Any, shm: v2.ShmReader | None) -> GrpcRequest:
    """A ModelInferRequest as the broker's tensors; BadRequest (or v2.DecodeError) with
    Triton's wording where Triton has one."""
    params = parameters(req.parameters) if len(req.parameters) else {}
    if params.get("sequence_id"):
        raise BadRequest("sequence batching is not supported")
    priority, timeout_us = _count(params, "priority"), _count(params, "timeout")
    raw = req.raw_input_contents
    tensors, index = [], 0
    for inp in req.inputs:
        # each field read once (a protobuf attribute is a call), the error's wording
        # built only for an error: 6.0 -> 4.1 us a one-input request (mlp), timed alone
        name, datatype, shape = inp.name, inp.datatype, tuple(inp.shape)
        if datatype not in p.DTYPES:
            raise BadRequest(f"{_where(name, req)}: unknown datatype '{datatype}'")
        if shape and min(shape) < 0:
            raise BadRequest(f"{_where(name, req)}: the shape {list(shape)} has a negative "
                             "dimension")
        iparams = parameters(inp.parameters) if len(inp.parameters) else {}
        has_contents = inp.HasField("contents")
        if v2.SHM_REGION in iparams:
            if has_contents:
                raise BadRequest(f"unexpected 'content' provided when using shared memory "
                                 f"for {_where(name, req)}")
            tensors.append(_from_shm(name, datatype, shape, iparams, shm))
        elif has_contents:
            if raw:
                raise BadRequest("contents field must not be specified when using "
                                 f"raw_input_contents for '{name}' for model "
                                 f"'{req.model_name}'")
            tensors.append(_from_contents(inp, shape, _where(name, req)))
        elif index < len(raw):
            tensors.append(v2.raw_tensor(name, datatype, shape, raw[index],
                                         "raw_input_contents"))
            index += 1
        else:
            raise BadRequest(f"unable to find data for {_where(name, req)} in request.")
    if not tensors:
        raise BadRequest(f"no inputs in the request for model '{req.model_name}'")
    if index != len(raw):
        raise BadRequest(f"{len(raw) - index} raw_input_contents entries are not claimed "
                         f"by any input of the request for model '{req.model_name}'")
    outputs = [_requested(out, shm is not None) for out in req.outputs] \
        if len(req.outputs) else None
    return GrpcRequest(req.model_name, parse_version(req.model_version or None), req.id,
                       tensors, priority, timeout_us, outputs, params)


def _where(name: str, req: Any) -> str:
    return f"input tensor '{name}' for model '{req.model_name}'"


def _from_shm(name: str, datatype: str, shape: tuple[int, ...], params: dict[str, Any],
              shm: v2.ShmReader | None) -> p.Tensor:
    if shm is None:
        raise BadRequest(f"input {name!r} names a shared-memory region, but shared memory "
                         "is off (gateway --allow-shared-memory)")
    place = v2.shm_place(f"input {name!r}", params)
    return v2.raw_tensor(name, datatype, shape, shm(place.region, place.offset,
                                                    place.byte_size),
                         f"shared-memory region {place.region!r}")


def _from_contents(inp: Any, shape: tuple[int, ...], where: str) -> p.Tensor:
    fieldname = CONTENTS.get(inp.datatype)
    if fieldname is None:
        raise BadRequest(f"{where}: {inp.datatype} data must come in raw_input_contents")
    for other in CONTENTS.values():
        if other != fieldname and len(getattr(inp.contents, other)):
            raise BadRequest(f"unexpected explicit tensor data for {where} of type "
                             f"'{other.removesuffix('_contents').upper()}', expected "
                             f"datatype '{inp.datatype}'")
    data = getattr(inp.contents, fieldname)
    count = math.prod(shape)
    if len(data) != count:
        raise BadRequest(f"{where}: {len(data)} elements in contents for shape "
                         f"{list(shape)}")
    if inp.datatype == "BYTES":
        return p.Tensor(p.TensorMeta(inp.name, "BYTES", shape),
                        p.pack_bytes_elements(list(data)))
    try:
        arr = np.array(data, dtype=p.DTYPES[inp.datatype])
    except OverflowError as exc:
        raise BadRequest(f"{where}: a value does not fit {inp.datatype}: {exc}") from None
    return p.from_numpy(inp.name, arr.reshape(shape), inp.datatype)


def _requested(out: Any, shm_on: bool) -> v2.RequestedOutput:
    params = parameters(out.parameters)
    where = f"output {out.name!r}"
    classes = params.get("classification", 0) or 0
    if isinstance(classes, bool) or not isinstance(classes, int) or classes < 0:
        raise BadRequest(f"{where}: classification must be a non-negative integer")
    place = None
    if v2.SHM_REGION in params:
        if not shm_on:
            raise BadRequest(f"{where} names a shared-memory region, but shared memory "
                             "is off (gateway --allow-shared-memory)")
        if classes:
            raise BadRequest(f"{where}: a classification cannot go to shared memory")
        place = v2.shm_place(where, params)
    return v2.RequestedOutput(out.name, True, classes, place)


ShmWriter = Callable[[str, int, int, memoryview], None]


def encode(model: str, version: int, req: GrpcRequest, tensors: Sequence[p.Tensor],
           shm: ShmWriter | None, extra: dict[str, Any] | None = None) -> Any:
    """The ModelInferResponse of the broker's answer."""
    resp = pb.ModelInferResponse(model_name=model, model_version=str(version), id=req.id)
    places = {o.name: o.shm for o in req.outputs or () if o.shm is not None}
    for t in tensors:
        out = resp.outputs.add(name=t.meta.name, datatype=t.meta.datatype,
                               shape=t.meta.shape)
        place = places.get(t.meta.name)
        data = memoryview(t.data).cast("B")
        if place is not None and shm is not None:
            if data.nbytes > place.byte_size:
                raise BadRequest(f"shared memory size specified with the request for output "
                                 f"'{t.meta.name}' ({place.byte_size} bytes) should be at "
                                 f"least {data.nbytes} bytes to hold the results")
            shm(place.region, place.offset, data.nbytes, data)
            out.parameters[v2.SHM_REGION].string_param = place.region
            out.parameters[v2.SHM_SIZE].int64_param = data.nbytes
            if place.offset:
                out.parameters[v2.SHM_OFFSET].int64_param = place.offset
            resp.raw_output_contents.append(b"")
        else:
            resp.raw_output_contents.append(bytes(data))
    for key, val in (extra or {}).items():
        set_parameter(resp.parameters[key], val)
    return resp


def set_parameter(param: Any, val: Any) -> None:
    if isinstance(val, bool):
        param.bool_param = val
    elif isinstance(val, int):
        param.int64_param = val
    elif isinstance(val, float):
        param.double_param = val
    else:
        param.string_param = str(val)
