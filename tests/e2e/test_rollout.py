"""A rollout end to end under load, HTTP and direct clients, real processes: version 2
canaried by key, stepped to 100% and promoted; version 3, which raises on a fifth of its
inputs, rolled back by itself, no request failed by it (the plan retries a canary's
failures on the stable version; tests/broker/test_releases.py shows a plan that does not,
failing no request after the verdict); version 4, ten times slower, rolled back on
latency. Every request is answered exactly once, none fails.

Versions are Python handlers whose output is their version number, added to the
repository folder by rename as an operator (or a release pipeline) would."""

from __future__ import annotations

import json
import shutil
from typing import Iterator

import numpy as np
import pytest

from tests.conftest import Server, http, linear_config, short_tmpdir, wait_for
from tests.e2e.canary import (HANDLER, SERVICE_S, Load, add_version, control, ended,
                              never_back)
from tests.e2e.load import cli
from zeroserve.broker.client import Client
from zeroserve.broker.server.split import pick, point

pytestmark = pytest.mark.timeout(150)

PLAN = {"steps": [10, 50, 100], "dwell_s": 0.3, "min_requests": 20, "min_errors": 3,
        "max_error_rate": 0.05, "max_latency_ratio": 3.0, "latency_floor_ms": 10.0}


@pytest.fixture
def server() -> Iterator[Server]:
    repo = short_tmpdir("zsrepo")
    (repo / "m").mkdir()
    (repo / "m" / "config.json").write_text(json.dumps(
        {**linear_config("m"), "platform": "python", "version_policy": {"latest": 2},
         "rollout": PLAN}))
    add_version(repo, 1)
    srv = Server(repo, workers=1).wait_ready()
    yield srv
    srv.stop()
    shutil.rmtree(repo, ignore_errors=True)


def test_canary_promoted_then_faulty_and_slow_ones_rolled_back(server: Server) -> None:
    repo = server.model_dir
    load = Load(server)
    try:
        wait_for(lambda: len(load.answers.all()) > 50, 30, "the load to run")

        # version 2: stepped 10 -> 50 -> 100 by key, then promoted, version 1 retired
        add_version(repo, 2)
        promoted = wait_for(lambda: ended(server, 2), 60, "version 2's rollout to end")
        assert promoted["outcome"] == "promoted", promoted
        m = control(server, "models")["models"]["m"]
        assert m["ready"] == [2] and m["default_version"] == 2

        # version 3 fails a fifth of its inputs: rolled back on errors
        add_version(repo, 3, fails=True)
        back = wait_for(lambda: ended(server, 3), 60, "version 3's rollout to end")
        assert back["outcome"] == "rolled back", back
        m = control(server, "models")["models"]["m"]
        assert "error rate" in m["rolled_back"]["3"]
        decided_s = back["ended_s"]
        wait_for(lambda: len([a for a in load.answers.all() if a.got > decided_s + 1.0]) > 50,
                 30, "answers after the rollback")

        # the bad build leaves; version 1, retired, stays out though its folder is there
        # and the version policy (the newest 2) names it; version 4 is ten times slower:
        # rolled back on latency
        shutil.rmtree(repo / "m" / "3")
        wait_for(lambda: control(server, "models")["models"]["m"]["versions"] == [2], 30,
                 "version 3 to be removed")
        add_version(repo, 4, sleep_s=10 * SERVICE_S)
        slow = wait_for(lambda: ended(server, 4), 60, "version 4's rollout to end")
        assert slow["outcome"] == "rolled back", json.dumps(slow)
        assert "compute time p50" in control(server, "models")["models"]["m"][
            "rolled_back"]["4"]
    finally:
        answers = load.finish()

    got = answers.all()
    assert len(got) == answers.sent, "a request was not answered exactly once"
    # the plan retries (the default): what version 3 failed, before its rollback and
    # after, ran again on version 2; nothing failed at all
    failed = [(a.got - decided_s, a.outcome) for a in got if isinstance(a.outcome, str)]
    assert not failed, failed[:3]
    never_back(answers, 1, 2)   # sticky: while version 2 grew, no key went back to 1
    assert control(server, "census") == {k: 0 for k in control(server, "census")}


