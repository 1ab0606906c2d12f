"""The device suite (tests/gpu/suite.py) on a host without a CUDA device, as CI runs it:
it runs, says by name which device parts it skipped and why, keeps its budget, and its
reports have their shape."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT
from tests.gpu import report, suite

pytestmark = pytest.mark.skipif(
    bool(list(Path("/dev").glob("nvidia[0-9]*"))), reason="a GPU host runs the suite itself")


def run_suite(out: Path, *args: str) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "tests.gpu.suite", "--out", str(out), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads((out / "suite.json").read_text())  # type: ignore[no-any-return]


def test_without_a_gpu_the_suite_runs_and_skips_every_device_part_by_name(tmp_path: Path
                                                                         ) -> None:
    doc = run_suite(tmp_path, "--budget-s", "60")
    parts = doc["parts"]
    assert list(parts) == [p.name for p in suite.PARTS]
    assert doc["device"] == "cpu" and doc["rehearsal"] is False
    assert doc["wall_s"] <= doc["budget_s"]
    env = parts["environment"]
    assert env["status"] == "ran", env
    assert env["figures"]["torch"] and env["figures"]["gpu_count"] == 0
    skipped = {n: r["reason"] for n, r in parts.items() if r["status"] == "skipped"}
    device_parts = {p.name for p in suite.PARTS if p.cuda}
    assert set(skipped) == device_parts and {"gpu_tests", "cnn", "bert", "formats", "memory",
                                             "data_path", "load_on_demand"} <= device_parts
    assert all(why.startswith("no CUDA device") for why in skipped.values()), skipped
    text = (tmp_path / "suite.md").read_text()
    assert text == report.markdown(doc)
    for name in device_parts:
        assert f"| {name} | skipped | - | no CUDA device on this host" in text, name
    assert f"torch {env['figures']['torch']}" in text


def test_every_part_the_suite_plans_is_one_the_parts_module_runs() -> None:
    """A part named in one file and not the other fails on the device, not here: the
    suite would start ``tests.gpu.parts NAME`` and get argparse's refusal."""
    from tests.gpu import parts

    assert [p.name for p in suite.PARTS] == list(parts.PARTS)
    assert "generation" in parts.PARTS


def test_what_does_not_fit_in_the_budget_is_left_out_and_said(tmp_path: Path) -> None:
    doc = run_suite(tmp_path, "--budget-s", "8", "--only", "gpu_tests")
    assert list(doc["parts"]) == ["environment", "gpu_tests"]
    env = doc["parts"]["environment"]
    assert env["status"] == "skipped" and env["reason"].startswith("does not fit: about 15 s")
    assert not (tmp_path / "environment.json").exists()   # never started


def test_a_part_past_its_share_is_cut_and_the_suite_ends_in_time(tmp_path: Path) -> None:
    """The environment part alone takes seconds (two imports of torch): given one, it is
    stopped, and the suite goes on."""
    part = suite.Part("environment", 1, "a part that runs past its share", cuda=False)
    started = time.monotonic()
    got = suite.run_part(part, "cpu", True, tmp_path, timeout_s=1.0)
    assert got["status"] == "cut" and got["reason"] == "ran past its 1 s (budget)", got
    assert time.monotonic() - started < suite.GRACE_S


def test_the_data_path_phases_time_the_workers_own_batch_on_the_cpu() -> None:
    """The part a GPU session measures before and after a data path change, run here so
    that a change to the worker's batching breaks it in CI, not on the device."""
    from tests.gpu import datapath

    got = datapath.measure("cpu", reps=2)
    assert set(got) == {"cnn b=1", "cnn b=16", "mlp b=1", "mlp b=64"}
    for key, phases in got.items():
        assert phases["rows"] == int(key.split("=")[1])
        assert phases["assembly_ms"] > 0 and phases["compute_ms"] > 0, phases
        assert set(phases["worker_phases_ms"]) == {"input", "infer", "output"}, phases
        assert "h2d_pinned_ms" not in phases   # a device's phase: none on a CPU


def test_the_unload_figures_come_from_the_workers_own_unload_on_the_cpu() -> None:
    from tests.gpu import unload

    got = unload.measure("cpu", 16 << 20)   # a square Linear: 2048 x 2048 floats
    assert got["size_bytes"] == 16 << 20 and got["host_tier_hits"] == 1
    assert got["recycle_reason"] == "" and got["move_back_ratio"] is None
    assert got["memory_source"] == "resident memory (CPU)"


def test_where_zeroserve_is_importable_the_parts_get_the_environment_as_it_is(
        tmp_path: Path) -> None:
    assert suite.part_environment(tmp_path) == dict(os.environ)
    assert not (tmp_path / "pythonpath").exists()


def test_where_zeroserve_is_not_installed_a_link_to_this_tree_stands_in(tmp_path: Path
                                                                        ) -> None:
    """A bare copy of the tree on a device machine: the interpreter this venv was made
    from has no zeroserve."""
    base = str(Path(sys.base_prefix) / "bin" / "python3")
    probe = subprocess.run([base, "-c", "import zeroserve"], capture_output=True)
    if probe.returncode == 0:
        pytest.skip(f"{base} has zeroserve installed")
    env = suite.part_environment(tmp_path, base)
    got = subprocess.run([base, "-c", "import zeroserve.broker as b; print(b.__file__)"],
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert got.returncode == 0, got.stderr
    assert Path(got.stdout.strip()).resolve() == ROOT / "broker" / "__init__.py"
