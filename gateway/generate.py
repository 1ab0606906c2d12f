"""Triton's generate extension (``/generate``, ``/generate_stream``): its JSON to tensors
and back. Pure functions over JSON documents and the model's metadata.

A request is a JSON object whose members that name one of the model's inputs are that
input's data (a member of ``parameters`` may name one too); ``parameters`` carries
``priority`` and ``timeout`` (µs) as infer's do, and every other member is a
parameter for the model, which zeroserve's handlers do not receive (ignored). A scalar
fills an input declared with one element per sample (``[1]``), a list fills a longer
one; the batch dimension (a model with ``max_batch_size`` > 0) is added as 1.

A response is ``{"model_name", "model_version", <output>: value, ...}``: an output of
one element is that value (a string for BYTES), a longer one a flat list.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson

from zeroserve.broker import protocol as p
from zeroserve.gateway.v2 import DecodeError

RESERVED = ("parameters",)


def _value(name: str, datatype: str, raw: Any) -> np.ndarray:
    if datatype == "BYTES":
        items = raw if isinstance(raw, list) else [raw]
        if not all(isinstance(x, str) for x in _flat(items)):
            raise DecodeError(f"input {name!r}: BYTES data must be strings")
        return np.array(_encode_strings(items), dtype=object)
    if datatype == "BF16":
        raise DecodeError(f"input {name!r}: BF16 data cannot be given as JSON")
    try:
        arr = np.asarray(raw, dtype=p.DTYPES[datatype])
    except (ValueError, TypeError, OverflowError) as exc:
        raise DecodeError(f"input {name!r}: data is not {datatype}: {exc}") from None
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        raise DecodeError(f"input {name!r}: data must be finite numbers")
    return arr


def _flat(items: list[Any]) -> list[Any]:
    out: list[Any] = []
    for x in items:
        out.extend(_flat(x) if isinstance(x, list) else [x])
    return out


def _encode_strings(items: Any) -> Any:
    if isinstance(items, list):
        return [_encode_strings(x) for x in items]
    return items.encode()


def _shaped(name: str, arr: np.ndarray, declared: list[int]) -> np.ndarray:
    """The value in the declared shape where it fits one (a scalar into ``[1]``, a flat
    list into ``[-1]`` or ``[n]``); else as given (the broker names what is wrong)."""
    if arr.ndim == len(declared):
        return arr
    try:
        return arr.reshape(declared)   # one free dim (-1) at most: more raise ValueError
    except ValueError:
        return arr


def request_tensors(doc: Any, meta: dict[str, Any]) -> tuple[list[p.Tensor], dict[str, Any]]:
    """The input tensors of a generate request and its ``parameters``."""
    if not isinstance(doc, dict):
        raise DecodeError("the request must be a JSON object")
    params = doc.get("parameters") or {}
    if not isinstance(params, dict):
        raise DecodeError("'parameters' must be an object")
    batched = int(meta.get("max_batch_size") or 0) > 0
    tensors = []
    for spec in meta.get("inputs", []):
        name = spec["name"]
        if name in doc and name not in RESERVED:
            raw = doc[name]
        elif name in params:
            raw = params[name]
        else:
            continue   # missing: the broker names it, as infer does
        declared = list(spec["shape"][1:] if batched else spec["shape"])
        arr = _shaped(name, _value(name, spec["datatype"], raw), declared)
        if batched:
            arr = arr[np.newaxis, ...]
        tensors.append(p.from_numpy(name, arr, spec["datatype"]))
    return tensors, params


def _json_value(t: p.Tensor) -> Any:
    if t.meta.datatype == "BYTES":
        values: list[Any] = [b.decode("utf-8", "replace")
                             for b in p.unpack_bytes_elements(t.data)]
    elif t.meta.datatype == "BF16":
        raise DecodeError(f"output {t.meta.name!r} is BF16, which JSON cannot carry")
    else:
        values = p.to_numpy(t).reshape(-1).tolist()
    return values[0] if len(values) == 1 else values


def response_body(model: str, version: int, tensors: list[p.Tensor]) -> bytes:
    doc: dict[str, Any] = {"model_name": model, "model_version": str(version)}
    for t in tensors:
        doc[t.meta.name] = _json_value(t)
    return orjson.dumps(doc)


def event(body: bytes) -> bytes:
    """One Server-Sent Event holding a JSON document."""
    return b"data: " + body + b"\n\n"
