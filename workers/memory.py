"""What a worker measures for the broker's memory planning (see models/footprint.py):
the fixed cost of its device, measured once at start, and the peak memory of each
warm-up batch, from which the per-sample activation term is learned.

On a GPU both come from torch's CUDA allocator and ``mem_get_info``; on a CPU from the
process's resident memory, with the kernel's high-water mark (``VmHWM``, reset by
writing 5 to ``/proc/self/clear_refs``) catching a batch's peak even when its buffers
are returned to the system before the batch ends. Both are process-wide: a batch of
another model running at the same time on the compute thread counts too, so a
warm-up during heavy traffic can overstate the activation term. On a CPU a batch can
also reuse free pages the process holds already, which no high-water mark sees: freed
heap memory is given back (``malloc_trim``) before each measured batch, and what glibc
keeps even so makes a CPU peak read up to ~15 % low (tests/workers/test_memplan.py).
"""

from __future__ import annotations

import ctypes
import io
import logging
import resource
import threading
from pathlib import Path
from typing import Any, Callable

import torch

from zeroserve.broker.process import trim_memory
from zeroserve.models import formats
from zeroserve.models.repository import ModelConfig

logger = logging.getLogger(__name__)

# kept free on a GPU when the worker is not told otherwise: cuBLAS/cuDNN workspaces and
# kernels loaded lazily by later models come out of memory no model accounts for
DEFAULT_GPU_HEADROOM_BYTES = 512 << 20


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return 0


def proc_bytes(path: str, key: str) -> int | None:
    """A ``key: N kB`` line of a /proc file, in bytes; None where there is none."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _hwm_bytes() -> int | None:
    return proc_bytes("/proc/self/status", "VmHWM")


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakProbe:
    """``start()`` before a batch, ``stop()`` after it: the peak bytes above the level
    at ``start``."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.cuda = device.startswith("cuda")
        self._base = 0
        self._hwm = False

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = int(torch.cuda.memory_allocated(self.device))
            return
        # freed heap memory back to the system first, or the batch would reuse pages the
        # process holds already and its peak would not show in the high-water mark
        trim_memory()
        self._hwm = _reset_hwm()
        self._base = rss_bytes()

    def stop(self) -> int:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            return max(0, int(torch.cuda.max_memory_allocated(self.device)) - self._base)
        peak = _hwm_bytes() if self._hwm else None
        return max(0, (peak if peak is not None else rss_bytes()) - self._base)


def settled(probe: Callable[[], int], device: str) -> Callable[[], int]:
    """``probe`` after giving freed heap memory back (CPU): a version loaded where an
    unloaded one was would otherwise reuse its pages and seem to cost nothing."""
    if device.startswith("cuda"):
        return probe

    def measure() -> int:
        trim_memory()
        return probe()
    return measure


def _nvml_used(index: int) -> int | None:
    """Device memory in use (all processes) from the driver's NVML, before this process
    makes a CUDA context; None without NVML."""
    class MemInfo(ctypes.Structure):
        _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong),
                    ("used", ctypes.c_ulonglong)]
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        handle = ctypes.c_void_p()
        info = MemInfo()
        if nvml.nvmlInit_v2() != 0:
            return None
        try:
            if nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) != 0 \
                    or nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(info)) != 0:
                return None
            return int(info.used)
        finally:
            nvml.nvmlShutdown()
    except (OSError, AttributeError):
        return None


def _first_ops(device: str) -> None:
    """A first TorchScript load and a first linear and convolution: the runtime's one-time
    allocations (interpreter, thread pools, kernel caches), which no model should carry."""
    buf = io.BytesIO()
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), buf)
    buf.seek(0)
    module = torch.jit.load(buf, map_location=device)
    with torch.inference_mode():
        module(torch.ones(1, 2, device=device))
        x = torch.ones(4, 8, device=device)
        torch.nn.functional.linear(x, torch.ones(4, 8, device=device))
        # on a CPU, a convolution large enough for oneDNN: its first one costs the process
        # 7-9 MB, which the first convolutional model loaded was charged (the bundled cnn
        # measured 17.7 MB of overhead loaded first, 5.9 MB after another)
        image = (16, 3, 64, 64) if device == "cpu" else (1, 3, 8, 8)
        features = torch.nn.functional.conv2d(
            torch.ones(*image, device=device),
            torch.ones(32 if device == "cpu" else 4, 3, 3, 3, device=device), padding=1)
        if device == "cpu":   # and the first batch norm and pooling (about 2 MB more)
            channels = torch.ones(features.shape[1])
            torch.nn.functional.adaptive_avg_pool2d(torch.nn.functional.batch_norm(
                features, channels, channels), 1)


