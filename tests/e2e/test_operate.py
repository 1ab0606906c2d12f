"""Operating a running server: drain, undrain, reload, reload --worker and SIGTERM
under load lose no request; the CLI's exit codes and messages."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import Server, linear_config, short_tmpdir, wait_for, write_model
from tests.e2e.load import Load, cli, worker, worker_ids

pytestmark = pytest.mark.timeout(180)

SLOW = ("nn.Sequential(nn.Linear(4, 256), *[nn.Linear(256, 256) for _ in range(30)], "
        "nn.Linear(256, 3))")
X = np.ones((2, 4), np.float32)


@pytest.fixture(scope="module")
def srv():
    repo = short_tmpdir("zsrepo")
    write_model(repo, "slow", 1, SLOW, linear_config("slow", mbs=8))
    server = Server(repo, workers=2).wait_ready()
    wait_for(lambda: len(worker_ids(server.control)) == 2, 30, "two workers")
    yield server
    server.stop()


def ctl(srv: Server) -> list[str]:
    return ["--control", srv.control, "--timeout", "5"]


def two_ready(srv: Server) -> bool:
    ws = [worker(srv.control, w) for w in worker_ids(srv.control)]
    return len(ws) == 2 and all(w and w["state"] == "ready" and w["models"] for w in ws)


def test_drain_and_undrain_under_load_lose_nothing(srv: Server) -> None:
    wait_for(lambda: two_ready(srv), 30, "two ready workers")
    victim = worker_ids(srv.control)[0]
    with Load(srv.frontend, "slow", X) as load:
        load.more(40, "load to flow")
        out = cli("drain", victim, "--wait", *ctl(srv))
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == f"worker {victim} drained: no batch in flight"
        load.more(60, "requests while drained")
        w = worker(srv.control, victim)
        assert w is not None and w["state"] == "draining" and w["inflight_batches"] == 0
        out = cli("undrain", victim, "--json", *ctl(srv))
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["state"] == "ready"
        load.more(40, "requests after undrain")
    assert load.failures() == [] and load.ok() >= 140


def test_reload_worker_under_load_loses_nothing(srv: Server) -> None:
    wait_for(lambda: two_ready(srv), 30, "two ready workers")
    victim = worker_ids(srv.control)[1]
    old_pid = worker(srv.control, victim)["pid"]  # type: ignore[index]
    with Load(srv.frontend, "slow", X) as load:
        load.more(40, "load to flow")
        out = cli("reload", "--worker", victim, "--wait", *ctl(srv))
        assert out.returncode == 0, out.stderr
        assert f"worker {victim} restarted (pid {old_pid} -> " in out.stdout
        load.more(40, "requests after the restart")
    assert load.failures() == [], load.failures()[:5]
    new = worker(srv.control, victim)
    assert new is not None and new["pid"] != old_pid and new["models"] == ["slow/1"]
    assert "exited with 0" in srv.log()  # a clean exit after the drain, not a kill


def test_sigterm_to_a_worker_under_load_loses_nothing(srv: Server) -> None:
    wait_for(lambda: two_ready(srv), 30, "two ready workers")
    pids = srv.pids("worker --")
    with Load(srv.frontend, "slow", X) as load:
        load.more(40, "load to flow")
        os.kill(pids[0], signal.SIGTERM)
        wait_for(lambda: pids[0] not in srv.pids("worker --"), 30, "the worker to exit")
        load.more(40, "requests after the worker left")
        wait_for(lambda: two_ready(srv), 30, "the worker to come back")
        load.more(20, "requests with both workers")
    assert load.failures() == [], load.failures()[:5]
    # it left after the broker said its batches were answered, not at the drain bound
    assert f"[{pids[0]}] zeroserve.workers.worker: drained; exiting" in srv.log()


def test_reload_model_loads_it_afresh_on_every_worker(srv: Server) -> None:
    wait_for(lambda: two_ready(srv), 30, "two ready workers")
    with Load(srv.frontend, "slow", X, threads=4) as load:
        load.more(10, "load to flow")
        out = cli("reload", "slow/1", "--wait", *ctl(srv))
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "slow/1: reloaded on 2 worker(s)"
        load.more(10, "requests after the reload")
    assert load.failures() == []
    assert srv.log().count("loaded slow/1") >= 4  # twice per worker: start and reload


@pytest.mark.parametrize("argv, code, needle", [
    (["drain", "nohost/9"], 1, "unknown worker 'nohost/9' (known: "),
    (["undrain", "nohost/9"], 1, "unknown worker 'nohost/9'"),
    (["reload", "--worker", "nohost/9"], 1, "unknown worker 'nohost/9'"),
    (["reload", "nope"], 1, "Request for unknown model: 'nope' is not found"),
    (["reload", "slow/7"], 1, "Request for unknown model: 'slow' version 7 is not found"),
    (["reload", "slow/x"], 1, "version must be a positive integer"),
    (["reload"], 1, "name either MODEL[/VERSION] or --worker WORKER"),
])
def test_cli_refusals_exit_non_zero_with_a_message(srv: Server, argv: list[str], code: int,
                                                   needle: str) -> None:
    out = cli(*argv, *ctl(srv))
    assert out.returncode == code and needle in out.stderr, (out.returncode, out.stderr)
    out = cli(*argv, "--json", *ctl(srv))
    assert out.returncode == code and needle in json.loads(out.stdout)["error"]


def test_cli_finding_no_broker_says_at_once_where_it_looked_and_how_to_look_elsewhere(
        tmp_path: Path) -> None:
    nowhere = short_tmpdir("zsnone")
    for argv in (["status"], ["models"], ["drain", "h/0", "--wait"], ["undrain", "h/0"],
                 ["reload", "mlp"], ["reload", "--worker", "h/0"], ["tenants"]):
        started = time.monotonic()
        out = cli(*argv, "--runtime-dir", str(nowhere), timeout_s=20)   # --timeout 5
        assert time.monotonic() - started < 4, "waited its --timeout for no socket file"
        assert out.returncode == 3, (argv, out.returncode, out.stderr)
        assert f"no broker listens at ipc://{nowhere}/control: {nowhere}/control does " \
               "not exist; point at the broker's runtime folder with --runtime-dir DIR " \
               "or ZEROSERVE_RUNTIME_DIR=DIR" in out.stderr, out.stderr
    out = cli("drain", "h/0", "--json", "--runtime-dir", str(nowhere))
    assert out.returncode == 3 and json.loads(out.stdout)["code"] == "unavailable"
    # a socket file left by a broker that died: nothing answers within --timeout
    (nowhere / "control").touch()
    out = cli("status", "--runtime-dir", str(nowhere), "--timeout", "1", timeout_s=20)
    assert out.returncode == 3 and f"broker at ipc://{nowhere}/control is not reachable " \
        "(point at the broker's runtime folder with --runtime-dir" in out.stderr, out.stderr
    shutil.rmtree(nowhere)


def test_cli_status_json_shows_workers_and_queues(srv: Server) -> None:
    out = cli("status", "--json", *ctl(srv))
    assert out.returncode == 0
    doc = json.loads(out.stdout)
    assert len(doc["workers"]) == 2 and doc["queues"] == {"slow": 0}


def test_reload_retries_a_failed_load_once_the_file_is_fixed(serve) -> None:  # type: ignore[no-untyped-def]
    repo = short_tmpdir("zsrepo")
    write_model(repo, "linear", 1, "nn.Linear(4, 3)", linear_config("linear"))
    (repo / "broken" / "1").mkdir(parents=True)
    (repo / "broken" / "1" / "model.pt").write_bytes(b"not a torchscript file")
    (repo / "broken" / "config.json").write_text(json.dumps(linear_config("broken")))
    server = serve(repo, extra=["--readiness", "any"])  # strict: never ready with broken
    c = ["--control", server.control, "--timeout", "5"]

    def failed() -> bool:
        ws = json.loads(cli("status", "--json", *c).stdout)["workers"]
        return bool(ws and "broken/1" in ws[0]["load_errors"])
    wait_for(failed, 30, "the load to fail")
    out = cli("reload", "broken/1", "--wait", *c)
    assert out.returncode == 1 and "reload failed, the old load keeps serving" in out.stderr
    write_model(repo, "broken", 1, "nn.Linear(4, 3)")
    out = cli("reload", "broken", "--wait", *c)
    assert out.returncode == 0 and out.stdout.strip() == "broken: reloaded on 1 worker(s)", \
        out.stderr
    models = json.loads(cli("models", "--json", *c).stdout)["models"]
    assert models["broken"]["ready"] == [1]
