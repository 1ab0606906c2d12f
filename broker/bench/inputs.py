"""Request inputs for ``zeroserve bench``: random tensors of the shapes and datatypes the
model's metadata declares, or data from files (a v2 JSON body, ``.npy`` arrays), and the
request bodies each transport sends, built once per run."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import orjson

from zeroserve.broker import protocol as p


class InputError(ValueError):
    """Inputs that cannot be made from what the user gave (a usage error)."""


@dataclass(frozen=True)
class RequestOptions:
    model: str
    version: int | None = None
    priority: int = 0
    timeout_ms: float = 0.0


def parse_shapes(items: Sequence[str]) -> dict[str, list[int]]:
    """``--shape NAME:D1,D2`` (without the batch dimension) for free (-1) dimensions."""
    out = {}
    for item in items:
        name, sep, dims = item.partition(":")
        try:
            out[name] = [int(d) for d in dims.split(",")] if sep and dims else []
        except ValueError:
            out[name] = []
        if not name or not out[name] or any(d < 0 for d in out[name]):
            raise InputError(f"--shape {item!r}: expected NAME:D1,D2,... (non-negative)")
    return out


def random_inputs(meta: dict[str, Any], batch: int, shapes: dict[str, list[int]],
                  seed: int = 0) -> dict[str, np.ndarray]:
    """One random array per declared input. A leading -1 in the metadata's shape is the
    batch dimension (KServe metadata lists it so for batching models); other -1 dims
    come from ``shapes`` or are 1."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for spec in meta.get("inputs", []):
        name, datatype, shape = spec["name"], spec["datatype"], list(spec["shape"])
        batched = bool(shape) and shape[0] == -1
        body = shape[1:] if batched else shape
        if name in shapes:
            if len(shapes[name]) != len(body):
                raise InputError(f"--shape {name}: {len(shapes[name])} dims given, the model "
                                 f"declares {len(body)} ({body}) besides the batch")
            body = shapes[name]
        dims = ([batch] if batched else []) + [d if d >= 0 else 1 for d in body]
        out[name] = _random_array(rng, datatype, dims)
    if not out:
        raise InputError(f"the metadata of {meta.get('name')!r} declares no inputs")
    return out


def _random_array(rng: np.random.Generator, datatype: str, dims: list[int]) -> np.ndarray:
    if datatype == "BYTES":
        flat = np.empty(int(np.prod(dims)), dtype=object)
        flat[:] = [bytes(rng.integers(97, 123, 8, dtype=np.uint8)) for _ in range(flat.size)]
        return flat.reshape(dims)
    if datatype == "BF16":  # the top halves of float32 words, as the wire carries them
        f32 = rng.standard_normal(dims).astype("<f4")
        return (f32.view("<u4") >> 16).astype("<u2").view(_BF16)
    dtype = p.DTYPES.get(datatype)
    if dtype is None:
        raise InputError(f"unknown datatype {datatype!r}")
    if dtype.kind == "f":
        return rng.standard_normal(dims).astype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, dims).astype(bool)
    return rng.integers(0, 100, dims).astype(dtype)


# BF16 arrays are kept as 2-byte words tagged with a structured dtype of their own, so
# the encoders below know to send them as BF16 rather than UINT16
_BF16 = np.dtype([("bf16", "<u2")])


def datatype_of(arr: np.ndarray) -> str:
    return "BF16" if arr.dtype == _BF16 else p.datatype_of(arr.dtype)


def load_files(paths: Sequence[str], meta: dict[str, Any]) -> dict[str, np.ndarray]:
    """``--input-data``: a v2 JSON body (``{"inputs": [...]}``), or ``.npy`` files named
    ``NAME=FILE.npy`` (a bare ``FILE.npy`` is fine for a model with one input)."""
    names = [s["name"] for s in meta.get("inputs", [])]
    out: dict[str, np.ndarray] = {}
    for item in paths:
        name, sep, path = item.partition("=")
        if not sep:
            name, path = "", item
        file = Path(path)
        if not file.is_file():
            raise InputError(f"--input-data {item!r}: no such file")
        if file.suffix == ".npy":
            if not name:
                if len(names) != 1:
                    raise InputError(f"--input-data {item!r}: the model has inputs {names}; "
                                     "name the one this file holds: NAME=FILE.npy")
                name = names[0]
            out[name] = np.load(file, allow_pickle=False)
        else:
            out.update(_v2_json(file))
    missing = [n for n in names if n not in out]
    if missing:
        raise InputError(f"--input-data gives no data for input(s) {missing}")
    return out


