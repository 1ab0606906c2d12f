"""Tenants through real processes: each status over HTTP and over the direct client, a
key rotated while requests flow, reloads with a broken file."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
from typing import Any, Iterator

import numpy as np
import pytest

from zeroserve.broker.client import Client, InferError
from zeroserve.broker.protocol import ErrorCode
from zeroserve.broker.server.tenants import new_key
from tests.conftest import ZEROSERVE, Server, http, linear_config, short_tmpdir, wait_for, \
    write_model

pytestmark = pytest.mark.timeout(240)

X = {"input": np.ones((1, 4), np.float32)}
BODY = json.dumps({"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32",
                               "data": [1.0] * 4}]}).encode()


def tenants_text(keys: dict[str, list[str]]) -> str:
    def hashes(name: str) -> str:
        return ", ".join(f'"{h}"' for h in keys[name])
    return f"""# tenants of the e2e test
[tenants.alice]
keys = [{hashes("alice")}]
qos = "guaranteed"
weight = 2

[tenants.bob]
keys = [{hashes("bob")}]
qos = "best_effort"
models = ["linear"]
max_timeout_ms = 2000

[tenants.slow]
keys = [{hashes("slow")}]
qos = "burstable"
rate = 0.2
burst = 2
"""


class World:
    def __init__(self) -> None:
        self.repo = short_tmpdir("zsrepo")
        for name in ("linear", "other"):
            write_model(self.repo, name, 1, "nn.Linear(4, 3)", linear_config(name))
        self.keys: dict[str, str] = {}
        hashes: dict[str, list[str]] = {}
        for name in ("alice", "bob", "slow"):
            self.keys[name], h = new_key()
            hashes[name] = [h]
        self.hashes = hashes
        self.file = self.repo.parent / f"{self.repo.name}-tenants.toml"
        self.file.write_text(tenants_text(hashes))
        self.server = Server(self.repo, extra=["--tenants", str(self.file)]).wait_ready()

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*ZEROSERVE, *args, "--runtime-dir", str(self.server.runtime)],
                              capture_output=True, text=True, timeout=30)

    def close(self) -> None:
        self.server.stop()
        shutil.rmtree(self.repo, ignore_errors=True)
        self.file.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    w = World()
    yield w
    w.close()


def post(w: World, model: str, headers: dict[str, str]) -> tuple[int, dict[str, str], Any]:
    code, hdrs, body = http("POST", f"{w.server.url}/v2/models/{model}/infer", BODY, headers)
    return code, hdrs, json.loads(body)


def direct_error(w: World, model: str, key: str, **kw: Any) -> InferError:
    with Client(w.server.frontend, api_key=key) as c:
        with pytest.raises(InferError) as err:
            c.infer(model, X, **kw)
    return err.value


def test_missing_or_unknown_key_is_401(world: World) -> None:
    code, hdrs, body = post(world, "linear", {})
    assert code == 401 and "API key" in body["error"] and \
        {k.lower(): v for k, v in hdrs.items()}.get("www-authenticate") == "Bearer"
    assert post(world, "linear", {"Authorization": "Bearer zs_nope"})[0] == 401
    assert direct_error(world, "linear", "").code is ErrorCode.UNAUTHORIZED
    assert direct_error(world, "linear", world.keys["alice"] + "x").code is ErrorCode.UNAUTHORIZED


def test_known_keys_serve_over_http_and_direct(world: World) -> None:
    assert post(world, "other", {"Authorization": f"Bearer {world.keys['alice']}"})[0] == 200
    assert post(world, "linear", {"X-API-Key": world.keys["bob"]})[0] == 200
    with Client(world.server.frontend, api_key=world.keys["alice"]) as c:
        assert c.infer("linear", X).outputs["output"].shape == (1, 3)


def test_model_not_allowed_is_403(world: World) -> None:
    code, _, body = post(world, "other", {"X-API-Key": world.keys["bob"]})
    assert code == 403 and "may not call model 'other'" in body["error"]
    assert direct_error(world, "other", world.keys["bob"]).code is ErrorCode.FORBIDDEN


def test_over_rate_is_429_with_retry_after_from_the_bucket(world: World) -> None:
    headers = {"Authorization": f"Bearer {world.keys['slow']}"}
    assert [post(world, "linear", headers)[0] for _ in range(2)] == [200, 200]  # the burst
    code, hdrs, body = post(world, "linear", headers)
    assert code == 429 and "over its requests rate" in body["error"]
    # one token at 0.2/s: up to 5 s
    assert 1 <= int({k.lower(): v for k, v in hdrs.items()}["retry-after"]) <= 5
    err = direct_error(world, "linear", world.keys["slow"])
    assert err.code is ErrorCode.QUOTA and 0 < err.retry_after_s <= 5


def test_priority_and_timeout_above_the_class_are_clamped_and_said(world: World) -> None:
    with Client(world.server.frontend, api_key=world.keys["bob"]) as c:
        res = c.infer("linear", X, priority=1, timeout_ms=60_000)
    assert res.stats["priority_clamped"] == 1 and res.stats["priority"] == 2
    assert res.stats["timeout_clamped"] == 1 and res.stats["timeout_ms"] == 2000
    with Client(world.server.frontend, api_key=world.keys["alice"]) as c:
        assert "priority_clamped" not in c.infer("linear", X, priority=1).stats
    body = json.dumps({**json.loads(BODY), "parameters": {"priority": 1,
                                                          "timeout": 60_000_000}}).encode()
    code, _, got = http("POST", f"{world.server.url}/v2/models/linear/infer", body,
                        {"X-API-Key": world.keys["bob"]})
    assert code == 200 and json.loads(got)["parameters"] == {
        "priority_clamped": True, "priority": 2, "timeout_clamped": True, "timeout": 2_000_000}
    code, _, got = http("POST", f"{world.server.url}/v2/models/linear/infer", BODY,
                        {"X-API-Key": world.keys["alice"]})
    assert code == 200 and "parameters" not in json.loads(got)


def test_tenants_verb_cli_and_metrics_show_each_tenant(world: World) -> None:
    out = world.cli("tenants", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["enabled"] and set(doc["tenants"]) == {"alice", "bob", "slow"}
    bob = doc["tenants"]["bob"]
    assert bob["admitted"] >= 2 and bob["rejected"].get("forbidden", 0) >= 2
    assert bob["inflight"] == 0 and bob["qos"] == "best_effort"
    human = world.cli("tenants")
    assert human.returncode == 0 and "slow" in human.stdout and "quota=" in human.stdout
    status = world.cli("status")
    assert status.returncode == 0 and "tenant bob:" in status.stdout, status.stdout
    with Client(world.server.control) as c:
        text = c.control("metrics")["broker"]
    assert 'zeroserve_tenant_rejections_total{reason="unauthorized",tenant="unknown"}' in text
    assert 'zeroserve_tenant_requests_total{tenant="alice"}' in text
    assert 'zeroserve_tenant_queue_seconds_count{tenant="bob"}' in text


def test_a_broken_file_is_refused_and_the_old_tenants_stay(world: World) -> None:
    good = world.file.read_text()
    try:
        world.file.write_text(good.replace('qos = "burstable"', 'qos = "gold"'))
        out = world.cli("reload", "--tenants")
        assert out.returncode == 1
        assert "line 15: tenant slow, field 'qos'" in out.stderr, out.stderr
        os.kill(world.server.pids("broker")[0], signal.SIGHUP)  # the same through SIGHUP
        wait_for(lambda: "tenants not reloaded, the old ones stay" in world.server.log(), 10,
                 "the broker to log the refused reload")
        assert post(world, "linear", {"X-API-Key": world.keys["bob"]})[0] == 200
    finally:
        world.file.write_text(good)
    assert world.cli("reload", "--tenants").returncode == 0


def test_direct_control_calls_show_a_tenant_only_its_models(world: World) -> None:
    """The frontend's read verbs over the direct client: no key, another tenant's model,
    the right key (bob may call linear only; alice every model)."""
    from zeroserve.broker import wording
    with Client(world.server.frontend) as c, pytest.raises(InferError) as err:
        c.control("metadata", model="linear")
    assert err.value.code is ErrorCode.UNAUTHORIZED
    with Client(world.server.frontend, api_key=world.keys["bob"]) as c:
        for verb in ("metadata", "config", "stats"):
            with pytest.raises(InferError) as err:
                c.control(verb, model="other")
            assert (err.value.code, err.value.message) == (ErrorCode.NOT_FOUND,
                                                           wording.unknown_model("other"))
        assert c.control("metadata", model="linear")["name"] == "linear"
        assert {s["name"] for s in c.control("stats")["model_stats"]} == {"linear"}
        assert {e["name"] for e in c.control("repository_index")} == {"linear"}
    with Client(world.server.frontend, api_key=world.keys["alice"]) as c:
        assert {e["name"] for e in c.control("repository_index")} == {"linear", "other"}
        assert c.control("config", model="other")["name"] == "other"


def test_a_key_rotated_while_requests_flow(world: World) -> None:
    """bob gets a second key, the flow moves to it, the old key is removed: every request
    of the flow is answered 200, and the old key is then refused."""
    current = {"key": world.keys["bob"]}
    codes: list[int] = []
    stop = threading.Event()

    def flow() -> None:
        while not stop.is_set():
            codes.append(post(world, "linear", {"X-API-Key": current["key"]})[0])

    t = threading.Thread(target=flow, daemon=True)
    t.start()
    try:
        wait_for(lambda: len(codes) >= 5, 20, "requests to flow")
        out = world.cli("tenants", "add-key", "bob", "--tenants", str(world.file))
        assert out.returncode == 0, out.stderr
        new = out.stdout.strip()
        assert new.startswith("zs_") and new not in world.file.read_text()
        assert world.cli("reload", "--tenants").returncode == 0
        current["key"] = new
        n = len(codes)
        wait_for(lambda: len(codes) >= n + 5, 20, "requests with the new key")
        text = world.file.read_text().replace(f'"{world.hashes["bob"][0]}"', "")
        world.file.write_text(text.replace("[, ", "[").replace(", ]", "]"))
        assert world.cli("reload", "--tenants").returncode == 0, world.file.read_text()
        n = len(codes)
        wait_for(lambda: len(codes) >= n + 5, 20, "requests after the old key left")
    finally:
        stop.set()
        t.join(30)
    assert codes and set(codes) == {200}, sorted(set(codes))
    assert direct_error(world, "linear", world.keys["bob"]).code is ErrorCode.UNAUTHORIZED
    with Client(world.server.frontend, api_key=new) as c:
        c.infer("linear", X)
