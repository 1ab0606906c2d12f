"""Tensors on the wire: KServe v2 datatypes, metadata, raw buffers, and BYTES elements.

A tensor travels as its metadata in a message header and its raw bytes as one frame
of its own. Nothing here imports torch: numpy views only (BF16 has no numpy dtype and
is interpreted by workers alone).
"""

from __future__ import annotations

from typing import Annotated, Any, Sequence

import msgspec
import numpy as np


class ProtocolError(ValueError):
    """A message (or a tensor in one) that does not follow the protocol. The one error
    type of the wire format; zeroserve.broker.protocol re-exports it."""


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


MAX_DIM = 2**40   # no tensor dimension is longer (a shape's product stays an int64)


class TensorMeta(msgspec.Struct, frozen=True, array_like=True):
    """``[name, datatype, shape]`` on the wire, decoded and checked in C (each dimension
    an int in [0, MAX_DIM); the datatype's name is checked against DTYPES beside its
    frame, which it sizes)."""

    name: str
    datatype: str
    shape: tuple[Annotated[int, msgspec.Meta(ge=0, lt=MAX_DIM)], ...]

    def nbytes(self) -> int | None:
        """Exact byte size, or None for BYTES (variable length)."""
        if self.datatype == "BYTES":
            return None
        n = ITEM_BYTES[self.datatype]
        for d in self.shape:
            n *= d
        return n


Buffer = Any  # bytes, memoryview, zmq.Frame: anything with the buffer protocol


class Tensor(msgspec.Struct, frozen=True):
    meta: TensorMeta
    data: Buffer



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
    # memoryview.cast refuses shapes with a zero in them; a flat byte view does not
    return Tensor(TensorMeta(name, datatype, tuple(arr.shape)), arr.reshape(-1).view(np.uint8).data)


def datatype_of(dtype: np.dtype[Any]) -> str:
    if dtype == np.object_ or dtype.kind in ("S", "U"):
        return "BYTES"
    native = dtype.newbyteorder("<") if dtype.byteorder == ">" else dtype
    for name, dt in DTYPES.items():
        if dt is not None and dt == native:
            return name
    raise ProtocolError(f"numpy dtype {dtype} has no KServe datatype")
