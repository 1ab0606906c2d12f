"""The trace settings are the server's, not one gateway process's: one broker, one worker
and two gateway processes started apart (as Kubernetes runs several gateway pods against
one broker); a change through either is what the other answers and samples by, a model's
too; Triton's errors still come back; a restarted broker starts again from its own
``--trace-config``, and every gateway follows it."""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from tests.conftest import ZEROSERVE, free_port, http, linear_config, short_tmpdir, \
    wait_for, write_model

pytestmark = pytest.mark.timeout(180)

BODY = json.dumps({"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32",
                               "data": np.ones(4).tolist()}]}).encode()
# the broker's: what every gateway samples by until someone changes it
CONFIG = ["--trace-config", "rate=1000", "--trace-config", "triton,log-frequency=1"]
# how soon another gateway samples by a change: a ping (0.5 s) and a round trip, plus
# room for a host loaded by other test runs
BOUND_S = 5.0


class Proc:
    def __init__(self, name: str, folder: Path, argv: list[str]) -> None:
        self.name = name
        self.log_path = folder / f"{name}.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([*ZEROSERVE, *argv], stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


class Gateway:
    def __init__(self, name: str, cluster: "Cluster") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.file = cluster.folder / f"{name}.json"   # each gateway's own trace file
        self.proc = Proc(name, cluster.folder, [
            "gateway", "--runtime-dir", str(cluster.runtime), "--http-port", str(self.port),
            "--shed-lag-ms", "1000", "--trace-config", f"triton,file={self.file}"])

    def settings(self, model: str | None = None) -> dict[str, Any]:
        status, _, body = http("GET", self._route(model))
        assert status == 200, body
        got: dict[str, Any] = json.loads(body)
        return got

    def change(self, changes: dict[str, Any], model: str | None = None
               ) -> tuple[int, dict[str, Any]]:
        status, _, body = http("POST", self._route(model), json.dumps(changes).encode())
        return status, json.loads(body)

    def _route(self, model: str | None) -> str:
        return self.url + (f"/v2/models/{model}" if model else "/v2") + "/trace/setting"

    def infer(self) -> None:
        status, _, body = http("POST", self.url + "/v2/models/linear/infer", BODY)
        assert status == 200, body

    def records(self) -> list[str]:
        return glob.glob(f"{self.file}*")

    def ready(self) -> bool:
        if self.proc.proc.poll() is not None:
            raise AssertionError(f"{self.proc.name} exited:\n{self.proc.log()}")
        try:
            return http("GET", self.url + "/v2/health/ready", timeout=1)[0] == 200
        except OSError:
            return False


class Cluster:
    def __init__(self) -> None:
        self.folder = short_tmpdir("zstset")
        self.runtime = self.folder / "rt"
        self.repo = self.folder / "repo"
        write_model(self.repo, "linear", 1, "nn.Linear(4, 3)", linear_config("linear"))
        self.procs: list[Proc] = []
        self.broker = self.start_broker()
        self.procs.append(Proc("worker", self.folder, [
            "worker", "--runtime-dir", str(self.runtime), "--threads", "1"]))
        self.gateways = [Gateway("a", self), Gateway("b", self)]
        self.procs += [g.proc for g in self.gateways]
        try:
            for g in self.gateways:
                wait_for(g.ready, 60, f"gateway {g.proc.name} ready")
        except AssertionError:
            logs = "\n".join(f"--- {p.name}\n{p.log()}" for p in self.procs)
            self.close()
            raise AssertionError(f"not ready:\n{logs}") from None

    def start_broker(self) -> Proc:
        broker = Proc("broker", self.folder, [
            "broker", "--runtime-dir", str(self.runtime), "--model-dir", str(self.repo),
            *CONFIG])
        self.procs.append(broker)
        return broker

    def restart_broker(self) -> None:
        self.broker.stop()
        self.procs.remove(self.broker)
        self.broker = self.start_broker()

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        shutil.rmtree(self.folder, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster()
    yield c
    c.close()


def traced_within(gateway: Gateway, bound_s: float) -> float:
    """Seconds until a request through ``gateway`` is traced (one request per try)."""
    start = time.monotonic()

    def traced() -> bool:
        gateway.infer()
        return bool(gateway.records())
    wait_for(traced, bound_s, f"a request through gateway {gateway.proc.name} traced")
    return time.monotonic() - start


def test_a_change_through_one_gateway_is_what_the_other_samples_by(cluster: Cluster) -> None:
    a, b = cluster.gateways
    for g in (a, b):   # the broker's --trace-config, the gateway's own file
        assert g.settings() == {"trace_level": ["OFF"], "trace_rate": "1000",
                                "trace_count": "-1", "log_frequency": "1",
                                "trace_file": str(g.file), "trace_mode": "triton"}
    for _ in range(3):
        b.infer()
    assert not b.records()
    status, got = a.change({"trace_level": ["TIMESTAMPS"], "trace_rate": "1"})
    assert status == 200 and got["trace_level"] == ["TIMESTAMPS"], got
    # b samples by the change before anyone asks it for the settings: its PONG said so
    traced_within(b, BOUND_S)
    assert b.settings()["trace_rate"] == "1"
    # a model's own setting, through the other gateway; the global one stays
    status, got = b.change({"trace_rate": "5", "trace_count": "7"}, model="linear")
    assert status == 200 and (got["trace_rate"], got["trace_count"]) == ("5", "7"), got
    model = a.settings("linear")
    assert (model["trace_level"], model["trace_rate"], model["trace_count"]) == (
        ["TIMESTAMPS"], "5", "7")
    assert a.settings()["trace_rate"] == "1"
    status, _ = a.change({"trace_rate": None, "trace_count": None}, model="linear")
    assert status == 200 and b.settings("linear") == b.settings()
    for g, body, model_name, why in [
            (a, {"trace_rate": "-1"}, None, "out of range"),
            (b, {"trace_level": ["LOUD"]}, None, "unknown trace level"),
            (a, {"trace_file": "/etc/x"}, None, "can not be updated"),
            (b, {"trace_rate": "1"}, "nope", "unknown model")]:
        status, got = g.change(body, model=model_name)
        assert status == 400 and why in got["error"], got
    assert a.settings()["trace_rate"] == b.settings()["trace_rate"] == "1"


def test_a_restarted_broker_starts_from_its_own_config(cluster: Cluster) -> None:
    a, b = cluster.gateways
    status, _ = a.change({"trace_level": ["TIMESTAMPS"], "trace_rate": "3"})
    assert status == 200 and b.settings()["trace_rate"] == "3"
    cluster.restart_broker()

    def from_config() -> bool:
        try:
            return all(g.settings()["trace_level"] == ["OFF"] and
                       g.settings()["trace_rate"] == "1000" for g in (a, b))
        except AssertionError:   # a GET while the broker is away may fail
            return False
    wait_for(from_config, 60, "both gateways on the new broker's settings")
    wait_for(b.ready, 60, "the worker back on the new broker")
    before = len(b.records())
    for _ in range(5):   # OFF again: nothing traced
        b.infer()
    assert len(b.records()) == before
