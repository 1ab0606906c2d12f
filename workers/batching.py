"""Batch assembly: request frames -> one tensor per input -> model -> per-request frames."""

from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np
import torch

from zeroserve.broker import protocol as p, tracing
from zeroserve.models.loader import DATATYPE_OF, TORCH_DTYPES, LoadedModel
from zeroserve.models.repository import PaddedInput
from zeroserve.models.shapes import ShapeError, rule as shape_rule
from zeroserve.models.text import IDS, MASK
from zeroserve.workers import packing
from zeroserve.workers.pooling import pool

# numpy views used to copy raw bytes into torch tensors of the same item size;
# bfloat16 has no numpy dtype, so it moves as int16 words.
_RAW_VIEW = {torch.bfloat16: torch.int16}


class BatchError(Exception):
    pass


def _fill(dst: torch.Tensor, buf: Any, shape: Sequence[int]) -> None:
    view = dst.view(_RAW_VIEW.get(dst.dtype, dst.dtype)).numpy()
    view[...] = np.frombuffer(buf, dtype=view.dtype).reshape(shape)


def _fill_rows(dst: torch.Tensor, parts: Sequence[p.Tensor]) -> None:
    """Each request's bytes copied after the previous one's: the frames' sizes were
    checked against their shapes on receipt, and the shapes against each other."""
    flat = dst.view(_RAW_VIEW.get(dst.dtype, dst.dtype)).numpy().reshape(-1).view(np.uint8)
    pos = 0
    for t in parts:
        src = np.frombuffer(t.data, dtype=np.uint8)
        flat[pos:pos + src.size] = src
        pos += src.size


