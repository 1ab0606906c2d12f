"""Loads that retry, end to end: real workers run a handler whose load() fails for a
reason that may pass (MemoryError) a set number of times, counted in a file outside the
version folder (inside, it would change the version's sha256)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from zeroserve.broker.client import Client
from tests.conftest import Server, http, linear_config, short_tmpdir, wait_for

pytestmark = pytest.mark.timeout(180)

HANDLER = '''\
import fcntl
import pathlib
import time

COUNT = pathlib.Path({count!r})
FAIL_WHILE = {fail_while}      # loads up to this one raise MemoryError
HANG_AT = {hang_at}            # this load waits (the test kills its worker meanwhile)


class Model:
    def load(self, version_dir, device):
        # a swap loads on both workers at once: unlocked, one read the file the other had
        # just truncated (int('') raised ValueError, a load failure that is not retried,
        # so the swap failed for good), or both counted the same load
        with open(COUNT.with_name("lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            n = int(COUNT.read_text()) + 1 if COUNT.exists() else 1
            COUNT.write_text(str(n))
        if n == HANG_AT:
            (COUNT.parent / "hanging").write_text(str(n))
            time.sleep(120)  # noqa: sleep-ok (a load its worker is killed during)
        if n <= FAIL_WHILE:
            raise MemoryError(f"load {{n}}: out of memory")

    def predict(self, inputs):
        return {{"output": inputs["input"][:, :3] * 0 + {value}}}
'''


@pytest.fixture
def repo():
    path = short_tmpdir("zsrepo")
    yield path
    for folder in [path, *path.parent.glob(f"{path.name}-*")]:   # the load counts too
        shutil.rmtree(folder, ignore_errors=True)


def handler(repo: Path, name: str, version: int, fail_while: int, hang_at: int = 0,
            optional: bool = False) -> Path:
    """Publish a handler's version (by rename); returns the file that counts its loads."""
    count = repo.parent / f"{repo.name}-{name}-{version}" / "count"
    count.parent.mkdir(exist_ok=True)
    tmp = repo / name / f".tmp-{version}"
    tmp.mkdir(parents=True)
    (tmp / "model.py").write_text(HANDLER.format(count=str(count), fail_while=fail_while,
                                                 hang_at=hang_at, value=float(version)))
    cfg = {**linear_config(name, optional=optional), "platform": "python"}
    if not (repo / name / "config.json").exists():
        (repo / name / "config.json").write_text(json.dumps(cfg))
    os.rename(tmp, repo / name / str(version))
    return count


def models(srv: Server) -> dict[str, Any]:
    with Client(srv.control, timeout_s=5) as c:
        return c.control("models")  # type: ignore[no-any-return]


def answer(srv: Server, name: str) -> float:
    with Client(srv.frontend, timeout_s=10) as c:
        res = c.infer(name, {"input": np.ones((2, 4), dtype=np.float32)})
    return float(res.outputs["output"].flat[0])


def test_a_load_that_fails_twice_for_memory_serves_without_anyone_acting(repo: Path) -> None:
    count = handler(repo, "h", 1, fail_while=2)
    srv = Server(repo, workers=2, extra=["--load-retry-base-s", "1.0"])
    try:
        # no readiness to wait on (the model fails first): the broker's control socket,
        # else a loaded host's slow start fails the first call (a 5 s connect timeout)
        wait_for(lambda: (srv.runtime / "control").exists(), 60, "the broker to listen")
        # the first attempt failed on both workers at once; the retry waits its turn
        entry = wait_for(lambda: models(srv)["models"].get("h", {}).get("load_retries"),
                         30, "the retry to show in zeroserve models")
        assert entry["1"]["attempts"] == 1 and entry["1"]["of"] == 5
        assert "MemoryError" in entry["1"]["last_error"]
        code, _, body = http("GET", srv.url + "/v2/health/ready")
        assert code == 503 and b"attempt 1 of 5 failed" in body, body
        code, _, body = http("POST", srv.url + "/v2/repository/index", b"{}")
        [row] = [r for r in json.loads(body) if r["name"] == "h"]
        assert row["state"] == "UNAVAILABLE" and "attempt 1 of 5 failed" in row["reason"]
        srv.wait_ready(60)
        assert answer(srv, "h") == 1.0
        # two failures (the first round on both workers, then one retry on one worker),
        # then the retry that succeeded, then the other worker released: four loads
        wait_for(lambda: len(models(srv)["models"]["h"]["workers"]) == 2, 20, "both workers")
        assert count.read_text() == "4"
        assert "load_retries" not in models(srv)["models"]["h"]
        assert "h" not in models(srv)["errors"]

        # a swap: version 2 fails once, version 1 serves meanwhile, version 2 takes over
        count2 = handler(repo, "h", 2, fail_while=2)
        try:
            wait_for(lambda: models(srv)["models"]["h"]["ready"] == [2], 60,
                     "version 2 swapped in")
        except AssertionError as exc:
            # failed 2 of 3 full runs on 2026-12-06, never alone: say what the broker saw
            raise AssertionError(f"{exc}; h: {models(srv)['models']['h']}; log:\n"
                                 f"{srv.log()[-8000:]}") from None
        assert answer(srv, "h") == 2.0
        assert count2.read_text() == "4"
        assert "swap to version(s) [2] failed" not in srv.log()
    finally:
        srv.stop()


def test_a_corrupt_file_is_not_retried(repo: Path, serve) -> None:
    handler(repo, "h", 1, fail_while=0)
    vdir = repo / "c" / "1"
    vdir.mkdir(parents=True)
    (vdir / "model.pt").write_bytes(b"this is not a TorchScript archive")
    (repo / "c" / "config.json").write_text(json.dumps(linear_config("c", optional=True)))
    srv = serve(repo, extra=["--load-retry-base-s", "0.05", "--load-retry-max-s", "0.05"])
    wait_for(lambda: "c" in models(srv)["errors"] or
             "failed to load c/1" in srv.log(), 30, "c's failure")
    # proving an absence: a retry would have come within 0.05 s, four of them in 0.2 s
    time.sleep(1.0)  # noqa: sleep-ok (an absence: the retries would come meanwhile)
    assert srv.log().count("load of c/1 failed") == 1, srv.log()
    assert "load_retries" not in models(srv)["models"]["c"]
    assert answer(srv, "h") == 1.0


def test_a_worker_killed_during_a_retry_changes_nothing(repo: Path, serve) -> None:
    count = handler(repo, "h", 1, fail_while=2, hang_at=2)
    srv = Server(repo, workers=1, extra=["--load-retry-base-s", "0.2"])
    try:
        hanging = count.parent / "hanging"
        wait_for(hanging.exists, 60, "the retry to run")
        [pid] = srv.pids("worker")
        os.kill(pid, signal.SIGKILL)
        srv.wait_ready(90)     # restarted, it loads again: the third load succeeds
        assert answer(srv, "h") == 1.0
        assert count.read_text() == "3"
        assert "load_retries" not in models(srv)["models"]["h"]
    finally:
        srv.stop()
