"""A whole-server stop finishes what it accepted (issue 14), with real processes:
``zeroserve serve`` with one worker and a Python handler that takes 1.5 s a batch, six
requests queued, then SIGTERM to the whole process group (Ctrl-C, systemd's default)
or to the ``serve`` process alone. Every queued request is answered with its result,
a new connection is refused at once, and a keep-alive connection opened before the
signal still gets its requests answered while the drain lasts."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest

from tests.conftest import Server, linear_config, short_tmpdir, wait_for
from tests.e2e.load import cli
from zeroserve.broker.client import Client, InferError

pytestmark = pytest.mark.timeout(120)

SLOW = '''
import time


class Model:
    def load(self, version_dir, device):
        pass

    def predict(self, inputs):
        time.sleep(1.5)  # noqa: sleep-ok (a slow model: the queue outlives the signal)
        return {"output": inputs["input"] * 2}
'''

# a load (or an unload) that takes a while and says when it began
SLOW_LOAD = '''
import time
from pathlib import Path


class Model:
    def load(self, version_dir, device):
        Path("MARK").write_text("loading")
        time.sleep(6)  # noqa: sleep-ok (a slow load)

    def predict(self, inputs):
        return {"output": inputs["input"]}
'''

SLOW_UNLOAD = '''
import time
from pathlib import Path


class Model:
    def load(self, version_dir, device):
        pass

    def predict(self, inputs):
        return {"output": inputs["input"]}

    def __del__(self):
        Path("MARK").write_text("unloading")
        time.sleep(6)  # noqa: sleep-ok (a slow unload)
'''

PLAIN = SLOW_LOAD.replace('Path("MARK").write_text("loading")\n'
                          '        time.sleep(6)  # noqa: sleep-ok (a slow load)', "pass")


def write_handler(repo: Path, name: str, version: int, source: str, mbs: int = 1) -> None:
    """A python-handler version, renamed into place whole (the watcher sees it at once)."""
    tmp = repo / f".tmp-{name}-{version}"
    tmp.mkdir(parents=True)
    (tmp / "model.py").write_text(source)
    (repo / name).mkdir(exist_ok=True)
    (repo / name / "config.json").write_text(json.dumps(
        {**linear_config(name, n_out=4, mbs=mbs), "platform": "python"}))
    os.rename(tmp, repo / name / str(version))


@pytest.fixture
def repo() -> Iterator[Path]:
    folder = short_tmpdir("zsrepo")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def body(value: float) -> bytes:
    return json.dumps({"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32",
                                   "data": [value] * 4}]}).encode()


def infer_on(conn: http.client.HTTPConnection, value: float) -> tuple[int, Any]:
    conn.request("POST", "/v2/models/slow/infer", body(value),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    doc = json.loads(resp.read() or b"{}")
    if resp.status != 200:
        return resp.status, doc
    return resp.status, doc["outputs"][0]["data"]


def status(srv: Server) -> dict[str, Any]:
    with Client(srv.control, timeout_s=5) as c:
        return c.control("status")  # type: ignore[no-any-return]


def refused(srv: Server) -> bool:
    try:
        socket.create_connection(("127.0.0.1", srv.port), timeout=1).close()
    except ConnectionRefusedError:
        return True
    return False


def children(srv: Server) -> list[int]:
    return [pid for role in ("broker", "worker", "gateway") for pid in srv.pids(role)
            if Server.alive(pid)]


def wait_exit(srv: Server, within_s: float) -> float:
    start = time.monotonic()
    try:
        srv.proc.wait(within_s)
    except Exception:
        raise AssertionError(
            f"serve did not exit within {within_s}s:\n{srv.log()[-4000:]}") from None
    wait_for(lambda: not children(srv), 10, "every child to exit")
    assert srv.proc.returncode == 0, srv.log()[-4000:]
    assert "Traceback" not in srv.log(), srv.log()[-6000:]
    return time.monotonic() - start


def stop_under_load(repo: Path, signal_it: Callable[[Server], None]) -> None:
    write_handler(repo, "slow", 1, SLOW)
    srv = Server(repo, workers=1).wait_ready()
    try:
        keep = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
        keep.request("GET", "/v2/health/live")  # open before the signal, kept alive
        live = keep.getresponse()
        live.read()
        assert live.status == 200
        answers: dict[int, tuple[int, Any]] = {}

        def send(i: int) -> None:
            conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
            try:
                answers[i] = infer_on(conn, float(i))
            finally:
                conn.close()

        threads = [threading.Thread(target=send, args=(i,)) for i in range(1, 7)]
        for t in threads:
            t.start()
        # accepted: two batches on the worker (its credits), the rest queued
        wait_for(lambda: status(srv)["inflight_batches"] >= 1
                 and status(srv)["queues"].get("slow", 0) >= 3, 20, "six accepted requests")
        signal_it(srv)
        wait_for(lambda: refused(srv), 5, "new connections to be refused")
        keep.request("GET", "/v2/health/ready")   # a probe on an open connection: not ready
        probe = keep.getresponse()
        probe.read()
        assert probe.status == 503
        during = infer_on(keep, 100.0)    # an open keep-alive connection, during the drain
        for t in threads:
            t.join(40)
        assert not any(t.is_alive() for t in threads), "a request hung"
        assert during == (200, [200.0] * 4), (during, srv.log()[-4000:])
        assert answers == {i: (200, [2.0 * i] * 4) for i in range(1, 7)}, \
            (answers, srv.log()[-4000:])
        keep.close()
        wait_exit(srv, 40)
    finally:
        srv.stop()


def test_sigterm_to_the_process_group_answers_every_queued_request(repo: Path) -> None:
    stop_under_load(repo, lambda srv: os.killpg(srv.proc.pid, signal.SIGTERM))


def test_sigterm_to_serve_alone_answers_every_queued_request(repo: Path) -> None:
    stop_under_load(repo, lambda srv: srv.proc.send_signal(signal.SIGTERM))


DRAIN_BOUND_S = 10.0


def test_a_stop_while_a_model_loads_exits_cleanly_within_the_bound(repo: Path) -> None:
    write_handler(repo, "slow", 1, SLOW_LOAD.replace("MARK", str(repo / "mark")))
    srv = Server(repo, workers=1, extra=["--drain-timeout-s", str(DRAIN_BOUND_S)])
    try:
        wait_for(lambda: (repo / "mark").exists(), 60, "the load to begin")
        os.killpg(srv.proc.pid, signal.SIGTERM)
        assert wait_exit(srv, DRAIN_BOUND_S + 5) < DRAIN_BOUND_S
    finally:
        srv.stop()


def test_a_stop_while_a_swap_unloads_the_old_version_exits_cleanly(repo: Path) -> None:
    write_handler(repo, "slow", 1, SLOW_UNLOAD.replace("MARK", str(repo / "mark")))
    srv = Server(repo, workers=1, extra=["--drain-timeout-s", str(DRAIN_BOUND_S)])
    try:
        srv.wait_ready()
        write_handler(repo, "slow", 2, PLAIN)
        wait_for(lambda: (repo / "mark").exists(), 30, "the old version's unload to begin")
        srv.proc.send_signal(signal.SIGTERM)
        assert wait_exit(srv, DRAIN_BOUND_S + 5) < DRAIN_BOUND_S
    finally:
        srv.stop()


def test_drain_all_stops_admitting_finishes_the_queue_and_undrain_all_resumes(
        repo: Path) -> None:
    write_handler(repo, "slow", 1, SLOW)
    srv = Server(repo, workers=1).wait_ready()
    try:
        results: list[str] = []

        def one(i: int) -> None:
            with Client(srv.frontend, timeout_s=60) as c:
                try:
                    out = c.infer("slow", {"input": np.full((1, 4), i, np.float32)})
                    results.append("ok" if float(out.outputs["output"].flat[0]) == 2.0 * i
                                   else "wrong")
                except InferError as exc:
                    results.append(exc.code.value)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(1, 4)]
        for t in threads:
            t.start()
        wait_for(lambda: status(srv)["queues"].get("slow", 0) >= 1, 20, "a queue")
        done = cli("drain", "--all", "--wait", "--control", srv.control)
        assert done.returncode == 0, done.stdout + done.stderr
        for t in threads:
            t.join(30)
        assert sorted(results) == ["ok"] * 3, results   # the queue finished
        st = status(srv)
        assert st["stopping"] and st["inflight_batches"] == 0 and srv.proc.poll() is None
        with pytest.raises(InferError) as refused_new:   # admitting nothing new
            with Client(srv.frontend, timeout_s=10) as c:
                c.infer("slow", {"input": np.ones((1, 4), np.float32)})
        assert refused_new.value.code.value == "unavailable"
        assert cli("undrain", "--all", "--control", srv.control).returncode == 0
        one(5)
        assert results[-1] == "ok", results
    finally:
        srv.stop()
