"""The classification extension (Triton's): an output requested with
``parameters.classification: N`` comes back as the top N of each batch row, as BYTES
``"value:index"`` or ``"value:index:label"``, highest value first.

Triton prints the value with C++ ``std::to_string``: ``%f`` for floating types,
the integer itself for integer types. Ties keep the lower index first.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from zeroserve.broker import protocol as p
from zeroserve.gateway.v2 import DecodeError


def _values(t: p.Tensor) -> np.ndarray:
    datatype = t.meta.datatype
    if datatype in ("BYTES", "BOOL"):
        raise DecodeError(f"output {t.meta.name!r} is {datatype}: classification needs a "
                          "numeric output")
    if datatype == "BF16":  # no numpy dtype: the top 16 bits of a float32
        raw = np.frombuffer(t.data, dtype="<u2").astype(np.uint32) << 16
        return raw.view(np.float32).reshape(t.meta.shape)
    return p.to_numpy(t)


def _text(value: np.generic, floating: bool) -> str:
    return f"{float(value):f}" if floating else str(int(value))


def classify(t: p.Tensor, count: int, batched: bool,
             labels: Sequence[str] | None = None) -> p.Tensor:
    """The top ``count`` classes of ``t``: per row of the batch dimension when the
    model batches (shape [batch, k]), else over the whole tensor (shape [k])."""
    arr = _values(t)
    rows = arr.reshape(arr.shape[0], -1) if batched and arr.ndim > 0 else arr.reshape(1, -1)
    k = min(count, rows.shape[1])
    floating = arr.dtype.kind == "f"
    # float64 keys: negating an unsigned array would wrap; NaN sorts last either way
    order = np.argsort(-rows.astype(np.float64), axis=1, kind="stable")[:, :k]
    items: list[bytes] = []
    for row, idx in zip(rows, order):
        for i in idx:
            text = f"{_text(row[i], floating)}:{int(i)}"
            if labels is not None and i < len(labels) and labels[i]:
                text += f":{labels[i]}"
            items.append(text.encode())
    shape = (rows.shape[0], k) if batched and arr.ndim > 0 else (k,)
    return p.Tensor(p.TensorMeta(t.meta.name, "BYTES", shape), p.pack_bytes_elements(items))