def test_every_door_routes_a_key_alike() -> None:
    """One routing key, five ways (the direct client's argument, the HTTP header and v2
    parameter, the gRPC metadata and parameter), meets the one version its hash picks."""
    import tritonclient.grpc as tg

    repo = short_tmpdir("zsrepo")
    (repo / "s").mkdir()
    (repo / "s" / "config.json").write_text(json.dumps(
        {**linear_config("s"), "platform": "python", "traffic": {"1": 50, "2": 50}}))
    for v in (1, 2):
        (repo / "s" / str(v)).mkdir()
        (repo / "s" / str(v) / "model.py").write_text(HANDLER.format(
            version=v, fails=False, sleep_s=0.0))
    srv = Server(repo, workers=1).wait_ready()
    x = np.ones((1, 4), np.float32)
    body = {"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32",
                        "data": x.ravel().tolist()}]}
    url = f"{srv.url}/v2/models/s/infer"

    def by_http(key: str, header: bool) -> int:
        doc = {**body, "parameters": {} if header else {"routing_key": key}}
        status, _, raw = http("POST", url, json.dumps(doc).encode(),
                              {"X-Routing-Key": key} if header else {})
        assert status == 200, raw
        return int(json.loads(raw)["outputs"][0]["data"][0])

    try:
        wait_for(lambda: control(srv, "models")["models"]["s"]["ready"] == [1, 2], 60,
                 "both versions")
        gc = tg.InferenceServerClient(srv.grpc_url)
        inp = tg.InferInput("input", [1, 4], "FP32").set_data_from_numpy(x)

        def by_grpc(key: str, header: bool) -> int:
            res = gc.infer("s", [inp], headers={"x-routing-key": key} if header else None,
                           parameters=None if header else {"routing_key": key})
            return int(res.as_numpy("output").flat[0])

        seen = set()
        with Client(srv.frontend, timeout_s=10) as c:
            for i in range(24):
                key = f"user-{i}"
                want = pick({1: 50, 2: 50}, point("s", key))
                got = {c.infer("s", {"input": x}, routing_key=key).version,
                       by_http(key, True), by_http(key, False), by_grpc(key, True),
                       by_grpc(key, False)}
                assert got == {want}, (key, got, want)
                seen.add(want)
        gc.close()
        assert seen == {1, 2}
        cli_plans(srv)
    finally:
        srv.stop()
        shutil.rmtree(repo, ignore_errors=True)


def cli_plans(srv: Server) -> None:
    """The command line: bad plans refused, exit 1, nothing changed; then a rollout
    started and rolled back by hand, as ``zeroserve models`` shows."""
    ctl = ["--control", srv.control, "--timeout", "5"]
    for argv, message in ((["s", "2", "--steps", "50,10,100"], "steps must ascend"),
                          (["s", "2", "--steps", "10,50"], "must end at 100"),
                          (["s", "7"], "version 7"), (["nope", "1"], "unknown model")):
        out = cli("rollout", *argv, *ctl)
        assert out.returncode == 1 and message in out.stderr, out.stderr
    assert "rollout" not in control(srv, "models")["models"]["s"]
    out = cli("rollout", "s", "2", "--steps", "5,100", "--dwell", "600", *ctl)
    assert out.returncode == 0 and "version 2 takes 5%" in out.stdout, out.stderr
    assert control(srv, "models")["models"]["s"]["weights"] == {"1": 95, "2": 5}
    out = cli("rollback", "s", *ctl)
    assert out.returncode == 0 and "version 2 rolled back; version 1 serves" in out.stdout
    m = control(srv, "models")["models"]["s"]
    assert m["rolled_back"] == {"2": "rolled back by hand"} and m["default_version"] == 1
