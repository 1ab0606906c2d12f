r"""Typed decoding: a received header map converted to its wire shape, a
``msgspec.Struct`` whose fields msgspec checks in C (types, bounds, enums), and a
failure named by the field it found (``tensors[0].shape``); tensor metadata paired with
its frames; and the messages without tensors, whose type is their own wire shape."""

from __future__ import annotations

import functools
import re
import types
import typing
from typing import Annotated, Any, Sequence, TypeVar

import msgspec

from zeroserve.broker.protocol.envelope import enc_hook, pack
from zeroserve.broker.protocol.messages import Message
from zeroserve.broker.tensors import DTYPES, ITEM_BYTES, Buffer, ProtocolError, Tensor, TensorMeta

S = TypeVar("S")
_ID = {"request_id": "id", "batch_id": "id"}   # as Message names them


# ---------------------------------------------------------------------------
# typed decoding: a header map to its wire shape, checked in C

def convert(header: Any, shape: type[S], what: str) -> S:
    """``header`` as ``shape``, every field checked, or ProtocolError naming the field."""
    try:
        return msgspec.convert(header, shape)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"{what}: {_reason(shape, exc)}"[:300]) from None


def _reason(shape: type, exc: msgspec.ValidationError) -> str:
    """msgspec's reason, its ``$.tensors[0][2]`` path named as ``tensors[0].shape``, a
    bound on a float said as the finite range it is."""
    whole = str(exc)
    text, sep, path = whole.rpartition(" - at `$")
    if not sep:
        return whole[:1].lower() + whole[1:]
    try:
        name, typ = _path(shape, path.rstrip("`"))
    except (ValueError, TypeError, NameError, AttributeError):   # a path it cannot walk
        name, typ = path.rstrip("`").lstrip("."), Any
    bounds = [m for m in typing.get_args(typ)[1:] if isinstance(m, msgspec.Meta)]
    if bounds and text.startswith("Expected `float` ") and ", got" not in text:
        low, high = bounds[0].ge, bounds[0].le
        return f"field {name!r} must be a finite number " + (
            f">= {low:g}" if high is None or high > 1e300 else f"in [{low:g}, {high:g}]")
    return f"field {name!r}: {text[:1].lower()}{text[1:]}"


_TOKENS = re.compile(r"\[(?:\d+|\.\.\.)\]|(?<=\.)\w+")   # [0], [...] (a map's value), .name


def _path(shape: Any, path: str) -> tuple[str, Any]:
    """A msgspec error path as the fields it names, and the type found there."""
    out = ""
    for token in _TOKENS.findall(path):
        shape = _unwrap(shape)
        if token.startswith("["):
            fields = getattr(shape, "__struct_fields__", None)
            if fields is not None and shape.__struct_config__.array_like \
                    and int(token[1:-1]) < len(fields):
                name = fields[int(token[1:-1])]
                out += f".{name}" if out else name
                shape = _hints(shape).get(name, Any)
            else:   # an item of a list, or a map's value ([...])
                out += token
                args = typing.get_args(shape)   # list[X], tuple[X, ...], dict[K, X]
                shape = (args[0] if typing.get_origin(shape) is tuple else args[-1]) \
                    if args else Any
        else:
            names = getattr(shape, "__struct_encode_fields__", ())
            name = shape.__struct_fields__[names.index(token)] if token in names else token
            out += f".{token}" if out else token
            shape = _hints(shape).get(name, Any) if names else Any
    return out, shape


def _unwrap(shape: Any) -> Any:
    """The type inside ``Annotated[...]`` and ``X | None``."""
    while True:
        if typing.get_origin(shape) is Annotated:
            shape = typing.get_args(shape)[0]
            continue
        args = [a for a in typing.get_args(shape) if a is not type(None)]
        if typing.get_origin(shape) in (typing.Union, types.UnionType) and len(args) == 1:
            shape = args[0]
            continue
        return shape


@functools.lru_cache(maxsize=None)
def _hints(shape: type) -> dict[str, Any]:
    return typing.get_type_hints(shape, include_extras=True)


# ---------------------------------------------------------------------------
# messages without tensors: the message type is its own wire shape

def encode(msg: Message) -> list[Buffer]:
    """Frames of a message without tensors (everything but the inference messages)."""
    header = msgspec.to_builtins(msg, builtin_types=(bytes, bytearray, memoryview),
                                 enc_hook=enc_hook)
    return pack(msg.KIND, header)


def decode(cls: type[S], header: dict[str, Any]) -> S:
    """A message without tensors from its header; ProtocolError names a bad field."""
    return convert(header, cls, cls.__name__)


# ---------------------------------------------------------------------------
# tensors: metadata in the header, each tensor's bytes a frame of its own

def tensors_of(metas: Sequence[TensorMeta], frames: Sequence[Buffer]) -> list[Tensor]:
    """Each tensor's metadata (already checked in C) with its frame, whose size its
    datatype and shape fix (BYTES excepted)."""
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
        elif meta.datatype not in DTYPES:
            raise ProtocolError(f"tensor {meta.name!r}: unknown datatype "
                                f"{meta.datatype!r}"[:200])
        tensors.append(Tensor(meta, buf))
    return tensors


_PLAIN = (bytes, memoryview, bytearray)


# ---------------------------------------------------------------------------
# inference messages' wire shapes

class Wire(msgspec.Struct, frozen=True, rename=_ID):
    """A header's shape as it arrives: the fields a decoder checks."""
