"""The simple JSON codec of the seed and TorchServe routes. Pure functions over the
parsed body and the model's metadata; datatypes come from the model, not the body.

Seed route body: ``{"inputs": {"input": [[...]]}, "outputs": ["output"], "id": "r1"}``
(``outputs`` and ``id`` optional). TorchServe route body: the tensor itself (a nested
list, for a model with one input), or ``{"input_name": [...], ...}``, or TorchServe's
envelope ``{"data": [...]}`` / ``{"body": [...]}``.

With ``max_batch_size`` > 0, a value whose rank equals the declared sample rank is one
sample: the batch dimension is added on the way in and removed on the way out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from zeroserve.broker import protocol as p


class SimpleError(ValueError):
    """A body that does not fit the model (HTTP 400)."""


@dataclass(frozen=True)
class ModelInfo:
    """What the codec needs of a model's metadata (the broker's ``metadata`` verb)."""

    inputs: dict[str, tuple[str, int]]   # name -> (datatype, rank including batch dim)
    outputs: list[str]
    batched: bool                        # max_batch_size > 0

    @classmethod
    def from_metadata(cls, meta: dict[str, Any]) -> "ModelInfo":
        return cls({t["name"]: (t["datatype"], len(t["shape"])) for t in meta["inputs"]},
                   [t["name"] for t in meta["outputs"]], int(meta.get("max_batch_size", 0)) > 0)


def _bf16_words(arr: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, rounded to nearest even (numpy has no bf16)."""
    bits = np.ascontiguousarray(arr, dtype="<f4").view("<u4")
    words: np.ndarray = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")
    return words


def to_tensor(name: str, datatype: str, value: Any) -> p.Tensor:
    try:
        if datatype == "BYTES":
            arr = np.asarray(value, dtype=object)
            flat = arr.reshape(-1)
            if not all(isinstance(x, str) for x in flat):
                raise SimpleError(f"input {name!r}: BYTES values must be strings")
            return p.Tensor(p.TensorMeta(name, "BYTES", tuple(arr.shape)),
                            p.pack_bytes_elements([x.encode() for x in flat]))
        if datatype == "BF16":
            words = _bf16_words(np.asarray(value, dtype=np.float32))
            return p.Tensor(p.TensorMeta(name, "BF16", tuple(words.shape)),
                            words.data.cast("B"))
        return p.from_numpy(name, np.asarray(value, dtype=p.DTYPES[datatype]), datatype)
    except SimpleError:
        raise
    except (ValueError, TypeError, OverflowError) as exc:
        raise SimpleError(f"input {name!r}: not a {datatype} tensor: {exc}") from None


def decode_inputs(values: Any, info: ModelInfo) -> tuple[list[p.Tensor], bool]:
    """{input name: value} -> tensors, and whether the values were single samples."""
    if not isinstance(values, dict) or not values:
        raise SimpleError("'inputs' must be an object of input name to value")
    tensors, single = [], None
    for name, value in values.items():
        if name not in info.inputs:
            raise SimpleError(f"unexpected input {name!r} (the model takes "
                              f"{', '.join(sorted(info.inputs))})")
        datatype, rank = info.inputs[name]
        t = to_tensor(name, datatype, value)
        one = info.batched and len(t.meta.shape) == rank - 1
        if single is not None and one != single:
            raise SimpleError("give every input with a batch dimension, or none")
        single = one
        if one:
            t = p.Tensor(p.TensorMeta(name, datatype, (1, *t.meta.shape)), t.data)
        tensors.append(t)
    return tensors, bool(single)


def to_json(t: p.Tensor, single: bool) -> Any:
    dt = t.meta.datatype
    if dt == "BYTES":
        arr = np.array([b.decode("utf-8", "replace") for b in p.unpack_bytes_elements(t.data)],
                       dtype=object).reshape(t.meta.shape)
    elif dt == "BF16":
        words = np.frombuffer(t.data, dtype="<u2").astype("<u4") << 16
        arr = words.view("<f4").reshape(t.meta.shape)
    else:
        arr = p.to_numpy(t)
    if single and arr.ndim > 0 and arr.shape[0] == 1:
        arr = arr[0]
    return arr.tolist()


def decode_seed(doc: Any, info: ModelInfo) -> tuple[list[p.Tensor], bool, list[str] | None,
                                                    str | None]:
    """Seed body -> (tensors, single sample, requested outputs, request id)."""
    if not isinstance(doc, dict):
        raise SimpleError('the body must be a JSON object like {"inputs": {"input": [...]}}')
    tensors, single = decode_inputs(doc.get("inputs"), info)
    outputs = doc.get("outputs")
    if outputs is not None and (not isinstance(outputs, list)
                                or not all(isinstance(o, str) for o in outputs)):
        raise SimpleError("'outputs' must be a list of output names")
    rid = doc.get("id")
    if rid is not None and not isinstance(rid, str):
        raise SimpleError("'id' must be a string")
    return tensors, single, outputs, rid


def encode_seed(model: str, version: int, rid: str | None, tensors: Sequence[p.Tensor],
                single: bool) -> dict[str, Any]:
    doc: dict[str, Any] = {"model_name": model, "model_version": version,
                           "outputs": {t.meta.name: to_json(t, single) for t in tensors}}
    if rid is not None:
        doc["id"] = rid
    return doc


def decode_torchserve(doc: Any, info: ModelInfo) -> tuple[list[p.Tensor], bool]:
    if isinstance(doc, dict) and doc and set(doc) <= set(info.inputs):
        return decode_inputs(doc, info)
    if isinstance(doc, dict) and len(doc) == 1 and ("data" in doc or "body" in doc):
        doc = next(iter(doc.values()))  # TorchServe's request envelope
    if isinstance(doc, dict):
        raise SimpleError(f"the body's keys must be input names ({', '.join(sorted(info.inputs))})"
                          f", or 'data'")
    if len(info.inputs) != 1:
        raise SimpleError(f"the model takes {len(info.inputs)} inputs: send an object of "
                          "input name to value")
    return decode_inputs({next(iter(info.inputs)): doc}, info)


def encode_torchserve(tensors: Sequence[p.Tensor], single: bool) -> Any:
    if len(tensors) == 1:
        return to_json(tensors[0], single)
    return {t.meta.name: to_json(t, single) for t in tensors}