def _view(t: p.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """The request's own bytes as a tensor, without a copy (a batch of one on the CPU),
    or None when they are not aligned to their element size (then they are copied).
    The frame is writable and this process's alone, so a model that writes into its
    input changes nothing anyone else reads."""
    buf = t.data if isinstance(t.data, memoryview) else memoryview(t.data)
    if buf.readonly or not buf.nbytes or not buf.c_contiguous:
        return None
    raw = torch.frombuffer(buf, dtype=torch.uint8)
    if raw.data_ptr() % dtype.itemsize:
        return None
    return raw.view(dtype).view(t.meta.shape)


def _single(loaded: LoadedModel, item: p.BatchItem) -> tuple[list[Any], list[int]] | None:
    """A batch of one on the CPU: the inputs are views of the request's frames."""
    cfg = loaded.config
    inputs: list[Any] = []
    by_name = {t.meta.name: t for t in item.tensors}
    for spec in cfg.inputs:
        t = by_name.get(spec.name)
        if t is None or spec.datatype == "BYTES":
            return None   # the general path says what is wrong, or packs BYTES
        view = _view(t, TORCH_DTYPES[spec.datatype])
        if view is None:
            return None
        inputs.append(view)
    rows = item.tensors[0].meta.shape[0] if cfg.max_batch_size > 0 else 1
    return inputs, [rows]


def rows(loaded: LoadedModel, items: Sequence[p.BatchItem]) -> int:
    """A batch's rows along dim 0 (its requests, for a model that does not batch)."""
    if loaded.config.max_batch_size <= 0:
        return len(items)
    return sum(item.tensors[0].meta.shape[0] if item.tensors and item.tensors[0].meta.shape
               else 1 for item in items)


def units(loaded: LoadedModel, items: Sequence[p.BatchItem]) -> float:
    """What a batch costs in the broker's units (models/shapes.py): its rows, times the
    longest row's scale for a model with free dimensions (a padded batch runs every row
    at the longest length)."""
    n = rows(loaded, items)
    rule = shape_rule(loaded.config)
    if rule.fixed:
        return float(n)
    try:
        scale = max(rule.classify({t.meta.name: t.meta.shape for t in item.tensors})[1]
                    for item in items)
    except (ShapeError, ValueError):   # the batch's own run says what is wrong
        return float(n)
    return n * scale


def lengths(loaded: LoadedModel, items: Sequence[p.BatchItem]) -> list[int] | None:
    """Each request's own length along the padded dimension; None for a model that
    declares no padding."""
    if loaded.config.dynamic_batching.padding is None:
        return None
    rule = shape_rule(loaded.config)
    out = []
    for item in items:
        try:
            n = rule.length({t.meta.name: t.meta.shape for t in item.tensors})
        except ShapeError as exc:
            raise BatchError(str(exc)) from None
        if n is None:
            raise BatchError("a padded input is missing from a request")
        out.append(n)
    return out


def _padded(spec_name: str, pad: PaddedInput, parts: Sequence[p.Tensor], target: int,
            dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """The requests' rows one after the other, each padded with the pad value from its
    own length to ``target`` along the padded dimension."""
    first = tuple(parts[0].meta.shape[1:])
    tail = list(first)
    tail[pad.dim] = target
    for t in parts:
        if len(t.meta.shape) != len(first) + 1 or any(
                d != e for i, (d, e) in enumerate(zip(t.meta.shape[1:], first)) if i != pad.dim):
            raise BatchError(f"input {spec_name!r}: requests in one batch differ in shape "
                             "beyond the padded dimension")
    total = sum(t.meta.shape[0] for t in parts)
    value = pad.value if dtype.is_floating_point else int(pad.value)
    dst = torch.full((total, *tail), value, dtype=dtype, pin_memory=pin)
    view = dst.view(_RAW_VIEW.get(dtype, dtype)).numpy()
    pos = 0
    for t in parts:
        shape = t.meta.shape
        src = np.frombuffer(t.data, dtype=view.dtype).reshape(shape)
        view[(slice(pos, pos + shape[0]), *(slice(0, d) for d in shape[1:]))] = src
        pos += shape[0]
    return dst


def assemble(loaded: LoadedModel, items: Sequence[p.BatchItem],
             pin: bool = False, own: Sequence[int] | None = None
             ) -> tuple[list[Any], list[int]]:
    """One tensor per declared input, the items concatenated along dim 0 in one copy
    (none for a batch of one on the CPU that needs no padding). ``own``: each item's
    length along the padded dimension (:func:`lengths`), for a model that pads."""
    cfg = loaded.config
    padding = cfg.dynamic_batching.padding
    target = 0
    if own is not None and padding is not None:
        target = shape_rule(cfg).padded_length(max(own))
    if len(items) == 1 and loaded.device == "cpu" and (own is None or target == own[0]):
        single = _single(loaded, items[0])
        if single is not None:
            return single
    pads = {i.name: i for i in padding.inputs} if padding is not None and own else {}
    sizes = []
    for item in items:
        sizes.append(item.tensors[0].meta.shape[0] if cfg.max_batch_size > 0 else 1)
    total = sum(sizes)
    inputs: list[Any] = []
    for spec in cfg.inputs:
        parts = []
        for item in items:
            t = next((t for t in item.tensors if t.meta.name == spec.name), None)
            if t is None:
                raise BatchError(f"input {spec.name!r} missing from a request")
            parts.append(t)
        if spec.datatype == "BYTES":
            if loaded.handler is None:
                raise BatchError("BYTES inputs need a Python handler model")
            inputs.append(_bytes_input(parts, cfg.max_batch_size > 0))
            continue
        pad = pads.get(spec.name)
        if pad is not None:
            dst = _padded(spec.name, pad, parts, target, TORCH_DTYPES[spec.datatype], pin)
            inputs.append(dst.to(loaded.device, non_blocking=True)
                          if loaded.device != "cpu" else dst)
            continue
        first = parts[0].meta.shape
        tail = tuple(first[1:]) if cfg.max_batch_size > 0 else tuple(first)
        if any((tuple(t.meta.shape[1:]) if cfg.max_batch_size > 0 else tuple(t.meta.shape))
               != tail for t in parts):
            raise BatchError(f"input {spec.name!r}: requests in one batch differ in shape")
        shape = (total, *tail) if cfg.max_batch_size > 0 else tail
        dst = torch.empty(shape, dtype=TORCH_DTYPES[spec.datatype], pin_memory=pin)
        if cfg.max_batch_size > 0:
            _fill_rows(dst, parts)
        else:
            _fill(dst, parts[0].data, parts[0].meta.shape)
        inputs.append(dst.to(loaded.device, non_blocking=True) if loaded.device != "cpu" else dst)
    return inputs, sizes


def _bytes_input(parts: Sequence[p.Tensor], batched: bool) -> np.ndarray:
    """BYTES inputs reach a Python handler as one numpy object array of bytes."""
    arrays = [p.to_numpy(t) for t in parts]
    return np.concatenate(arrays) if batched else arrays[0]


def _bytes_output(arr: Any) -> np.ndarray:
    if isinstance(arr, (list, tuple)):
        arr = np.array(arr, dtype=object)
    if not isinstance(arr, np.ndarray) or arr.dtype != object:
        raise BatchError("a BYTES output must be a numpy object array of bytes")
    return arr


def handler_outputs(loaded: LoadedModel, out: Any) -> list[Any]:
    """A handler's predict() returns {output name: tensor or numpy array, or object array
    for BYTES}."""
    if not isinstance(out, dict):
        raise BatchError(f"predict() returned {type(out).__name__}, expected a dict of outputs")
    result: list[Any] = []
    for spec in loaded.config.outputs:
        if spec.name not in out:
            raise BatchError(f"predict() returned no output {spec.name!r}")
        value = out[spec.name]
        if spec.datatype == "BYTES":
            result.append(_bytes_output(value))
        elif isinstance(value, torch.Tensor):
            result.append(value.detach().to("cpu").contiguous())
        else:
            result.append(_numpy_output(spec.name, spec.datatype, value))
    return result


def _numpy_output(name: str, datatype: str, value: Any) -> torch.Tensor:
    """A numpy result as the declared datatype, cast only within numpy's ``same_kind``
    rule (int64 -> INT32 or FP32 yes, float -> INT64 no), as a silent truncation would
    answer wrong numbers."""
    # numpy has no bfloat16: check and cast through float32, then narrow in torch
    np_target = p.DTYPES[datatype] or np.dtype(np.float32)
    if not isinstance(value, np.ndarray) or not np.can_cast(value.dtype, np_target,
                                                            casting="same_kind"):
        got = type(value).__name__ + (f" of dtype {value.dtype}"
                                      if isinstance(value, np.ndarray) else "")
        raise BatchError(f"output {name!r}: expected {datatype} (a tensor, or a numpy array "
                         f"that casts to {np_target} within its kind), got {got}")
    return torch.from_numpy(np.ascontiguousarray(value, dtype=np_target)).to(
        TORCH_DTYPES[datatype])


def _call(loaded: LoadedModel, inputs: list[Any] | dict[str, Any], sizes: Sequence[int],
          own: Sequence[int] | None) -> list[Any]:
    """The model on a batch: ``inputs`` in the config's order, or by name for a packed
    batch (workers/packing.py, which adds the offsets)."""
    text = loaded.config.text
    named = inputs if isinstance(inputs, dict) else \
        {spec.name: t for spec, t in zip(loaded.config.inputs, inputs)}
    if loaded.handler is not None:
        out = loaded.fn(named)
        if text is None:
            return handler_outputs(loaded, out)
    else:
        out = loaded.fn(*inputs)
        if text is None:
            return _as_outputs(loaded, out)
    # a text model answers its one output, the pooled vectors (workers/pooling.py)
    cu = named.get(packing.CU_SEQLENS)
    mask = _mask(loaded, named, sizes, None if cu is not None else own)
    return [pool(text, out, mask, cu).to("cpu").contiguous()]


def _mask(loaded: LoadedModel, named: dict[str, Any], sizes: Sequence[int],
          own: Sequence[int] | None) -> torch.Tensor:
    """Which positions of each row are its own tokens: the attention mask the model was
    given, or (a model that takes none) each request's length within the padded batch."""
    if MASK in named:
        mask: torch.Tensor = named[MASK]
        return mask
    ids = named[IDS]
    if own is None:   # nothing padded
        return torch.ones(ids.shape, dtype=torch.int64, device=ids.device)
    per_row = torch.repeat_interleave(torch.tensor(own), torch.tensor(sizes)).to(ids.device)
    return (torch.arange(ids.shape[1], device=ids.device) < per_row.unsqueeze(1)).long()


def encode_output(name: str, part: Any) -> p.Tensor:
    if isinstance(part, np.ndarray):  # BYTES
        flat = [x if isinstance(x, bytes) else str(x).encode() for x in part.reshape(-1)]
        return p.Tensor(p.TensorMeta(name, "BYTES", tuple(part.shape)),
                        p.pack_bytes_elements(flat))
    datatype, raw = _raw(part)
    return p.Tensor(p.TensorMeta(name, datatype, tuple(part.shape)), raw)


def _as_outputs(loaded: LoadedModel, out: Any) -> list[torch.Tensor]:
    cfg = loaded.config
    if isinstance(out, torch.Tensor):
        out = (out,)
    elif isinstance(out, dict):
        out = tuple(out[s.name] for s in cfg.outputs if s.name in out)
    if not isinstance(out, (tuple, list)) or not all(isinstance(t, torch.Tensor) for t in out):
        raise BatchError(f"model returned {type(out).__name__}, expected tensors")
    if len(out) != len(cfg.outputs):
        raise BatchError(f"model returned {len(out)} outputs, config declares "
                         f"{len(cfg.outputs)}")
    return [t.detach().to("cpu").contiguous() for t in out]


def _raw(t: torch.Tensor) -> tuple[str, memoryview]:
    datatype = DATATYPE_OF.get(t.dtype)
    if datatype is None:
        raise BatchError(f"output dtype {t.dtype} has no KServe datatype")
    arr = t.view(_RAW_VIEW.get(t.dtype, t.dtype)).numpy()
    # a flat byte view: memoryview.cast refuses shapes with a zero in them
    return datatype, memoryview(arr.reshape(-1).view(np.uint8))


def _rows(spec_name: str, t: torch.Tensor, sizes: Sequence[int]) -> list[p.Tensor]:
    """Each request's rows of an output: byte slices of one buffer, no per-row tensors."""
    datatype, raw = _raw(t)
    tail = tuple(t.shape[1:])
    row = raw.nbytes // t.shape[0] if t.shape[0] else 0
    out, pos = [], 0
    for n in sizes:
        out.append(p.Tensor(p.TensorMeta(spec_name, datatype, (n, *tail)),
                            raw[pos * row:(pos + n) * row]))
        pos += n
    return out


def _cut(spec_name: str, t: torch.Tensor, dim: int, sizes: Sequence[int],
         own: Sequence[int]) -> list[p.Tensor]:
    """Each request's rows of a padded output, cut back to its own length along ``dim``
    (the config's, batch dimension left out)."""
    if dim + 1 >= t.dim():
        raise BatchError(f"output {spec_name!r} has {t.dim()} dimensions: padding cuts dim "
                         f"{dim} (after the batch dimension)")
    out, pos = [], 0
    for n, length in zip(sizes, own):
        part = t[pos:pos + n].narrow(dim + 1, 0, min(length, t.shape[dim + 1])).contiguous()
        out.append(encode_output(spec_name, part))
        pos += n
    return out


def _replies(loaded: LoadedModel, batch: p.Batch, outputs: list[Any],
             sizes: Sequence[int], own: Sequence[int] | None = None,
             packed: bool = False) -> list[p.InferReply]:
    total = sum(sizes)
    cfg = loaded.config
    padding = cfg.dynamic_batching.padding
    cuts = {o.name: o.dim for o in padding.outputs} if padding is not None and own else {}
    per_output: list[list[p.Tensor]] = []
    for spec, t in zip(cfg.outputs, outputs):
        if packed and spec.name in cuts and isinstance(t, torch.Tensor):
            assert own is not None
            per_output.append([encode_output(spec.name, part.contiguous()) for part in
                               packing.split(spec.name, t, cuts[spec.name], sizes, own)])
        elif cfg.max_batch_size > 0:
            if t.shape[0] != total:
                raise BatchError(f"output {spec.name!r} has {t.shape[0]} rows for a batch "
                                 f"of {total}")
            if spec.name in cuts and isinstance(t, torch.Tensor):
                assert own is not None
                per_output.append(_cut(spec.name, t, cuts[spec.name], sizes, own))
            elif isinstance(t, torch.Tensor):
                per_output.append(_rows(spec.name, t, sizes))
            else:
                per_output.append([encode_output(spec.name, part)
                                   for part in np.split(t, np.cumsum(sizes)[:-1])])
        else:
            per_output.append([encode_output(spec.name, t)])
    names = [spec.name for spec in cfg.outputs]
    replies = []
    for i, item in enumerate(batch.items):
        wanted = item.outputs
        tensors = [encoded[i] for name, encoded in zip(names, per_output)
                   if wanted is None or name in wanted]
        replies.append(p.InferReply(item.request_id, batch.model, batch.version, tensors))
    return replies


def run(loaded: LoadedModel, batch: p.Batch) -> p.BatchResult:
    """Run one batch. A model exception fails this batch only, with its message."""
    # the host's monotonic clock (as fast as perf_counter on Linux): the marks are also
    # a traced batch's stamps, on the clock the broker and gateway read
    start = time.monotonic()
    marks = [start]
    try:
        own = lengths(loaded, batch.items)
        packed = own is not None and loaded.packed
        inputs: list[Any] | dict[str, Any]
        if packed:
            assert own is not None
            inputs, sizes = packing.assemble(loaded, batch.items, own)
        else:
            inputs, sizes = assemble(loaded, batch.items,
                                     pin=loaded.device.startswith("cuda"), own=own)
        marks.append(time.monotonic())
        with torch.inference_mode():
            outputs = _call(loaded, inputs, sizes, own)
        marks.append(time.monotonic())
        replies = _replies(loaded, batch, outputs, sizes, own, packed)
    except Exception as exc:  # the model's code can raise anything
        return p.BatchResult(batch.batch_id, [], (time.monotonic() - start) * 1000.0,
                             error=f"{type(exc).__name__}: {exc}")
    marks.append(time.monotonic())
    phases = {name: (b - a) * 1000.0
              for name, a, b in zip(("input", "infer", "output"), marks, marks[1:])}
    trace = None
    if batch.trace is not None:
        trace = tracing.worker_stamps(marks)
        if own:   # a model with a padded input: the tokens its batch computed
            trace["tokens"] = sum(n * k for n, k in zip(sizes, own)) if packed else \
                sum(sizes) * shape_rule(loaded.config).padded_length(max(own))
    return p.BatchResult(batch.batch_id, replies, (marks[-1] - start) * 1000.0,
                         phases_ms=phases, trace=trace)
