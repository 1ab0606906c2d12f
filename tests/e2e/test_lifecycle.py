"""Model lifecycle end to end: real inotify, real files, real workers.

Versions are made distinguishable: a Linear with zero weights whose bias is the
version number, so every output value says which version computed it."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from zeroserve.broker.client import AsyncClient, Client, InferError
from zeroserve.broker.protocol import ErrorCode
from tests.conftest import Server, linear_config, short_tmpdir, wait_for

pytestmark = pytest.mark.timeout(120)


def save_versioned(folder: Path, value: float) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    module = torch.nn.Linear(4, 3)
    with torch.no_grad():
        module.weight.zero_()
        module.bias.fill_(value)
    torch.jit.save(torch.jit.script(module.eval()), str(folder / "model.pt"))


def publish(repo: Path, name: str, version: int, value: float | None = None) -> float:
    """Write the version in a temp folder, then rename it into place; returns the time."""
    tmp = repo / name / f".tmp-{version}"
    save_versioned(tmp, float(version if value is None else value))
    t = time.monotonic()
    os.rename(tmp, repo / name / str(version))
    return t


@pytest.fixture
def repo():
    path = short_tmpdir("zsrepo")
    save_versioned(path / "m" / "1", 1.0)
    (path / "m" / "config.json").write_text(json.dumps(linear_config("m")))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def models(srv: Server) -> dict[str, Any]:
    with Client(srv.control, timeout_s=5) as c:
        return c.control("models")  # type: ignore[no-any-return]


def status(srv: Server) -> dict[str, Any]:
    with Client(srv.control, timeout_s=5) as c:
        return c.control("status")  # type: ignore[no-any-return]


def serving(srv: Server, version: int, workers: int) -> bool:
    """The version is the routed default and every worker holds it (and no other)."""
    m = models(srv)["models"].get("m")
    if m is None or m["ready"] != [version]:
        return False
    held = [w["models"] for w in status(srv)["workers"]]
    return len(held) == workers and all(h == [f"m/{version}"] for h in held)


def infer(srv: Server, version: int | None = None) -> tuple[int, float]:
    x = np.ones((2, 4), dtype=np.float32)
    with Client(srv.frontend, timeout_s=10) as c:
        res = c.infer("m", {"input": x}, version=version)
    out = res.outputs["output"]
    assert np.all(out == out.flat[0]), "a response mixes versions"
    return res.version, float(out.flat[0])


def test_hot_swap_under_load(repo: Path, serve) -> None:
    srv = serve(repo, workers=2, extra=["--credits", "2", "--watch-debounce-ms", "100"])
    wait_for(lambda: serving(srv, 1, 2), 30, "v1 on both workers")
    seen: dict[int, int] = {}
    failures: list[str] = []
    stop = threading.Event()

    async def load() -> None:
        async with AsyncClient(srv.frontend) as ac:
            assert await ac.wait_connected(5)
            x = np.ones((2, 4), dtype=np.float32)

            async def one() -> None:
                while not stop.is_set():
                    try:
                        res = await ac.infer("m", {"input": x}, timeout_ms=10000)
                    except InferError as exc:
                        failures.append(f"{exc.code}: {exc.message}")
                        continue
                    out = res.outputs["output"]
                    if not np.all(out == float(res.version)):
                        failures.append(f"v{res.version} answered {out.tolist()}")
                    seen[res.version] = seen.get(res.version, 0) + 1

            await asyncio.gather(*(one() for _ in range(16)))

    thread = threading.Thread(target=lambda: asyncio.run(load()))
    start = time.monotonic()
    thread.start()
    flips = []
    try:
        wait_for(lambda: seen.get(1, 0) > 50, 20, "load on v1")
        for version in range(2, 7):
            t0 = publish(repo, "m", version)
            wait_for(lambda: serving(srv, version, 2), 10, f"v{version} on every worker")
            flips.append(time.monotonic() - t0)
            wait_for(lambda: seen.get(version, 0) > 50, 10, f"answers from v{version}")
        wait_for(lambda: time.monotonic() - start >= 10, 30, "10 s of load")
    finally:
        stop.set()
        thread.join(30)
    print(f"\nflip times (rename -> new version serving on both workers): "
          f"{', '.join(f'{f * 1000:.0f} ms' for f in flips)}; answers per version {seen}")
    assert not failures, failures[:5]
    assert set(seen) == {1, 2, 3, 4, 5, 6}
    assert max(flips) < 1.0, f"a flip took {max(flips):.3f} s"
    m = models(srv)["models"]["m"]
    assert m["ready"] == [6] and "last_failure" not in m


def test_a_broken_new_version_leaves_the_old_one_serving(repo: Path, serve) -> None:
    srv = serve(repo)
    wait_for(lambda: serving(srv, 1, 1), 30, "v1")
    tmp = repo / "m" / ".tmp-2"
    tmp.mkdir()
    (tmp / "model.pt").write_bytes(b"this is not a TorchScript archive")
    os.rename(tmp, repo / "m" / "2")
    m = wait_for(lambda: models(srv)["models"]["m"].get("last_failure") and
                 models(srv)["models"]["m"], 20, "the failure to show")
    assert "failed to load m/2" in m["last_failure"]["error"]
    assert m["ready"] == [1] and m["default_version"] == 1
    assert infer(srv) == (1, 1.0)
    assert "m" in models(srv)["errors"]
    with Client(srv.control, timeout_s=5) as c:
        metrics = c.control("metrics")["broker"]
    assert 'zeroserve_model_load_failure_total{model="m"} 1.0' in metrics
    assert "swap to version(s) [2] failed" in srv.log()
    # a fixed version 3 still swaps in afterwards
    publish(repo, "m", 3)
    wait_for(lambda: serving(srv, 3, 1), 20, "v3 after the failure")
    assert "last_failure" not in models(srv)["models"]["m"]


def test_a_slow_in_place_copy_is_never_loaded_truncated(repo: Path, serve) -> None:
    srv = serve(repo)
    wait_for(lambda: serving(srv, 1, 1), 30, "v1")
    src = short_tmpdir("zssrc")
    save_versioned(src, 2.0)
    data = (src / "model.pt").read_bytes()
    shutil.rmtree(src)
    (repo / "m" / "2").mkdir()
    chunks = [data[i:i + len(data) // 4 + 1] for i in range(0, len(data), len(data) // 4 + 1)]
    with open(repo / "m" / "2" / "model.pt", "wb") as f:
        for chunk in chunks:
            f.write(chunk)
            f.flush()
            time.sleep(0.4)  # noqa: sleep-ok (a slow writer: pauses longer than the debounce)
            assert models(srv)["models"]["m"]["ready"] == [1]
    wait_for(lambda: serving(srv, 2, 1), 20, "v2 once the copy is complete")
    assert infer(srv) == (2, 2.0)
    assert all(not w["load_errors"] for w in status(srv)["workers"])
    assert "failed" not in srv.log()


def test_deleting_a_version_and_then_the_model(repo: Path, serve) -> None:
    (repo / "m" / "config.json").write_text(json.dumps(
        linear_config("m", version_policy={"all": True})))
    save_versioned(repo / "m" / "2", 2.0)
    srv = serve(repo)
    wait_for(lambda: models(srv)["models"]["m"]["ready"] == [1, 2], 30, "v1 and v2")
    assert infer(srv, 1) == (1, 1.0)
    shutil.rmtree(repo / "m" / "2")
    wait_for(lambda: models(srv)["models"]["m"]["ready"] == [1], 20, "v2 gone")
    wait_for(lambda: status(srv)["workers"][0]["models"] == ["m/1"], 20, "v2 unloaded")
    with pytest.raises(InferError) as err:
        infer(srv, 2)
    assert err.value.code is ErrorCode.NOT_FOUND
    shutil.rmtree(repo / "m")
    wait_for(lambda: "m" not in models(srv)["models"], 20, "the model removed")
    with pytest.raises(InferError) as err:
        infer(srv)
    assert err.value.code is ErrorCode.NOT_FOUND
    wait_for(lambda: status(srv)["workers"][0]["models"] == [], 20, "everything unloaded")


def test_a_version_changed_in_place_is_reloaded(repo: Path, serve) -> None:
    srv = serve(repo)
    wait_for(lambda: serving(srv, 1, 1), 30, "v1")
    before = models(srv)["models"]["m"]["sha256"]["1"]
    tmp = short_tmpdir("zssrc")
    save_versioned(tmp, 7.0)
    os.replace(tmp / "model.pt", repo / "m" / "1" / "model.pt")  # same version, new bytes
    shutil.rmtree(tmp)
    wait_for(lambda: infer(srv) == (1, 7.0), 20, "the new content of v1")
    assert models(srv)["models"]["m"]["sha256"]["1"] != before
    # the same content written again changes nothing
    swaps = srv.log().count("now serves")
    os.utime(repo / "m" / "1" / "model.pt")
    (repo / "m" / "1" / "model.pt").write_bytes((repo / "m" / "1" / "model.pt").read_bytes())
    publish(repo, "m", 2)
    wait_for(lambda: serving(srv, 2, 1), 20, "v2")
    assert srv.log().count("now serves") == swaps + 1


def test_new_models_appear_and_poll_mode_works(repo: Path, serve) -> None:
    srv = serve(repo, extra=["--watch", "poll", "--watch-interval-s", "0.3"])
    wait_for(lambda: serving(srv, 1, 1), 30, "v1")
    publish(repo, "m", 2)
    wait_for(lambda: serving(srv, 2, 1), 20, "v2 found by polling")
    tmp = repo / ".tmp-n"
    save_versioned(tmp / "1", 5.0)
    (tmp / "config.json").write_text(json.dumps(linear_config("n")))
    os.rename(tmp, repo / "n")
    wait_for(lambda: models(srv)["models"].get("n", {}).get("ready") == [1], 20, "model n")
    with Client(srv.frontend, timeout_s=10) as c:
        res = c.infer("n", {"input": np.ones((1, 4), dtype=np.float32)})
    assert res.outputs["output"].tolist() == [[5.0, 5.0, 5.0]]


LEAKY = '''
import sys


class Model:
    def load(self, version_dir, device):
        # a reference the unload cannot reach: memory that never comes back
        sys.__dict__.setdefault("_leak", []).append(bytearray(96 << 20))

    def predict(self, inputs):
        return {"output": inputs["input"]}
'''


def test_a_worker_whose_memory_does_not_come_back_is_recycled(repo: Path, serve) -> None:
    (repo / "leaky" / "1").mkdir(parents=True)
    (repo / "leaky" / "1" / "model.py").write_text(LEAKY)
    (repo / "leaky" / "config.json").write_text(json.dumps(
        {**linear_config("leaky", n_out=4), "platform": "python"}))
    srv = serve(repo, extra=["--memory-tolerance-bytes", str(32 << 20)])
    wait_for(lambda: models(srv)["models"].get("leaky", {}).get("ready") == [1], 30, "leaky")
    pids = srv.pids("worker")
    shutil.rmtree(repo / "leaky")
    wait_for(lambda: srv.pids("worker") and srv.pids("worker") != pids, 30,
             "the worker to be recycled")
    assert "memory not returned after unloading leaky/1" in srv.log()
    assert "drained to restart" in srv.log(), "the broker did not drain and restart it"
    wait_for(lambda: serving(srv, 1, 1), 30, "m served by the new worker")
    assert infer(srv) == (1, 1.0)


HOG = '''
import torch


class Model:
    def load(self, version_dir, device):
        self.weights = torch.ones(MB << 18)  # MB megabytes of float32, touched

    def predict(self, inputs):
        return {"output": inputs["input"] + 0 * self.weights[0]}
'''


def write_hog(repo: Path, name: str, mb: int) -> None:
    tmp = repo / f".tmp-{name}"
    (tmp / "1").mkdir(parents=True)
    (tmp / "1" / "model.py").write_text(HOG.replace("MB", str(mb)))
    (tmp / "config.json").write_text(json.dumps(
        {**linear_config(name, n_out=4), "platform": "python"}))
    os.rename(tmp, repo / name)


def test_memory_budget_evicts_the_idle_model_and_refuses_what_cannot_fit(repo: Path,
                                                                         serve) -> None:
    shutil.rmtree(repo / "m")
    write_hog(repo, "a", 60)
    srv = serve(repo, extra=["--memory-budget", str(100 << 20)])
    wait_for(lambda: models(srv)["models"].get("a", {}).get("ready") == [1], 30, "a")
    with Client(srv.frontend, timeout_s=10) as c:
        c.infer("a", {"input": np.ones((1, 4), dtype=np.float32)})
    wait_for(lambda: status(srv)["workers"][0]["memory"].get("free_bytes", 1 << 40)
             < 50 << 20, 10, "the worker to report a's footprint against its budget")
    write_hog(repo, "b", 60)
    wait_for(lambda: models(srv)["models"].get("b", {}).get("ready") == [1], 30, "b")
    assert status(srv)["workers"][0]["models"] == ["b/1"], "a was not evicted"
    assert models(srv)["models"]["a"]["ready"] == []
    assert "evicted a from worker" in srv.log()
    write_hog(repo, "big", 160)
    try:
        m = wait_for(lambda: models(srv)["errors"].get("big"), 30, "big refused")
    except AssertionError:
        raise AssertionError(srv.log()[-4000:]) from None
    assert "more than worker" in m and "memory budget of 104.9 MB" in m, srv.log()[-3000:]
    # the refused version's memory comes back: the worker stays, nothing read as a leak
    wait_for(lambda: "unloaded big/1" in srv.log(), 10, "big unloaded")
    assert "memory not returned" not in srv.log(), srv.log()[-3000:]
    assert status(srv)["workers"][0]["models"] == ["b/1"]
    assert status(srv)["workers"][0]["memory"]["budget_bytes"] == 100 << 20


HANDLER = '''
from . import utils


class Model:
    def load(self, version_dir, device):
        pass

    def predict(self, inputs):
        return {"output": inputs["input"][:, :3] * 0 + utils.VALUE}
'''


def test_handler_versions_with_their_own_utils_serve_side_by_side(repo: Path, serve) -> None:
    shutil.rmtree(repo / "m")
    for version in (1, 2):
        vdir = repo / "h" / str(version)
        vdir.mkdir(parents=True)
        (vdir / "model.py").write_text(HANDLER)
        (vdir / "utils.py").write_text(f"VALUE = {version * 10}.0\n")
    (repo / "h" / "config.json").write_text(json.dumps(
        {**linear_config("h", version_policy={"all": True}), "platform": "python"}))
    srv = serve(repo)
    wait_for(lambda: models(srv)["models"].get("h", {}).get("ready") == [1, 2], 30, "h v1+v2")
    with Client(srv.frontend, timeout_s=10) as c:
        for version in (1, 2, 1):
            res = c.infer("h", {"input": np.ones((2, 4), dtype=np.float32)}, version=version)
            assert res.outputs["output"].tolist() == [[version * 10.0] * 3] * 2
