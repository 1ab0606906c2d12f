"""A large model through a worker's unload and its host-memory tier, on the device, with
the device's used memory as its driver sees it (NVML, workers/gpustats.py; torch's
allocated bytes where there is no NVML, resident memory on a CPU):

- loaded, then unloaded (parked in host memory): used memory after against before the
  load, in percent of before;
- moved back from the host tier (``Loader.load_version`` of the parked version) against
  a plain ``to(device)`` of the same weights from ordinary host memory;
- unloaded for good at the end: what stays, and whether the worker would recycle.

The worker's own code in this process (``Worker``, no broker), as
tests/bench/bench_turn_phases.py runs it.
"""

from __future__ import annotations

import math
import shutil
import time
from typing import Any, Callable

import torch

from tests.conftest import linear_config, short_tmpdir, write_model
from zeroserve.broker import protocol as p
from zeroserve.workers import gpustats
from zeroserve.workers.memory import rss_bytes
from zeroserve.workers.worker import Worker


def used_probe(device: str) -> tuple[str, Callable[[], int]]:
    """What counts as the device's used memory here, and how to read it."""
    if not device.startswith("cuda"):
        return "resident memory (CPU)", rss_bytes
    view = gpustats.DriverView.open(device)
    if view is None:
        return "torch.cuda.memory_reserved (no NVML)", \
            lambda: torch.cuda.memory_reserved(device)

    def nvml() -> int:
        torch.cuda.synchronize(device)
        seen = view.read()
        assert seen is not None, "NVML stopped answering"
        return seen.memory_used_bytes
    return "NVML used (every process on the device)", nvml


def _timed(fn: Callable[[], Any], device: str) -> float:
    start = time.perf_counter()
    fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def measure(device: str, size_bytes: int) -> dict[str, Any]:
    width = int(math.isqrt(size_bytes // 4))   # a square Linear without bias: size_bytes
    repo = short_tmpdir("zsunload")
    try:
        cfg = {**linear_config("big", n_in=width, n_out=width, mbs=1),
               "warmup": {"batch_sizes": [1]}}
        write_model(repo, "big", 1, f"nn.Linear({width}, {width}, bias=False)", cfg)
        source, used = used_probe(device)
        worker = Worker("ipc:///nonexistent", "suite/0", device=device,
                        host_cache_bytes=2 * size_bytes)
        msg = p.LoadModel("big", 1, str(repo / "big" / "1"), cfg)
        before = used()
        first = worker.loader.load_version(msg)
        assert first.ok, first.error
        loaded_used = used()
        worker.loader.unload_version("big", 1)   # parked in host memory
        after = used()
        msg = p.LoadModel("big", 1, msg.path, cfg, sha256=first.sha256)
        move_back_s = _timed(lambda: worker.loader.load_version(msg), device)
        hits = worker.loader.host_cache.hits
        worker.loader.unload_version("big", 1)
        final = used()
        recycle = worker.loader.recycle_reason
        weights = torch.jit.load(str(repo / "big" / "1" / "model.pt"), map_location="cpu")

        def plain() -> float:   # from ordinary (pageable) host memory, each time
            weights.to("cpu")
            return _timed(lambda: weights.to(device), device)
        plain_s = min(plain() for _ in range(2)) if device.startswith("cuda") else None
        weights.to("cpu")   # off the device before anything else measures it
    finally:
        shutil.rmtree(repo, ignore_errors=True)
    excess = after - before
    return {"size_bytes": width * width * 4, "memory_source": source,
            "used_before_load_bytes": before, "used_loaded_bytes": loaded_used,
            "used_after_unload_bytes": after, "used_at_the_end_bytes": final,
            "unload_excess_pct": round(100 * excess / before, 2) if before else None,
            "unload_excess_of_model_pct": round(100 * excess / (width * width * 4), 2),
            "host_tier_hits": hits, "move_back_s": round(move_back_s, 4),
            "plain_to_device_s": None if plain_s is None else round(plain_s, 4),
            "move_back_ratio": round(move_back_s / plain_s, 2) if plain_s else None,
            "recycle_reason": recycle,
            "notes": [] if device.startswith("cuda") else
            ["on a CPU the tier keeps the weights where they are: no move to time"]}