def _v2_json(file: Path) -> dict[str, np.ndarray]:
    try:
        doc = json.loads(file.read_text())
        out = {}
        for inp in doc["inputs"]:
            dt = p.DTYPES[inp["datatype"]]
            if inp["datatype"] == "BYTES":
                arr = np.array([str(x).encode() for x in np.ravel(inp["data"])], dtype=object)
            elif dt is None:
                raise InputError(f"{file}: {inp['datatype']} cannot be given as JSON data")
            else:
                arr = np.asarray(inp["data"], dtype=dt)
            out[inp["name"]] = arr.reshape(inp["shape"])
        return out
    except (ValueError, KeyError, TypeError) as exc:
        if isinstance(exc, InputError):
            raise
        raise InputError(f"{file}: not a v2 JSON body with 'inputs': {exc}") from None


def tensors(inputs: dict[str, np.ndarray]) -> list[p.Tensor]:
    out = []
    for name, arr in inputs.items():
        if arr.dtype == _BF16:
            out.append(p.Tensor(p.TensorMeta(name, "BF16", tuple(arr.shape)),
                                np.ascontiguousarray(arr).data.cast("B")))
        else:
            out.append(p.from_numpy(name, arr))
    return out


def _parameters(opts: RequestOptions, binary_out: bool) -> dict[str, Any]:
    params: dict[str, Any] = {}
    if opts.priority:
        params["priority"] = opts.priority
    if opts.timeout_ms:
        params["timeout"] = int(opts.timeout_ms * 1000)  # µs, as Triton
    if binary_out:
        params["binary_data_output"] = True
    return params


def json_body(inputs: dict[str, np.ndarray], opts: RequestOptions) -> bytes:
    """A v2 JSON body (the data as JSON numbers or strings)."""
    entries = []
    for t in tensors(inputs):
        if t.meta.datatype == "BF16":
            raise InputError(f"input {t.meta.name!r} is BF16, which JSON cannot carry: "
                             "use --transport http-binary or direct")
        arr = p.to_numpy(t).reshape(-1)
        data = [x.decode("utf-8", "replace") for x in arr] if t.meta.datatype == "BYTES" \
            else arr
        entries.append({"name": t.meta.name, "shape": list(t.meta.shape),
                        "datatype": t.meta.datatype, "data": data})
    doc: dict[str, Any] = {"inputs": entries}
    if params := _parameters(opts, False):
        doc["parameters"] = params
    return orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)


def binary_body(inputs: dict[str, np.ndarray], opts: RequestOptions) -> tuple[bytes, int]:
    """Triton's binary tensor extension: a JSON header, then each tensor's raw bytes;
    returns (body, header length for Inference-Header-Content-Length). The outputs come
    back binary too."""
    entries, blobs = [], []
    for t in tensors(inputs):
        raw = bytes(t.data)
        entries.append({"name": t.meta.name, "shape": list(t.meta.shape),
                        "datatype": t.meta.datatype,
                        "parameters": {"binary_data_size": len(raw)}})
        blobs.append(raw)
    header = orjson.dumps({"inputs": entries, "parameters": _parameters(opts, True)})
    return header + b"".join(blobs), len(header)


def infer_path(opts: RequestOptions) -> str:
    version = f"/versions/{opts.version}" if opts.version is not None else ""
    return f"/v2/models/{opts.model}{version}/infer"


def samples_per_request(inputs: dict[str, np.ndarray], meta: dict[str, Any]) -> int:
    """Rows per request (the batch dimension), 1 for a model without one."""
    specs = meta.get("inputs", [])
    if specs and specs[0].get("shape", [None])[:1] == [-1]:
        first = inputs.get(specs[0]["name"])
        if first is not None and first.ndim:
            return int(first.shape[0])
    return 1
