"""``zeroserve serve --devices``: the device map resolved into each worker's environment
and id, with two workers on one device (on a CPU host, the map is what they are given;
torch there finds no device and runs them on the CPU)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.conftest import ROOT, Server, short_tmpdir, wait_for
from zeroserve.broker.client import Client
from zeroserve.broker.runtime import hostname


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode().split("=", 1) for e in raw if b"=" in e)


def test_two_workers_share_one_device_each_under_its_own_id(tiny_repo: Path) -> None:
    srv = Server(tiny_repo, workers=2, extra=["--devices", "0,0"]).wait_ready()
    try:
        with Client(srv.control, timeout_s=10) as c:
            def holding() -> list[dict[str, Any]] | None:
                held = [w for w in c.control("status")["workers"] if "linear/1" in w["models"]]
                return held if len(held) == 2 else None
            workers = wait_for(holding, 60, "both workers to hold linear")
        assert sorted(w["id"] for w in workers) == [f"{hostname()}/0", f"{hostname()}/1"]
        for w in workers:
            assert environ(w["pid"]).get("CUDA_VISIBLE_DEVICES") == "0", w["id"]
        assert sorted(srv.pids("worker")) == sorted(w["pid"] for w in workers)
    finally:
        srv.stop()


def test_serve_refuses_a_map_that_does_not_match_the_workers() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bin" / "zeroserve"), "serve", "--runtime-dir",
         str(short_tmpdir("zsrt")), "--devices", "0,0", "--workers", "3"],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "--devices names 2 device(s), one per worker, but --workers asks for 3" \
        in proc.stderr
