"""The JSON document of a KServe v2 infer body, with numeric tensor data read straight
into numpy: no Python float or int per element, which for a [1,3,64,64] FP32 tensor was
most of the gateway's time on the request (see tests/bench/bench_json_decode.py).

``loads`` gives what ``orjson.loads`` gives, except that the ``data`` of an object in
``inputs`` whose ``datatype`` is numeric may be an ``np.ndarray``: exactly the array
``np.asarray(data, dtype)`` would have made of the list. Wherever that cannot be proven
cheaply (booleans, strings, nulls, ragged nesting, a value out of the datatype's range,
a big integer, a document simdjson refuses) the value stays what orjson makes of it, so
every error is raised later by the same code with the same message as before.

simdjson's proxies (``Array``, ``Object``) point into the parser's one document: nothing
here returns or keeps one, everything handed out is plain Python or numpy.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import orjson
import simdjson

from zeroserve.broker import protocol as p

# the datatypes read through simdjson's as_buffer: their dtype and the buffer kind
# ('d' double, 'i' int64, 'u' uint64) each is read as
_READ = {name: (p.DTYPES[name], kind) for names, kind in [
    (("FP16", "FP32", "FP64"), "d"), (("INT8", "INT16", "INT32", "INT64"), "i"),
    (("UINT8", "UINT16", "UINT32", "UINT64"), "u")] for name in names}
_BUFFER = {"d": np.float64, "i": np.int64, "u": np.uint64}
# doubles hold every integer below this exactly: past it a float buffer may have
# rounded an integer that np.asarray would have taken as it was
_EXACT = 2.0 ** 53
_BOM = b"\xef\xbb\xbf"   # simdjson skips it, orjson (and so this server before) refuses it
_OPEN = ord("[")
_NUMPY_COUNT = 1 << 14   # from this size numpy counts a byte faster than bytes.count

_PARSER = simdjson.Parser()
_SHARED_PARSER_BYTES = 1 << 20
_PROXIES = (simdjson.Array, simdjson.Object)


def loads(text: bytes) -> Any:
    """The document of ``text`` (see the module's docstring); orjson.JSONDecodeError
    when it is not JSON, with orjson's message."""
    if not text.startswith(_BOM):
        found = _simd_document(text)
        if found is not None:
            return found[0]
    return orjson.loads(text)


def _parse(text: bytes) -> Any:
    if len(text) <= _SHARED_PARSER_BYTES:
        try:
            return _PARSER.parse(text)
        except RuntimeError as exc:
            if "re-use" not in str(exc):
                raise
        # a proxy of the last document is still alive (in a traceback, say):
        # pysimdjson refuses to overwrite it, so this one goes to a parser of its own
    # a parser keeps its buffers (about 3x the largest text it read): a big body gets
    # one of its own, freed with the document's last proxy at the end of the call
    return simdjson.Parser().parse(text)


def _simd_document(text: bytes) -> tuple[Any] | None:
    """(the document,), or None where simdjson refuses ``text`` (orjson decides then:
    it takes integers past 64 bits, say, and words its errors as before)."""
    try:
        root = _parse(text)
    except Exception:  # simdjson's errors: ValueError, RuntimeError, UnicodeDecodeError
        return None
    tally = _Tally()
    if not isinstance(root, simdjson.Object):
        return (tally.plain(root),)
    doc: dict[str, Any] = {}
    fast: list[_Fast] = []
    try:
        for key, value in _members(root):
            if key == "inputs" and isinstance(value, simdjson.Array):
                tally.lists += 1
                doc[key] = [_input(x, tally, fast) for x in value]
            else:
                doc[key] = tally.plain(value)
    except _Unsure:
        return None
    if fast and not tally.proves_regular(text, sum(f.arrays for f in fast)):
        for f in fast:
            f.holder["data"] = f.proxy.as_list()
    return (doc,)


class _Unsure(Exception):
    """An object whose members simdjson's lookup by key may not find as orjson does."""


def _members(obj: Any) -> list[tuple[str, Any]]:
    """(key, value) of a simdjson Object, values as proxies (its items() would convert
    them all to Python). A key twice (orjson keeps the last, the lookup finds the
    first) or with a NUL in it (the lookup stops there) is _Unsure."""
    keys = list(obj)
    if len(set(keys)) != len(keys) or "\x00" in "".join(keys):
        raise _Unsure()
    try:
        return [(k, obj[k]) for k in keys]
    except KeyError:
        raise _Unsure() from None


class _Fast:
    """An input whose data was read into numpy, until the whole text confirms it."""

    def __init__(self, holder: dict[str, Any], proxy: Any, arrays: int) -> None:
        self.holder, self.proxy, self.arrays = holder, proxy, arrays


class _Tally:
    """Counts the arrays of what was converted to plain Python. Every '[' in the text
    opens an array or sits in a string, so when these and the numeric tensors' own
    arrays account for all of them, no array hides among a tensor's numbers (a '[' in
    a string only makes the proof fail: the data then goes the old way)."""

    def __init__(self) -> None:
        self.lists = 0

    def plain(self, value: Any) -> Any:
        if isinstance(value, simdjson.Array):
            value = value.as_list()
        elif isinstance(value, simdjson.Object):
            value = value.as_dict()
        else:
            return value
        stack = [value]
        while stack:
            v = stack.pop()
            if isinstance(v, list):
                self.lists += 1
                stack.extend(x for x in v if isinstance(x, (list, dict)))
            else:
                stack.extend(x for x in v.values() if isinstance(x, (list, dict)))
        return value

    def proves_regular(self, text: bytes, tensor_arrays: int) -> bool:
        if len(text) < _NUMPY_COUNT:
            seen = text.count(b"[")
        else:
            seen = int(np.count_nonzero(np.frombuffer(text, np.uint8) == _OPEN))
        return seen == self.lists + tensor_arrays


def _input(value: Any, tally: _Tally, fast: list[_Fast]) -> Any:
    """One of 'inputs', its numeric data read into numpy where it can be."""
    if not isinstance(value, simdjson.Object):
        return tally.plain(value)
    holder: dict[str, Any] = {}
    data = None
    for key, x in _members(value):
        if key == "data":
            data = x
            holder[key] = None
        else:
            holder[key] = tally.plain(x) if isinstance(x, _PROXIES) else x
    if "data" in holder:
        datatype = holder.get("datatype")
        got = _numbers(data, datatype) if isinstance(data, simdjson.Array) and \
            isinstance(datatype, str) else None
        if got is None:
            holder["data"] = tally.plain(data)
        else:
            holder["data"] = got[0]
            fast.append(_Fast(holder, data, got[1]))
    return holder


def _numbers(data: Any, datatype: str) -> tuple[np.ndarray, int] | None:
    """``np.asarray(data, dtype)`` without Python numbers, and the arrays ``data`` is
    made of; None where this cannot tell it would be the same."""
    read = _READ.get(datatype)
    skeleton = _skeleton(data) if read is not None else None
    if read is None or skeleton is None:
        return None
    (dtype, kind), (dims, arrays) = read, skeleton
    assert dtype is not None
    flat = _buffer(data, kind)
    if flat is None and kind != "d":
        flat = _buffer(data, "d")      # floats given for an integer datatype
    if flat is None or flat.size != math.prod(dims):
        return None
    values = _cast(flat, dtype)
    return None if values is None else (values.reshape(dims), arrays)


def _buffer(data: Any, kind: str) -> np.ndarray | None:
    try:   # a copy out of the parser: it outlives the document
        return np.frombuffer(data.as_buffer(of_type=kind), _BUFFER[kind])
    except (TypeError, ValueError):   # not all numbers of that kind
        return None


def _skeleton(data: Any) -> tuple[tuple[int, ...], int] | None:
    """The dimensions of ``data`` and its count of arrays when every array down to the
    innermost has the length the first one has at its depth; None when ragged. The
    innermost arrays' elements are not looked at (proves_regular covers them)."""
    dims, x = [], data
    while isinstance(x, simdjson.Array):
        dims.append(len(x))
        if not dims[-1]:
            break
        x = x[0]
    level, arrays = [data], 1
    for depth in range(1, len(dims)):
        level = [child for a in level for child in a]
        if not all(isinstance(c, simdjson.Array) and len(c) == dims[depth] for c in level):
            return None
        arrays += len(level)
    return tuple(dims), arrays


def _cast(flat: np.ndarray, dtype: np.dtype) -> np.ndarray | None:
    """``flat`` as ``dtype`` the way np.asarray casts the Python numbers (floats to an
    integer datatype are truncated); None where np.asarray would refuse a value."""
    if dtype.kind == "f":
        with np.errstate(over="ignore"):   # np.asarray makes inf of 1e300 without a word
            return flat if flat.dtype == dtype else flat.astype(dtype)
    if flat.dtype.kind == "f":
        if flat.size and not float(np.abs(flat).max()) < _EXACT:
            return None
        flat = np.trunc(flat)
    if flat.size:
        info = np.iinfo(dtype)
        if flat.min() < info.min or flat.max() > info.max:
            return None
    return flat if flat.dtype == dtype else flat.astype(dtype)
