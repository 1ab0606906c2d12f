"""The worker's host-memory tier in a real server: three to five 8 MB models on one worker whose
budget holds two, asked in turn so that each request evicts one. An evicted version is
parked in host memory and its next load is a move back (the worker's debug log says so) that
answers its own numbers; the parked bytes never exceed --host-cache-bytes; a version
whose file changed on disk is loaded from disk, never served from the park."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pytest

from tests.conftest import Server, linear_config, short_tmpdir, wait_for, write_model
from zeroserve.broker.client import Client

pytestmark = pytest.mark.timeout(120)

# 8.06 MB of weights each; the worker's context (about 22 MB here: its first convolution,
# batch norm and pooling included) and 2 of them fit, not 3 (46.6 MB)
BUDGET = 44_000_000
X = np.ones((1, 4), np.float32)
PARKED = re.compile(r"unloaded (m\d)/1 .*parked in host memory, (\d+) of (\d+) bytes")
FROM_HOST = re.compile(r"loaded (m\d)/1 \(sha256 \w+, [\d.]+ MB, [\d.]+s, from host memory\)")
FROM_DISK = re.compile(r"loaded (m\d)/1 \(sha256 \w+, [\d.]+ MB, [\d.]+s\)")


def factory(ident: int) -> str:
    return (f"(lambda s: (nn.init.zeros_(s[-1].weight), nn.init.constant_(s[-1].bias, "
            f"{ident}.0), s)[-1])(nn.Sequential(nn.Linear(4, 2000), nn.Linear(2000, 1000), "
            "nn.Linear(1000, 3)))")


@pytest.fixture
def repo() -> Iterator[Path]:
    repo = short_tmpdir("zsrepo")
    for i in range(5):
        write_model(repo, f"m{i}", 1, factory(i), linear_config(f"m{i}"))
    yield repo
    shutil.rmtree(repo, ignore_errors=True)


def serve_with(serve: Callable[..., Server], repo: Path, cache_bytes: int) -> Server:
    return serve(repo, extra=["--memory-budget", str(BUDGET), "--load-on-demand",
                              "--load-on-demand-min-residency-s", "0",
                              "--load-on-demand-residency-factor", "0",
                              "--host-cache-bytes", str(cache_bytes),
                              "--log-level", "debug"])   # each park and move back


def ask(srv: Server, names: list[str]) -> list[float]:
    with Client(srv.frontend, timeout_s=60) as c:
        return [float(c.infer(n, {"input": X}, timeout_ms=60_000).outputs["output"][0, 0])
                for n in names]


def test_an_evicted_version_comes_back_from_host_memory_with_its_own_numbers(
        repo: Path, serve: Callable[..., Server]) -> None:
    srv = serve_with(serve, repo, 64 << 20)
    names = [f"m{i % 3}" for i in range(12)]
    assert ask(srv, names) == [float(n[1:]) for n in names]
    log = srv.log()
    back = FROM_HOST.findall(log)
    assert len(back) >= 6, log[-3000:]
    assert set(FROM_DISK.findall(log)) == {"m0", "m1", "m2"}, "each read from disk once"
    assert len(FROM_DISK.findall(log)) == 3, log[-3000:]


def test_the_parked_bytes_never_exceed_the_bound(
        repo: Path, serve: Callable[..., Server]) -> None:
    srv = serve_with(serve, repo, 22_000_000)   # two 8 MB versions, not three
    # in turn over five, two loaded and two parked: the one asked is never held and
    # each comes from disk; then the one evicted last but one is asked: from the park
    # (an eviction's unload parks the version going out before the load comes in)
    names = [f"m{i % 5}" for i in range(15)] + ["m2"]
    assert ask(srv, names) == [float(n[1:]) for n in names]
    log = srv.log()
    parks = [(int(held), int(bound)) for _, held, bound in PARKED.findall(log)]
    assert len(parks) >= 10, log[-3000:]
    assert all(0 < held <= bound == 22_000_000 for held, bound in parks), parks
    assert max(held for held, _ in parks) > 11_000_000, "two were parked at once"
    assert len(FROM_DISK.findall(log)) == 15 and FROM_HOST.findall(log) == ["m2"], \
        log[-3000:]


def test_a_version_changed_on_disk_is_never_served_from_the_park(
        repo: Path, serve: Callable[..., Server]) -> None:
    srv = serve_with(serve, repo, 64 << 20)
    assert ask(srv, ["m0", "m1", "m2"]) == [0.0, 1.0, 2.0]
    wait_for(lambda: any(m == "m0" for m, _, _ in PARKED.findall(srv.log())), 20,
             "m0 to be parked")
    # the same folder, new content: written beside, then renamed over the old file
    other = short_tmpdir("zsother")
    try:
        write_model(other, "m0", 1, factory(7), linear_config("m0"))
        os.replace(other / "m0" / "1" / "model.pt", repo / "m0" / "1" / "model.pt")
    finally:
        shutil.rmtree(other, ignore_errors=True)
    assert ask(srv, ["m0"]) == [7.0], srv.log()[-3000:]
    assert ask(srv, ["m1", "m2", "m0"]) == [1.0, 2.0, 7.0]
