"""Tenants scope what they see over HTTP: every /v2 route but health needs a key (401
before any validation), each read route answers no key, another tenant's key and the
right one, /metrics answers the admin token or --metrics-allow. A real ``zeroserve
serve`` with a tenants file and an admin token; tritonclient.http unchanged."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from zeroserve.broker import wording
from zeroserve.broker.client import Client
from zeroserve.broker.server.tenants import new_key
from tests.conftest import Server, http, linear_config, short_tmpdir, write_model

pytestmark = pytest.mark.timeout(180)

TOKEN = "test-admin-token"
BAD_BODY = json.dumps({"inputs": [{"name": "input", "shape": [1, 3], "datatype": "FP32",
                                   "data": [1.0, 2.0]}]}).encode()   # 2 values, shape of 3


class World:
    def __init__(self) -> None:
        self.repo = short_tmpdir("zsrepo")
        for name in ("linear", "other"):
            write_model(self.repo, name, 1, "nn.Linear(4, 3)", linear_config(name))
        self.keys: dict[str, str] = {}
        lines = []
        for name, models in (("alice", '"*"'), ("bob", '["linear"]')):
            self.keys[name], hashed = new_key()
            lines.append(f'[tenants.{name}]\nkeys = ["{hashed}"]\nmodels = {models}\n')
        self.file = self.repo.parent / f"{self.repo.name}-tenants.toml"
        self.file.write_text("\n".join(lines))
        # no address may scrape but with the token: loopback is where the test is
        self.server = Server(self.repo, extra=["--tenants", str(self.file),
                                               "--metrics-allow", "192.0.2.1/32"],
                             env={"ZEROSERVE_ADMIN_TOKEN": TOKEN}).wait_ready()

    def get(self, path: str, key: str | None = None, **headers: str) -> tuple[int, Any]:
        if key is not None:
            headers["X-API-Key"] = key
        code, _, body = http("GET", self.server.url + path, None, headers)
        return code, json.loads(body) if body.startswith((b"{", b"[")) else body

    def close(self) -> None:
        self.server.stop()
        shutil.rmtree(self.repo, ignore_errors=True)
        self.file.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    w = World()
    yield w
    w.close()


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(autouse=True)
def broker_unharmed(world: World) -> Iterator[None]:
    """After each case: the same broker, serving, holding nothing of any request, not
    grown."""
    [pid] = world.server.pids("broker")
    rss = rss_bytes(pid)
    yield
    assert world.server.pids("broker") == [pid]
    with Client(world.server.frontend, api_key=world.keys["alice"]) as c:
        assert c.infer("linear", {"input": np.ones((1, 4), np.float32)}).outputs[
            "output"].shape == (1, 3)
    with Client(world.server.control) as c:
        census = c.control("census")
    assert not any(census.values()), census
    assert rss_bytes(pid) < rss + (40 << 20)


READS = ["/v2/models/other", "/v2/models/other/versions/1", "/v2/models/other/config",
         "/v2/models/other/ready", "/v2/models/other/stats"]


@pytest.mark.parametrize("path", READS)
def test_each_read_route_with_no_key_another_tenants_and_the_right_one(world, path) -> None:
    code, body = world.get(path)
    assert code == 401 and "API key is required" in body["error"]
    code, body = world.get(path, world.keys["bob"])   # bob may call linear only
    assert code == 404 and body["error"] == wording.unknown_model("other")
    assert world.get(path.replace("other", "nope"), world.keys["alice"]) == (404, {
        "error": wording.unknown_model("nope")})   # the same answer as a model that is absent
    assert world.get(path, world.keys["alice"])[0] == 200
    assert world.get(path, "zs_0123456789abcdef_notakeynotakeynot")[0] == 401


def test_listings_show_a_tenant_only_its_models(world) -> None:
    code, body = world.get("/v2/models/stats", world.keys["bob"])
    assert code == 200 and {s["name"] for s in body["model_stats"]} == {"linear"}
    code, body = world.get("/v2/models/stats", world.keys["alice"])
    assert {s["name"] for s in body["model_stats"]} == {"linear", "other"}
    assert world.get("/v2/models/stats")[0] == 401
    for key, seen in ((world.keys["bob"], {"linear"}), (world.keys["alice"],
                                                         {"linear", "other"})):
        code, _, got = http("POST", world.server.url + "/v2/repository/index", b"{}",
                            {"X-API-Key": key})
        assert code == 200 and {e["name"] for e in json.loads(got)} == seen
    code, _, got = http("POST", world.server.url + "/v2/repository/index", b"{}")
    assert code == 401


def test_through_tritonclient_unchanged(world) -> None:
    url = world.server.url.removeprefix("http://")
    with triton.InferenceServerClient(url) as c:
        with pytest.raises(InferenceServerException) as err:
            c.get_model_metadata("linear")
        assert "API key is required" in err.value.message()
        bob = {"Authorization": f"Bearer {world.keys['bob']}"}
        assert c.get_model_metadata("linear", headers=bob)["name"] == "linear"
        with pytest.raises(InferenceServerException) as err:
            c.get_model_config("other", headers=bob)
        assert err.value.message() == wording.unknown_model("other")
        assert [e["name"] for e in c.get_model_repository_index(headers=bob)] == ["linear"]
        x = triton.InferInput("input", [1, 4], "FP32").set_data_from_numpy(
            np.ones((1, 4), np.float32))
        assert c.infer("linear", [x], headers=bob).as_numpy("output").shape == (1, 3)


def test_an_infer_without_a_key_is_401_before_any_validation(world) -> None:
    for path in ("/v2/models/linear/infer", "/v2/models/nope/infer",
                 "/v2/models/linear/versions/x/infer"):
        code, hdrs, got = http("POST", world.server.url + path, BAD_BODY)
        assert code == 401 and "API key is required" in json.loads(got)["error"], got
        assert {k.lower(): v for k, v in hdrs.items()}["www-authenticate"] == "Bearer"
    # with a key the same body is validated: bob learns nothing of other's inputs
    code, _, got = http("POST", world.server.url + "/v2/models/other/infer", BAD_BODY,
                        {"X-API-Key": world.keys["bob"]})
    assert code in (400, 403), got
    code, _, got = http("POST", world.server.url + "/v2/models/other/infer",
                        json.dumps({"inputs": [{"name": "input", "shape": [1, 5],
                                                "datatype": "FP32", "data": [1.0] * 5}]})
                        .encode(), {"X-API-Key": world.keys["bob"]})
    assert code == 403 and "shape" not in json.loads(got)["error"], got


def test_every_v2_route_but_health_needs_a_key(world) -> None:
    assert world.get("/v2/health/live")[0] == 200 and world.get("/v2/health/ready")[0] == 200
    # with a key, each route answers as it does without tenants (shared memory is off)
    for path, status in (("/v2", 200), ("/v2/logging", 200),
                         ("/v2/systemsharedmemory/status", 403),
                         ("/v2/cudasharedmemory/status", 200)):
        assert world.get(path)[0] == 401, path
        assert world.get(path, world.keys["bob"])[0] == status, path
        assert world.get(path, Authorization=f"Bearer {TOKEN}")[0] == status, path


def test_metrics_answer_the_admin_token_or_an_allowed_address(world) -> None:
    code, body = world.get("/metrics")   # loopback is not in --metrics-allow here
    assert code == 403 and "--metrics-allow" in body["error"]
    assert world.get("/metrics", world.keys["alice"])[0] == 403   # a tenant is no scraper
    code, text = world.get("/metrics", Authorization=f"Bearer {TOKEN}")
    assert code == 200 and b"zeroserve_" in text


def test_the_operator_sees_everything_with_the_admin_token(world) -> None:
    admin = f"Bearer {TOKEN}"
    assert world.get("/v2/models/other", Authorization=admin)[0] == 200
    code, body = world.get("/v2/models/stats", Authorization=admin)
    assert {s["name"] for s in body["model_stats"]} == {"linear", "other"}