# The threads of a worker that run models: the main thread, the loader's (warm-ups) and
# the compute thread's (batches). Each takes a cuBLAS handle of its own, and each handle
# a workspace from the caching allocator that it keeps for the life of the process
# (33.6 MB on an H200 with torch 2.11: 32 MiB for cuBLAS, 1 MiB for cuBLASLt). Unless
# the context holds them, the first model a thread warms up is measured with one
# (8.2 MB of weights measured 42.8 MB) and the first batch takes one unplanned.
MODEL_THREADS = 3


def _first_ops_on_model_threads(device: str) -> None:
    """The first operations on the main thread and on :data:`MODEL_THREADS` - 1 others
    at once, so each holds a handle of its own: a thread that ends gives its handle, and
    the workspace kept for it, to the next thread that asks, the worker's own ones."""
    others = MODEL_THREADS - 1
    together = threading.Barrier(others)

    def first() -> None:
        try:
            _first_ops(device)
        finally:
            try:
                together.wait(timeout=60)
            except threading.BrokenBarrierError:
                pass
    threads = [threading.Thread(target=first, name=f"first-ops-{i}") for i in range(others)]
    _first_ops(device)
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def context_cost(device: str) -> dict[str, Any]:
    """The device's fixed cost to this process, once, before any model: on a GPU the
    CUDA context and the BLAS workspaces of the threads that run models (device memory
    in use after a first kernel on each, less the allocator's free pool and what other
    processes held before, per NVML; without NVML the process is taken to be alone on
    the device); on a CPU the resident memory the first operations add."""
    if not device.startswith("cuda"):
        trim_memory()
        before = rss_bytes()
        _first_ops(device)
        trim_memory()
        return {"context_bytes": max(0, rss_bytes() - before), "context_method": "rss"}
    index = torch.device(device).index or 0
    others = _nvml_used(index)
    _first_ops_on_model_threads(device)
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    pooled = int(torch.cuda.memory_reserved(device)) - int(torch.cuda.memory_allocated(device))
    used = int(total - free) - pooled - (others or 0)
    return {"context_bytes": max(0, used),
            "context_method": "nvml" if others is not None else "alone on the device"}


def _first_export() -> None:
    """torch.export's runtime, as a first exported program's load brings it in: a tiny
    program exported, saved, loaded and run."""
    program = torch.export.export(torch.nn.Linear(2, 2), (torch.ones(1, 2),))
    buf = io.BytesIO()
    torch.export.save(program, buf)
    buf.seek(0)
    with torch.inference_mode():
        torch.export.load(buf).module()(torch.ones(1, 2))


# what loads each runtime a format names (models/formats.py Format.runtime)
RUNTIMES: dict[str, Callable[[], None]] = {formats.EXPORT_RUNTIME: _first_export}


def load_runtime(context: dict[str, Any], cfg: ModelConfig, version_dir: Path,
                 probe: Callable[[], int]) -> None:
    """Before a version's load is measured: load its format's runtime if this process
    has not, and count what that took (``probe``: the worker's memory) in the context
    (``runtimes``: bytes by name), which the worker reports and the broker plans with.
    Else the first version of the format carries it (an exported mlp of 5.3 MB of
    weights measured 104 MB) and teaches every later prediction of the model that."""
    try:
        runtime = formats.identify(cfg.platform, version_dir / cfg.model_file).runtime
    except (formats.FormatError, KeyError):
        return
    loader = RUNTIMES.get(runtime)
    if loader is None or runtime in context.get("runtimes", {}):
        return
    before = probe()
    try:
        loader()
    except Exception:  # the version's own load says what is wrong
        logger.exception("loading the %s runtime failed", runtime)
    cost = max(0, probe() - before)
    # replaced, not changed in place: the main thread reports the context meanwhile
    context["runtimes"] = {**context.get("runtimes", {}), runtime: cost}
    context["context_bytes"] = int(context.get("context_bytes", 0)) + cost
    logger.info("loaded the %s runtime: %.1f MB, counted in the context", runtime, cost / 1e6)


def device_report(device: str, budget_bytes: int, headroom_bytes: int | None,
                  context: dict[str, Any]) -> dict[str, Any]:
    """What the broker plans with, in READY and every heartbeat: the device, its free
    memory now (GPU), the headroom to keep, the context cost."""
    cuda = device.startswith("cuda")
    headroom = headroom_bytes if headroom_bytes is not None and headroom_bytes >= 0 \
        else (DEFAULT_GPU_HEADROOM_BYTES if cuda else 0)
    out: dict[str, Any] = {"device": device, "budget_bytes": budget_bytes,
                           "headroom_bytes": headroom, **context}
    if cuda:
        free, total = torch.cuda.mem_get_info(device)
        out.update(gpu_free_bytes=int(free), gpu_total_bytes=int(total),
                   gpu_used_bytes=int(torch.cuda.memory_allocated(device)),
                   gpu_reserved_bytes=int(torch.cuda.memory_reserved(device)))
    return out
