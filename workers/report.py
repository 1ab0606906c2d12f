"""What a worker tells the broker of itself, from its main thread: the memory planner's
inputs (in READY and every heartbeat), its device as the driver sees it, and its metrics."""

from __future__ import annotations

from typing import Any

import torch
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from zeroserve.broker import protocol as p
from zeroserve.workers import gpustats, memory
from zeroserve.workers.loaded import LoadedModels
from zeroserve.workers.memory import rss_bytes


class Report:
    def __init__(self, models: LoadedModels, device: str, registry: CollectorRegistry, *,
                 memory_budget_bytes: int, memory_headroom_bytes: int | None) -> None:
        self.models = models
        self.device = device
        self.registry = registry
        self.memory_budget_bytes = memory_budget_bytes
        self.memory_headroom_bytes = memory_headroom_bytes
        self.context = memory.context_cost(device)  # once, before any model
        self.driver = gpustats.DriverView.open(device)   # None: no GPU signals
        r = registry
        self.m_memory = Gauge("zeroserve_worker_memory_bytes", "Worker resident memory",
                              registry=r)
        self.m_gpu = Gauge("zeroserve_gpu_memory_used_bytes", "CUDA memory allocated",
                           registry=r) if device.startswith("cuda") else None
        # the driver's view (NVML): series only where it answers, never a made-up 0
        driver = self.driver
        self.m_gpu_driver = None if driver is None else Gauge(
            "zeroserve_gpu_driver_memory_bytes", "Device memory as the driver sees it "
            "(NVML): used by every process, the CUDA context included, and the total",
            ["kind"], registry=r)
        self.m_gpu_busy = Gauge(
            "zeroserve_gpu_utilization_ratio", "Share of the driver's last sample period "
            "in which a kernel ran on the worker's device (NVML)", registry=r) \
            if driver is not None and driver.has_utilization else None

    def plan(self) -> dict[str, Any]:
        """The memory planner's inputs (READY and heartbeats): device, headroom, context,
        and what each loaded version measured."""
        report = memory.device_report(self.device, self.memory_budget_bytes,
                                      self.memory_headroom_bytes, self.context)
        report["models"] = {f"{m}/{v}": lm.memory_bytes for (m, v), lm in self.models.items()}
        report["plans"] = {f"{m}/{v}": lm.plan for (m, v), lm in self.models.items()
                           if lm.plan}
        return report

    def heartbeat(self) -> p.WorkerHeartbeat:
        rss = rss_bytes()
        self.m_memory.set(rss)
        report = self.plan()
        report.update(rss_bytes=rss, free_bytes=self._free_bytes(report["models"]))
        if self.m_gpu is not None:
            self.m_gpu.set(report["gpu_used_bytes"])
        seen = self.driver.read() if self.driver is not None else None
        if seen is not None and self.m_gpu_driver is not None:
            report["gpu"] = seen.report()
            self.m_gpu_driver.labels("used").set(seen.memory_used_bytes)
            self.m_gpu_driver.labels("total").set(seen.memory_total_bytes)
            if self.m_gpu_busy is not None and seen.utilization is not None:
                self.m_gpu_busy.set(seen.utilization)
        return p.WorkerHeartbeat(report, generate_latest(self.registry).decode())

    def _free_bytes(self, footprints: dict[str, int]) -> int:
        """What is left for models: of the budget when one is set, else of the device."""
        if self.memory_budget_bytes:
            return max(0, self.memory_budget_bytes - sum(footprints.values()))
        if self.device.startswith("cuda"):
            return int(torch.cuda.mem_get_info()[0])
        return memory.proc_bytes("/proc/meminfo", "MemAvailable") or 0
