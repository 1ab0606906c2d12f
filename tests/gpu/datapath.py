"""A worker's batch, phase by phase, on its device: the phases that work on the GPU data
path (pinned buffers reused across batches, copies on the compute thread's own stream,
outputs awaited by an event) would change, timed today so that a change is measured
against them before it is kept.

The real code of the worker (``workers/batching.py``) on a real batch of requests
(``p.Batch`` of single-row requests, as the broker sends them), in this process:

- ``assembly``: the requests' frames into one host tensor, pinned (what the worker does
  on a GPU) and pageable, without the copy to the device; and on a GPU the worker's own
  call, assembly with the copy's launch;
- ``h2d``: that tensor to the device, from pinned and from pageable memory (CUDA events:
  the copy's own time, and the wall time the thread waited);
- ``compute``: the model on inputs already on the device (events);
- ``d2h``: the output back to the host (events);
- ``worker_batch``: ``batching.run`` as the compute thread calls it, wall time, with the
  phases it reports itself (input, infer, output).

Medians in milliseconds. On the CPU only assembly, compute and the worker's batch exist.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable

import numpy as np
import torch

from zeroserve.broker import protocol as p
from zeroserve.broker.runtime import cache_dir
from zeroserve.models.loader import LoadedModel, load
from zeroserve.models.repository import load_config
from zeroserve.workers import batching
from zeroserve.workers.memory import rss_bytes
from zeroserve.workers.supervisor import ensure_examples

SHAPES = {"mlp": (256,), "cnn": (3, 64, 64)}


def loaded_example(name: str, device: str) -> LoadedModel:
    folder = ensure_examples(cache_dir()) / name
    return load(load_config(folder), 1, folder / "1", device, rss_bytes)


def batch_of(name: str, rows: int) -> p.Batch:
    x = np.random.default_rng(0).standard_normal((rows, *SHAPES[name])).astype(np.float32)
    return p.Batch(1, name, 1, [p.BatchItem(str(i), [p.from_numpy("input", x[i:i + 1])])
                                for i in range(rows)])


def _median_ms(fn: Callable[[], Any], reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def _event_ms(fn: Callable[[], Any], reps: int) -> tuple[float, float]:
    """(device ms between two events around ``fn``, wall ms until the second is done)."""
    device, wall = [], []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = time.perf_counter()
        start.record()
        fn()
        end.record()
        end.synchronize()
        wall.append((time.perf_counter() - t) * 1000)
        device.append(start.elapsed_time(end))
    return statistics.median(device), statistics.median(wall)


def phases(loaded: LoadedModel, batch: p.Batch, reps: int) -> dict[str, Any]:
    host = dataclasses.replace(loaded, device="cpu")   # assembly alone, no copy after it
    cuda = loaded.device.startswith("cuda")
    # pinned on a GPU, as the worker assembles there
    out: dict[str, Any] = {"rows": len(batch.items), "assembly_ms": _median_ms(
        lambda: batching.assemble(host, batch.items, pin=cuda), reps)}
    if cuda:
        out["assembly_pageable_ms"] = _median_ms(
            lambda: batching.assemble(host, batch.items), reps)
    inputs, _ = batching.assemble(host, batch.items, pin=cuda)
    with torch.inference_mode():
        if cuda:
            # the worker's own call: assembly and the copy's launch (a CPU worker's batch
            # of one is a view of its frame; on a GPU it is pinned like any other)
            out["assembly_and_launch_ms"] = _median_ms(
                lambda: batching.assemble(loaded, batch.items, pin=True), reps)
            inputs = [t if t.is_pinned() else t.pin_memory() for t in inputs]
            pageable = [t.clone() for t in inputs]
            on_device = [t.to(loaded.device) for t in inputs]
            out["h2d_pinned_ms"], out["h2d_pinned_wall_ms"] = _event_ms(
                lambda: [t.to(loaded.device, non_blocking=True) for t in inputs], reps)
            out["h2d_pageable_ms"], out["h2d_pageable_wall_ms"] = _event_ms(
                lambda: [t.to(loaded.device) for t in pageable], reps)
            result = loaded.fn(*on_device)
            out["compute_ms"], out["compute_wall_ms"] = _event_ms(
                lambda: loaded.fn(*on_device), reps)
            out["d2h_ms"], out["d2h_wall_ms"] = _event_ms(lambda: result.to("cpu"), reps)
        else:
            out["compute_ms"] = _median_ms(lambda: loaded.fn(*inputs), reps)
    runs = [batching.run(loaded, batch) for _ in range(reps)]
    assert all(not r.error for r in runs), runs[0].error
    out["worker_batch_ms"] = statistics.median(r.compute_ms for r in runs)
    out["worker_phases_ms"] = {k: round(statistics.median(r.phases_ms[k] for r in runs), 4)
                               for k in runs[0].phases_ms}
    return out


def measure(device: str, reps: int) -> dict[str, Any]:
    """Each example at a batch of one and at its largest batch."""
    torch.set_num_threads(1)
    got: dict[str, Any] = {}
    for name in ("cnn", "mlp"):
        loaded = loaded_example(name, device)
        for rows in sorted({1, loaded.config.max_batch_size}):
            got[f"{name} b={rows}"] = {k: round(v, 4) if isinstance(v, float) else v
                                       for k, v in phases(loaded, batch_of(name, rows),
                                                          reps).items()}
        loaded.release()
    return got
