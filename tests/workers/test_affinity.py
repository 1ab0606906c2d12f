"""Pinning CPU workers: the core lists, the plan, and real workers started pinned (every
thread of the process, ZeroMQ's and torch's included, on the planned cores)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, Server, http, linear_config, short_tmpdir, wait_for, \
    write_model
from zeroserve.broker.client import Client
from zeroserve.workers import affinity
from zeroserve.workers.serve import pinning

USABLE = sorted(os.sched_getaffinity(0))


@pytest.mark.parametrize("text, cpus", [
    ("0", {0}), ("0-3,6", {0, 1, 2, 3, 6}), (" 2 , 4-5", {2, 4, 5}), ("3-3", {3}),
])
def test_cpu_lists_parse(text: str, cpus: set[int]) -> None:
    assert affinity.parse_cpus(text) == cpus


@pytest.mark.parametrize("text", ["", "a", "1-", "-1", "3-1", "1,,2", "1.5"])
def test_bad_cpu_lists_say_why(text: str) -> None:
    with pytest.raises(ValueError, match="bad CPU list"):
        affinity.parse_cpus(text)


def test_the_plan_gives_each_worker_its_own_cores_from_the_top() -> None:
    assert affinity.plan(1, 1, [0, 1]) == [[1]]
    assert affinity.plan(2, 1, [1, 0]) == [[1], [0]]
    assert affinity.plan(2, 2, [0, 1, 2, 3, 4]) == [[3, 4], [1, 2]]
    assert affinity.plan(1, 3, [4, 8, 9, 12]) == [[8, 9, 12]]


def test_no_plan_when_threads_outnumber_the_cores() -> None:
    assert affinity.plan(3, 1, [0, 1]) is None
    assert affinity.plan(1, 3, [0, 1]) is None
    assert affinity.plan(0, 1, [0, 1]) is None


def thread_cpus(pid: int) -> dict[str, set[int]]:
    """Each thread's allowed cores, from /proc (what the kernel enforces)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                out[task.name] = affinity.parse_cpus(line.split(":", 1)[1].strip())
    return out


@pytest.mark.timeout(120)
def test_serve_pins_each_worker_and_every_thread_it_starts() -> None:
    repo = short_tmpdir("zsrepo")
    write_model(repo, "linear", 1, "nn.Linear(4, 3)", linear_config("linear"))
    n = min(2, len(USABLE))
    srv = Server(repo, workers=n, extra=["--pin-workers"]).wait_ready()
    try:
        expected = affinity.plan(n, 1, USABLE)
        assert expected is not None

        def registered() -> int:   # a worker pins itself before it connects
            with Client(srv.control, timeout_s=5) as c:
                return len(c.control("status")["workers"])
        wait_for(lambda: registered() == n, 60, f"{n} workers registered")
        pids = srv.pids("worker")
        assert len(pids) == n
        seen = []
        for pid in pids:
            threads = thread_cpus(pid)
            assert len(threads) >= 3   # main, compute, loader, ZeroMQ's I/O thread
            cores = {frozenset(c) for c in threads.values()}
            assert len(cores) == 1, threads
            seen.append(sorted(cores.pop()))
        assert sorted(seen) == sorted(expected)
        for role in ("broker", "gateway"):   # left to the scheduler
            (pid,) = srv.pids(role)
            assert all(c == set(USABLE) for c in thread_cpus(pid).values())
        body = json.dumps({"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32",
                                       "data": [1.0, 2.0, 3.0, 4.0]}]}).encode()
        status, _, answer = http("POST", srv.url + "/v2/models/linear/infer", body)
        assert status == 200, answer   # pinned workers serve
    finally:
        srv.stop()


def test_a_worker_refuses_cores_it_may_not_use() -> None:
    outside = max(USABLE) + 1024
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bin" / "zeroserve"), "worker", "--runtime-dir",
         str(short_tmpdir("zsrt")), "--cpus", str(outside)],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert f"--cpus {outside}" in proc.stderr


def test_a_worker_refuses_a_bad_core_list() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bin" / "zeroserve"), "worker", "--runtime-dir",
         str(short_tmpdir("zsrt")), "--cpus", "2-1"],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "runs backwards" in proc.stderr


def test_serve_pins_only_cpu_workers_that_fit() -> None:
    assert pinning(False, 1, 1, 0) is None
    assert pinning(True, 1, 1, 1) is None                       # a GPU host
    assert pinning(True, len(USABLE) + 1, 1, 0) is None
    assert pinning(True, 1, 1, 0) == [[USABLE[-1]]]
