"""Decoupled models: a Python handler whose ``predict`` is a generator, run for a batch
of streams, each response sent as it is yielded.

The contract (docs/streaming.md)::

    def predict(self, inputs, rows):
        # inputs: {name: tensor}, the batch's requests concatenated along dim 0 as for
        # any handler; rows[i]: the slice of dim 0 that holds request i
        ...
        yield {0: ({"text_output": t0}, False), 1: ({"text_output": t1}, True)}

Each yield maps a request's index in the batch to ``(outputs, final)``: ``outputs``
is a dict of that request's outputs (dim 0 its own rows when the model batches), or
``None`` / ``{}`` for an empty response, allowed only when ``final``; ``final`` ends
that request's stream. A yield names only the requests it has something for, and a
request whose stream ended is never named again. Requests the generator never ended
get an empty final response when it returns. An exception fails the requests still
open with its message; those already ended keep their answers.

Why a mapping: one generator serves a whole batch (one model call per step for every
request in it, as batching is for), its requests end at different steps, and a
request's index is all the handler needs to say whose response a yield holds.

The generator is closed (``GeneratorExit`` at its ``yield``) once every request of
the batch has ended or been stopped by the broker (the client went away, the
deadline passed before the first response): the worker's slot is free then.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import AbstractSet, Any, Callable, Iterator, Sequence

import torch

from zeroserve.broker import protocol as p
from zeroserve.models.loader import LoadedModel
from zeroserve.workers.batching import BatchError, assemble, encode_output, handler_outputs, \
    lengths


def row_slices(loaded: LoadedModel, sizes: Sequence[int]) -> list[slice]:
    """Request i's rows of dim 0 (the whole tensor when the model does not batch)."""
    if loaded.config.max_batch_size <= 0:
        return [slice(None)] * len(sizes)
    out, pos = [], 0
    for n in sizes:
        out.append(slice(pos, pos + n))
        pos += n
    return out


def response_tensors(loaded: LoadedModel, outputs: Any, rows: int,
             wanted: Sequence[str] | None) -> list[p.Tensor]:
    """One response's outputs of a request of ``rows`` rows, the ones it asked for."""
    values = handler_outputs(loaded, outputs)
    tensors = []
    for spec, value in zip(loaded.config.outputs, values):
        if loaded.config.max_batch_size > 0 and value.shape[0] != rows:
            raise BatchError(f"output {spec.name!r} has {value.shape[0]} rows for a request "
                             f"of {rows}")
        if wanted is None or spec.name in wanted:
            tensors.append(encode_output(spec.name, value))
    return tensors


def parts_of(loaded: LoadedModel, batch: p.Batch, sizes: Sequence[int], out: Any,
             running: dict[int, p.BatchItem], stopped: AbstractSet[str]) -> list[p.PartialItem]:
    """One yield's responses; a request ended by ``final`` leaves ``running``."""
    if not isinstance(out, Mapping):
        raise BatchError(f"a decoupled predict() yielded {type(out).__name__}; each yield "
                         "maps a request's index in the batch to (outputs, final)")
    parts = []
    for index, value in out.items():
        if type(index) is not int or not 0 <= index < len(batch.items):
            raise BatchError(f"a yield names request {index!r}; the batch has "
                             f"{len(batch.items)} (indices 0 to {len(batch.items) - 1})")
        if not (isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], bool)):
            raise BatchError(f"request {index}: each response is (outputs, final), got "
                             f"{type(value).__name__}")
        if batch.items[index].request_id in stopped:
            running.pop(index, None)
            continue   # stopped by the broker (answered already): the handler cannot know
        item = running.get(index)
        if item is None:
            raise BatchError(f"request {index} was named after its final response")
        outputs, final = value
        if outputs is None or (isinstance(outputs, Mapping) and not outputs):
            if not final:
                raise BatchError(f"request {index}: an empty response must be final")
            tensors: list[p.Tensor] = []
        else:
            tensors = response_tensors(loaded, outputs, sizes[index], item.outputs)
        parts.append(p.PartialItem(item.request_id, final, tensors))
        if final:
            del running[index]
    return parts


def run_stream(loaded: LoadedModel, batch: p.Batch, emit: Callable[[p.Partial], None],
               stopped: Callable[[], AbstractSet[str]]) -> p.BatchResult:
    """Run one batch of streams: ``emit`` sends each yield's responses at once;
    ``stopped()`` names the batch's items the broker has answered already."""
    start = time.perf_counter()
    running = dict(enumerate(batch.items))
    try:
        # a padded stream's inputs are padded like any batch's; its parts are the
        # handler's own to shape
        inputs, sizes = assemble(loaded, batch.items, pin=loaded.device.startswith("cuda"),
                                 own=lengths(loaded, batch.items))
        named = {spec.name: t for spec, t in zip(loaded.config.inputs, inputs)}
        with torch.inference_mode():
            gen = loaded.fn(named, row_slices(loaded, sizes))
            if not isinstance(gen, Iterator):
                raise BatchError(f"predict() of a decoupled model returned "
                                 f"{type(gen).__name__}: it must be a generator (yield)")
            try:
                while running:
                    gone = stopped()
                    for index in [i for i, it in running.items() if it.request_id in gone]:
                        del running[index]
                    if not running:
                        break
                    out = next(gen, _END)
                    if out is _END:
                        break
                    parts = parts_of(loaded, batch, sizes, out, running, stopped())
                    if parts:
                        emit(p.Partial(batch.batch_id, parts))
            finally:
                close = getattr(gen, "close", None)
                if close is not None:
                    close()   # GeneratorExit at its yield: its finally blocks run now
    except Exception as exc:  # the model's code can raise anything
        return p.BatchResult(batch.batch_id, [], (time.perf_counter() - start) * 1000.0,
                             error=f"{type(exc).__name__}: {exc}")
    elapsed_ms = (time.perf_counter() - start) * 1000.0
    return p.BatchResult(batch.batch_id, [], elapsed_ms,
                         phases_ms={"infer": elapsed_ms})


_END: Any = object()
