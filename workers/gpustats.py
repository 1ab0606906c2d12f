"""A worker's device as its driver sees it (NVML, through the optional ``nvidia-ml-py``
package, the ``gpu`` extra): utilization and memory, for heartbeats, metrics, ``zeroserve
status`` and the replica controller.

Torch's figures are the process's own allocations; the driver's count every process on
the device, the CUDA context included, and say how busy it was. Without the package, a
driver, a GPU, or on a device NVML will not name, there is no reading: never an error.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from zeroserve.broker.process import RateLimitedLog

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuReading:
    """One look at the device. ``utilization`` is the share (0..1) of the driver's last
    sample period (1/6 s to 1 s) in which a kernel ran; None where the driver does not
    report it (a MIG slice)."""

    utilization: float | None
    memory_used_bytes: int
    memory_total_bytes: int

    def report(self) -> dict[str, Any]:
        """Its form in a heartbeat (``memory["gpu"]``) and in ``zeroserve status``."""
        return {"utilization": self.utilization, "memory_used_bytes": self.memory_used_bytes,
                "memory_total_bytes": self.memory_total_bytes}


def reading(utilization_percent: int | None, memory_used_bytes: int,
            memory_total_bytes: int) -> GpuReading:
    """The values NVML returns (``nvmlUtilization_t.gpu`` in percent, ``nvmlMemory_t``'s
    ``used`` and ``total`` in bytes) as a reading; ValueError for values no driver gives,
    so a binding that changed its units is caught rather than reported."""
    if utilization_percent is not None and not 0 <= utilization_percent <= 100:
        raise ValueError(f"GPU utilization {utilization_percent}% is not a percentage")
    if memory_total_bytes <= 0 or not 0 <= memory_used_bytes <= memory_total_bytes:
        raise ValueError(f"GPU memory {memory_used_bytes} used of {memory_total_bytes} bytes")
    return GpuReading(None if utilization_percent is None else utilization_percent / 100,
                      int(memory_used_bytes), int(memory_total_bytes))


def _names(device_uuid: str) -> list[str]:
    """The names NVML may know this CUDA device by: the worker's own
    ``CUDA_VISIBLE_DEVICES`` entry when it is a UUID (``GPU-...``, ``MIG-...``), then
    torch's UUID as a whole GPU's and as a MIG slice's."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    own = [visible] if visible.startswith(("GPU-", "MIG-")) else []
    return own + [f"GPU-{device_uuid}", f"MIG-{device_uuid}"]


class DriverView:
    """One device's NVML handle, opened once; :meth:`read` answers a reading or None."""

    def __init__(self, nvml: Any, handle: Any) -> None:
        self._nvml = nvml
        self._handle = handle
        self._failed = RateLimitedLog(logger, per_s=1 / 60)
        try:   # asked once: a MIG slice has none, and says so every time
            nvml.nvmlDeviceGetUtilizationRates(handle)
            self.has_utilization = True
        except nvml.NVMLError:
            self.has_utilization = False

    @classmethod
    def open(cls, device: str) -> DriverView | None:
        """The view of a ``cuda`` device, or None: a CPU device, no ``nvidia-ml-py``, no
        driver, or a device NVML does not name."""
        if not device.startswith("cuda"):
            return None
        try:
            import pynvml   # the optional gpu extra (nvidia-ml-py)
        except ImportError:
            logger.info("no GPU signals: nvidia-ml-py is not installed (the gpu extra)")
            return None
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            logger.info("no GPU signals: NVML did not start (%s)", exc)
            return None
        import torch   # only once NVML runs: the device's UUID names it to the driver

        try:
            uuid = str(torch.cuda.get_device_properties(device).uuid)
        except (RuntimeError, AttributeError, AssertionError) as exc:   # a torch without it
            logger.info("no GPU signals: no UUID for %s from torch (%s)", device, exc)
            pynvml.nvmlShutdown()
            return None
        for name in _names(uuid):
            try:
                return cls(pynvml, pynvml.nvmlDeviceGetHandleByUUID(name))
            except pynvml.NVMLError:
                continue
        logger.info("no GPU signals: NVML knows %s by none of %s", device, _names(uuid))
        pynvml.nvmlShutdown()
        return None

    def read(self) -> GpuReading | None:
        nvml = self._nvml
        try:
            mem = nvml.nvmlDeviceGetMemoryInfo(self._handle)
            percent = nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu \
                if self.has_utilization else None
            return reading(percent, mem.used, mem.total)
        except (nvml.NVMLError, ValueError) as exc:
            self._failed.log(logging.WARNING, "no GPU signals this time: %s", exc)
            return None
