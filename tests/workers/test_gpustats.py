"""A worker's device as its driver sees it (workers/gpustats.py): NVML's values read
through the one seam that takes them, and the path every host without a GPU takes,
for real."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from zeroserve.broker.admin import gpu_columns
from zeroserve.workers.gpustats import DriverView, GpuReading, reading

NO_DRIVER = not list(Path("/dev").glob("nvidia[0-9]*"))


def test_nvml_values_become_a_reading_in_shares_and_bytes() -> None:
    got = reading(87, 3 << 30, 80 << 30)
    assert got == GpuReading(0.87, 3 << 30, 80 << 30)
    assert got.report() == {"utilization": 0.87, "memory_used_bytes": 3 << 30,
                            "memory_total_bytes": 80 << 30}
    assert reading(None, 0, 10 << 30).utilization is None   # a MIG slice keeps none
    assert reading(0, 1, 1).utilization == 0.0 and reading(100, 1, 1).utilization == 1.0


@pytest.mark.parametrize("values, why", [
    ((101, 1, 2), "not a percentage"), ((-1, 1, 2), "not a percentage"),
    ((50, 3, 2), "3 used of 2 bytes"), ((50, -1, 2), "-1 used"), ((50, 0, 0), "0 used of 0")])
def test_values_no_driver_gives_are_refused_not_reported(values: tuple[int, int, int],
                                                         why: str) -> None:
    with pytest.raises(ValueError, match=why):
        reading(*values)


def test_a_cpu_worker_has_no_driver_view() -> None:
    assert DriverView.open("cpu") is None


@pytest.mark.skipif(not NO_DRIVER, reason="this host has an NVIDIA driver")
def test_without_a_driver_a_cuda_device_has_no_view_and_no_error() -> None:
    """nvidia-ml-py is installed (the test extra) and NVML finds no library here."""
    pytest.importorskip("pynvml")
    assert DriverView.open("cuda:0") is None


def test_without_nvidia_ml_py_a_cuda_device_has_no_view_and_no_error() -> None:
    code = ("import sys; sys.modules['pynvml'] = None\n"   # as if not installed
            "from zeroserve.workers.gpustats import DriverView\n"
            "print(DriverView.open('cuda:0'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "None"


def test_status_shows_the_drivers_view_or_dashes() -> None:
    whole = gpu_columns(reading(87, 3_000_000_000, 80_000_000_000).report())
    assert whole.split() == ["87%", "3000/80000"]
    assert gpu_columns(reading(None, 5_000_000_000, 10_000_000_000).report()).split() == \
        ["-", "5000/10000"]
    assert gpu_columns(None).split() == ["-", "-"]
