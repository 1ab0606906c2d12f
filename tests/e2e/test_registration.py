"""The registration API end to end: POST /v1/models copies from an import root, a
worker trial-loads it, an atomic rename publishes it and the watcher serves it."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ZEROSERVE, free_port, http, linear_config, short_tmpdir, wait_for
from tests.e2e.test_lifecycle import save_versioned
from zeroserve.broker.client import Client, InferError

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def dirs():
    repo, imports = short_tmpdir("zsrepo"), short_tmpdir("zsimp")
    save_versioned(repo / "m" / "1", 1.0)
    (repo / "m" / "config.json").write_text(json.dumps(linear_config("m")))
    yield repo, imports
    shutil.rmtree(repo, ignore_errors=True)
    shutil.rmtree(imports, ignore_errors=True)


def post(url: str, doc: object, raw: bytes | None = None, **headers: str):
    status, _, body = http("POST", url + "/v1/models",
                           raw if raw is not None else json.dumps(doc).encode(),
                           {"Content-Type": "application/json", **headers})
    return status, json.loads(body)


def body(name: str, path: Path, **extra: object) -> dict[str, object]:
    doc = {k: v for k, v in linear_config(name).items()}
    return {**doc, "model_path": str(path), **extra}


def leftovers(repo: Path) -> list[str]:
    return sorted(p.name for p in repo.iterdir() if p.name != "m")


def test_registration_round_trip(dirs, serve) -> None:
    repo, imports = dirs
    srv = serve(repo, extra=["--import-root", str(imports)])
    save_versioned(imports / "good", 3.0)
    (imports / "bad").mkdir()
    (imports / "bad" / "model.pt").write_bytes(b"not a model")

    status, doc = post(srv.url, None, raw=b"{not json")
    assert status == 400 and "not valid JSON" in doc["error"]
    status, doc = post(srv.url, [1, 2])
    assert status == 400 and "JSON object" in doc["error"]
    # left out, outputs are found by the trial load (tests/e2e/test_seed.py); empty is wrong
    status, doc = post(srv.url, body("r", imports / "good", outputs=[]))
    assert status == 400 and "'outputs': must be a non-empty list" in doc["error"]
    status, doc = post(srv.url, body("r", imports / "good", max_batch_size="8"))
    assert status == 400 and "max_batch_size" in doc["error"]
    status, doc = post(srv.url, {k: v for k, v in body("r", imports).items()
                                 if k != "model_path"})
    assert status == 400 and "model_path" in doc["error"]
    status, doc = post(srv.url, body("r", repo / "m" / "1"))
    assert status == 403 and "outside the import roots" in doc["error"]
    status, doc = post(srv.url, body("r", Path("imports") / "good"))
    assert status == 400 and "must be absolute" in doc["error"], doc
    status, doc = post(srv.url, body("r", imports / "missing"))
    assert status == 400 and "does not exist" in doc["error"]
    status, doc = post(srv.url, body("r", imports / "bad"))
    assert status == 422 and "r/1" in doc["error"], doc
    assert leftovers(repo) == [], "a failed registration left files behind"
    status, doc = post(srv.url, body("m", imports / "good"))
    assert status == 409 and "already exists" in doc["error"]
    (imports / "sneaky").mkdir()
    (imports / "sneaky" / "model.pt").symlink_to(repo / "m" / "1" / "model.pt")
    status, doc = post(srv.url, body("r", imports / "sneaky"))
    assert status == 400 and "links outside the import roots" in doc["error"]
    assert leftovers(repo) == []

    status, doc = post(srv.url, body("r", imports / "good"))
    assert status == 201 and doc == {"name": "r", "versions": [1], "state": "published",
                                     "inputs": linear_config("r")["inputs"],
                                     "outputs": linear_config("r")["outputs"], "ready": True}
    assert leftovers(repo) == ["r"]
    wait_for(lambda: http("GET", srv.url + "/v2/models/r/ready")[0] == 200, 20, "r ready")
    x = {"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32",
                     "data": [1, 2, 3, 4]}]}
    status, _, out = http("POST", srv.url + "/v2/models/r/infer", json.dumps(x).encode())
    assert status == 200 and json.loads(out)["outputs"][0]["data"] == [3.0, 3.0, 3.0]

    status, _, out = http("GET", srv.url + "/v1/models")
    assert status == 200
    assert {m["name"] for m in json.loads(out)["models"]} == {"m", "r"}
    status, _, out = http("GET", srv.url + "/v1/models/r")
    doc = json.loads(out)
    assert status == 200 and doc["ready"] == [1] and doc["config"]["max_batch_size"] == 8
    assert http("GET", srv.url + "/v1/models/nope")[0] == 404

    assert http("DELETE", srv.url + "/v1/models/r/versions/2")[0] == 404
    assert http("DELETE", srv.url + "/v1/models/r/versions/x")[0] == 400
    # past what the wire carries: refused here, not a 500 from the encoder (schemathesis)
    assert http("DELETE", srv.url + "/v1/models/r/versions/" + "9" * 30)[0] == 400
    status, _, out = http("DELETE", srv.url + "/v1/models/r")
    assert status == 200 and json.loads(out)["deleted"] == "r"
    wait_for(lambda: http("GET", srv.url + "/v1/models/r")[0] == 404, 20, "r gone")
    status, _, _ = http("POST", srv.url + "/v2/models/r/infer", json.dumps(x).encode())
    assert status == 404
    assert leftovers(repo) == []
    assert http("DELETE", srv.url + "/v1/models/r")[0] == 404


def test_registration_is_off_without_import_roots_and_needs_the_token(dirs, serve) -> None:
    repo, imports = dirs
    srv = serve(repo, env={"ZEROSERVE_ADMIN_TOKEN": "s3cret"})
    save_versioned(imports / "good", 3.0)
    status, doc = post(srv.url, body("r", imports / "good"))
    assert status == 401 and "Bearer" in doc["error"]
    status, doc = post(srv.url, body("r", imports / "good"), Authorization="Bearer nope")
    assert status == 403 and "token" in doc["error"]
    status, doc = post(srv.url, body("r", imports / "good"), Authorization="Bearer s3cret")
    assert status == 403 and "registration is disabled" in doc["error"]
    assert http("DELETE", srv.url + "/v1/models/m")[0] == 401
    assert http("GET", srv.url + "/v1/models")[0] == 200  # reads stay open
    assert leftovers(repo) == []


class Parts:
    """Broker, gateway and (when asked) a worker as separate processes, so a test sees
    the window before any worker has connected; every one reaped."""

    def __init__(self, repo: Path, imports: Path) -> None:
        self.runtime = short_tmpdir("zsrt")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.start("broker", "--model-dir", str(repo), "--import-root", str(imports))
        self.start("gateway", "--http-port", str(self.port))

    def start(self, role: str, *argv: str) -> None:
        log = open(self.runtime / f"{role}.log", "wb")
        with log:
            self.procs.append(subprocess.Popen(
                [*ZEROSERVE, role, "--runtime-dir", str(self.runtime), *argv],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

    def answers(self, path: str) -> bool:
        try:
            return http("GET", self.url + path, timeout=2)[0] == 200
        except OSError:
            return False

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.runtime, ignore_errors=True)


@pytest.fixture
def parts(dirs):
    repo, imports = dirs
    started = Parts(repo, imports)
    yield started
    started.stop()


def test_not_ready_and_a_retryable_503_until_a_worker_connects(dirs, parts) -> None:
    _, imports = dirs
    save_versioned(imports / "good", 3.0)
    wait_for(lambda: parts.answers("/v2/health/live"), 30, "the gateway to listen")
    status, _, out = http("GET", parts.url + "/v2/health/ready")
    assert status == 503 and b"no worker is connected" in out, out
    def register() -> Any:
        got = http("POST", parts.url + "/v1/models",
                   json.dumps(body("r", imports / "good")).encode(),
                   {"Content-Type": "application/json"})
        # the control socket can connect after the readiness one (a full run saw it)
        return None if b"not reachable" in got[2] else got
    status, headers, out = wait_for(register, 20, "the broker's control socket")
    assert status == 503 and headers.get("retry-after") == "1", (status, out)
    assert "no worker is connected yet" in json.loads(out)["error"]

    parts.start("worker", "--index", "0", "--threads", "1")
    wait_for(lambda: http("GET", parts.url + "/v2/health/ready")[0] == 200, 60, "ready")


def test_register_then_infer_never_gets_404(dirs, serve) -> None:
    """The 201 means servable: a script that registers and at once infers (a tight
    loop, several models) never sees the window before the watcher and the load."""
    repo, imports = dirs
    srv = serve(repo, extra=["--import-root", str(imports)])
    save_versioned(imports / "good", 3.0)
    x = json.dumps({"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32",
                                "data": [1, 2, 3, 4]}]}).encode()
    for i in range(4):
        status, doc = post(srv.url, body(f"r{i}", imports / "good"))
        assert status == 201 and doc["ready"] is True, doc
        status, _, out = http("POST", srv.url + f"/v2/models/r{i}/infer", x)
        assert status == 200, (i, status, out)
    save_versioned(imports / "v2", 5.0)
    status, _, out = http("POST", srv.url + "/v1/models/r0/versions",
                          json.dumps({"model_path": str(imports / "v2")}).encode(),
                          {"Content-Type": "application/json"})
    doc = json.loads(out)
    assert status == 201 and doc["version"] == 2 and doc["ready"] is True, doc
    status, _, out = http("POST", srv.url + "/v2/models/r0/versions/2/infer", x)
    assert status == 200, out
    # ?wait=0 answers at the publish and says how to wait; a bad wait is the body's fault
    status, _, out = http("POST", srv.url + "/v1/models?wait=0",
                          json.dumps(body("late", imports / "good")).encode(),
                          {"Content-Type": "application/json"})
    doc = json.loads(out)
    assert status == 201 and (doc["ready"] or "?wait=" in doc["detail"]), doc
    status, _, out = http("POST", srv.url + "/v1/models?wait=soon",
                          json.dumps(body("bad", imports / "good")).encode(),
                          {"Content-Type": "application/json"})
    assert status == 400 and b"wait must be" in out


def patch_config(url: str, name: str, doc: object, **headers: str):
    status, _, out = http("PATCH", url + f"/v1/models/{name}/config", json.dumps(doc).encode(),
                          {"Content-Type": "application/json", **headers})
    return status, json.loads(out)


def test_the_hand_rollout_of_a_registered_model_runs_after_a_config_change(dirs,
                                                                           serve) -> None:
    """Registered without a plan (one version kept), pushed: the rollout is refused
    saying which setting to change; changed over the API, it runs. With a plan in the
    body, registration keeps the version before a push loaded from the start."""
    repo, imports = dirs
    srv = serve(repo, extra=["--import-root", str(imports)])
    save_versioned(imports / "v1", 1.0)
    save_versioned(imports / "v2", 2.0)
    assert post(srv.url, body("r", imports / "v1"))[0] == 201
    status, _, out = http("POST", srv.url + "/v1/models/r/versions",
                          json.dumps({"model_path": str(imports / "v2")}).encode(),
                          {"Content-Type": "application/json"})
    assert status == 201, out
    with Client(srv.control, timeout_s=10) as c:
        with pytest.raises(InferError) as err:
            c.control("rollout", model="r", version=2)
    assert 'set "version_policy": {"latest": 2} (PATCH /v1/models/r/config' in \
        err.value.message, err.value.message

    # refused changes write nothing
    status, doc = patch_config(srv.url, "r", {"version_policy": {"latest": 0}})
    assert status == 400 and "version_policy.latest" in doc["error"], doc
    status, doc = patch_config(srv.url, "r", {"name": "other"})
    assert status == 400 and "cannot change" in doc["error"]
    assert patch_config(srv.url, "nope", {"max_batch_size": 4})[0] == 404
    assert json.loads((repo / "r" / "config.json").read_text())["version_policy"] == \
        {"latest": 1}

    status, doc = patch_config(srv.url, "r", {"version_policy": {"latest": 2}})
    assert status == 200 and doc["applied"] is True, doc
    assert doc["config"]["version_policy"] == {"latest": 2}
    wait_for(lambda: json.loads(http("GET", srv.url + "/v1/models/r")[2])["ready"] == [1, 2],
             30, "version 1 loaded again beside 2")
    with Client(srv.control, timeout_s=10) as c:
        started = c.control("rollout", model="r", version=2)
    assert started["canary"] == 2 and started["stable"] == 1, started

    plan = {"steps": [50, 100], "dwell_s": 60}
    status, doc = post(srv.url, body("planned", imports / "v1", rollout=plan))
    assert status == 201, doc
    assert json.loads((repo / "planned" / "config.json").read_text())["version_policy"] \
        == {"latest": 2}


def test_a_config_change_needs_the_admin_token(dirs, serve) -> None:
    repo, _ = dirs
    srv = serve(repo, env={"ZEROSERVE_ADMIN_TOKEN": "s3cret"})
    assert patch_config(srv.url, "m", {"max_batch_size": 4})[0] == 401
    status, doc = patch_config(srv.url, "m", {"max_batch_size": 4},
                               Authorization="Bearer s3cret")
    assert status == 200 and doc["applied"] and doc["config"]["max_batch_size"] == 4, doc
