"""Packed batches (``dynamic_batching.token_cost: "packed"``) for a Python handler that
takes ragged rows: no padding, each padded input's rows concatenated along their length
into one row, and the offsets of the rows as ``cu_seqlens`` (flash-attention's name and
layout: INT64 [rows + 1], row r is ``cu_seqlens[r]:cu_seqlens[r + 1]``).

A batch then costs the sum of its rows' lengths, which is what the broker's token
budget counts for such a model. An output the config's padding cuts comes back packed
the same way ([1, total, ...] along its padded dimension) and is cut into each request's
rows here. Which models run packed: ``LoadedModel.packed`` (models/loader.py).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from zeroserve.broker import protocol as p
from zeroserve.models.loader import CU_SEQLENS, TORCH_DTYPES, LoadedModel

__all__ = ["CU_SEQLENS", "PackError", "assemble", "cu_seqlens", "split"]


class PackError(ValueError):
    """A packed batch that cannot be formed or cut; the message says what."""


def cu_seqlens(sizes: Sequence[int], own: Sequence[int]) -> torch.Tensor:
    """The offsets of every row: a request of n rows of length L adds n rows of L."""
    per_row = np.repeat(np.asarray(own, dtype=np.int64), np.asarray(sizes, dtype=np.int64))
    return torch.from_numpy(np.concatenate([[0], np.cumsum(per_row)]).astype(np.int64))


def assemble(loaded: LoadedModel, items: Sequence[p.BatchItem], own: Sequence[int]
             ) -> tuple[dict[str, Any], list[int]]:
    """The handler's inputs by name, each padded input packed into [1, ...total...]
    and every other one concatenated by rows as usual, with ``cu_seqlens``; and each
    request's rows."""
    cfg = loaded.config
    assert cfg.dynamic_batching.padding is not None
    pads = {i.name: i.dim for i in cfg.dynamic_batching.padding.inputs}
    sizes = [item.tensors[0].meta.shape[0] for item in items]
    named: dict[str, Any] = {}
    for spec in cfg.inputs:
        parts = []
        for item in items:
            t = next((t for t in item.tensors if t.meta.name == spec.name), None)
            if t is None:
                raise PackError(f"input {spec.name!r} missing from a request")
            parts.append(_tensor(t, TORCH_DTYPES[spec.datatype])
                         if spec.datatype != "BYTES" else p.to_numpy(t))
        if spec.datatype == "BYTES":
            named[spec.name] = np.concatenate(parts)
            continue
        dim = pads.get(spec.name)
        try:
            if dim is None:
                joined = torch.cat(parts)
            else:
                # every row of every request one after the other along the length
                rows = [row for part in parts for row in part.unbind(0)]
                joined = torch.cat(rows, dim=dim).unsqueeze(0)
        except RuntimeError:
            raise PackError(f"input {spec.name!r}: requests in one batch differ in shape "
                            "beyond the packed dimension") from None
        named[spec.name] = joined.to(loaded.device)
    named[CU_SEQLENS] = cu_seqlens(sizes, own).to(loaded.device)
    return named, sizes


def _tensor(t: p.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A request's tensor, copied (the rows are cut and joined again)."""
    if not t.meta.shape or 0 in t.meta.shape:
        return torch.empty(t.meta.shape, dtype=dtype)
    return torch.frombuffer(bytearray(t.data), dtype=dtype).view(t.meta.shape)


def split(name: str, t: torch.Tensor, dim: int, sizes: Sequence[int],
          own: Sequence[int]) -> list[torch.Tensor]:
    """Each request's rows of a packed output ([1, ...total...] along ``dim``, the
    config's, batch dimension left out), as [rows, ...length...]."""
    axis = dim + 1
    total = sum(n * length for n, length in zip(sizes, own))
    if t.dim() <= axis or t.shape[0] != 1 or t.shape[axis] != total:
        raise PackError(f"output {name!r} of a packed batch must be one row of the batch's "
                        f"{total} tokens along dim {dim}, got shape {list(t.shape)}")
    out, pos = [], 0
    for n, length in zip(sizes, own):
        segment = t.narrow(axis, pos, n * length)
        out.append(torch.cat(segment.split(length, dim=axis)) if length else
                   segment.new_empty((n, *segment.shape[1:])))
        pos += n * length
    return out
