"""``zeroserve serve`` end to end: real processes, sockets, HTTP and TorchScript."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import zmq

from zeroserve.broker.client import AsyncClient, Client, InferError
from tests.conftest import ROOT, Server, http, linear_config, short_tmpdir, wait_for, write_model

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def server():
    repo = short_tmpdir("zsrepo")
    write_model(repo, "linear", 1, "nn.Linear(4, 3)", linear_config("linear"))
    write_model(repo, "linear", 2, "nn.Linear(4, 3)")
    (repo / "linear" / "config.json").write_text(json.dumps(
        linear_config("linear", version_policy={"all": True})))
    srv = Server(repo).wait_ready()
    wait_for(lambda: _ready_versions(srv) == [1, 2], 30, "both versions ready")
    yield srv
    srv.stop()


def _ready_versions(srv):
    with Client(srv.control, timeout_s=5) as c:
        return c.control("models")["models"]["linear"]["ready"]


def in_process(srv, version, x):
    module = torch.jit.load(str(srv.model_dir / "linear" / str(version) / "model.pt"))
    with torch.inference_mode():
        return module(torch.from_numpy(x)).numpy()


def v2_body(x, name="input", datatype="FP32", **extra):
    return json.dumps({"inputs": [{"name": name, "shape": list(x.shape), "datatype": datatype,
                                   "data": x.reshape(-1).tolist()}], **extra}).encode()


def test_http_predict_equals_the_model_in_process(server):
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    for path, version in (("/v2/models/linear/versions/1/infer", 1),
                          ("/v2/models/linear/infer", 2)):
        status, _, body = http("POST", server.url + path, v2_body(x, id="req-7"))
        assert status == 200, body
        doc = json.loads(body)
        assert doc["model_name"] == "linear" and doc["model_version"] == str(version)
        assert doc["id"] == "req-7"
        out = doc["outputs"][0]
        assert out["shape"] == [3, 3] and out["datatype"] == "FP32"
        got = np.array(out["data"], dtype=np.float32).reshape(3, 3)
        assert torch.allclose(torch.from_numpy(got),
                              torch.from_numpy(in_process(server, version, x)), atol=1e-6)


def test_direct_clients_equal_the_model_in_process(server):
    x = np.random.default_rng(1).standard_normal((2, 4)).astype(np.float32)
    expected = in_process(server, 1, x)
    with Client(server.frontend) as c:
        res = c.infer("linear", {"input": x}, version=1)
    assert res.version == 1 and res.stats["batch_size"] >= 2
    np.testing.assert_allclose(res.outputs["output"], expected, atol=1e-6)

    async def go():
        async with AsyncClient(server.frontend) as ac:
            assert await ac.wait_connected(5)
            import asyncio
            results = await asyncio.gather(*[ac.infer("linear", {"input": x[i:i + 1]},
                                                      version=1) for i in range(2)])
            return np.concatenate([r.outputs["output"] for r in results])
    import asyncio
    np.testing.assert_allclose(asyncio.run(go()), expected, atol=1e-6)


@pytest.mark.parametrize("body, status, needle", [
    (b"{not json", 400, "failed to parse the request JSON buffer: "),
    (b"[]", 400, "JSON object"),
    (v2_body(np.zeros((1, 4), np.float32), name="wrong"), 400,
     "unexpected inference input 'wrong' for model 'linear'"),
    (v2_body(np.zeros((1, 4), np.float32), datatype="INT32"), 400,
     "inference input 'input' data-type is 'INT32', but model 'linear' expects 'FP32'"),
    (v2_body(np.zeros((1, 5), np.float32)), 400,
     "unexpected shape for input 'input' for model 'linear'. Expected [-1,4], got [1,5]"),
    (v2_body(np.zeros((9, 4), np.float32)), 400,
     "inference request batch-size must be <= 8 for 'linear'"),
    (json.dumps({"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32",
                             "data": [1, 2]}]}).encode(), 400, "2 elements"),
    (json.dumps({"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32",
                             "data": ["a", "b", "c", "d"]}]}).encode(), 400, "not FP32"),
])
def test_bad_input_gets_a_clear_400(server, body, status, needle):
    code, headers, got = http("POST", server.url + "/v2/models/linear/infer", body)
    assert code == status, got
    assert headers["content-type"] == "application/json"
    assert needle in json.loads(got)["error"]


def test_unknown_model_or_version_is_404(server):
    body = v2_body(np.zeros((1, 4), np.float32))
    for path, needle in (("/v2/models/nope/infer",
                          "Request for unknown model: 'nope' is not found"),
                         ("/v2/models/linear/versions/9/infer",
                          "Request for unknown model: 'linear' version 9 is not found"),
                         ("/v2/models/nope", "unknown model")):
        code, _, got = http("POST" if path.endswith("infer") else "GET", server.url + path,
                            body if path.endswith("infer") else None)
        assert code == 404 and needle in json.loads(got)["error"]


def test_model_metadata_and_health(server):
    code, _, got = http("GET", server.url + "/v2/models/linear")
    meta = json.loads(got)
    assert code == 200 and meta["versions"] == ["1", "2"]
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 4]}]
    for path in ("/v2/health/live", "/v2/health/ready", "/healthz", "/readyz",
                 "/v2/models/linear/ready", "/v2/models/linear/versions/2/ready"):
        assert http("GET", server.url + path)[0] == 200, path


def test_garbage_on_every_broker_socket_is_dropped_and_serving_goes_on(server):
    ctx = zmq.Context.instance()
    for name in ("frontend", "backend", "control"):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 5000)  # deliver before close
        sock.connect(f"ipc://{server.runtime}/{name}")
        for frames in ([b"\x01"], [b"\xff", b"junk"], [b"\x01", b"\xc1\xc1"],
                       [b"\x12", b"\x81\xa1v\x01"], [b"\x13", b"\x80", b"x"]):
            sock.send_multipart(frames)
        sock.close()
    with Client(server.control) as c:
        wait_for(lambda: all(f'zeroserve_bad_messages_total{{reason="malformed",socket="{name}"}}'
                             in c.control("metrics")["broker"]
                             for name in ("frontend", "backend", "control")),
                 10, "bad messages counted on every socket")
    x = np.ones((1, 4), np.float32)
    with Client(server.frontend) as c:
        np.testing.assert_allclose(c.infer("linear", {"input": x}, version=1).outputs["output"],
                                   in_process(server, 1, x), atol=1e-6)


def test_gateway_and_broker_never_import_torch():
    """Every module of gateway/ and broker/ (found on disk, not listed by hand), plus the
    torch-free parts of models/ and workers/, in one fresh interpreter."""
    modules = [f"zeroserve.{'.'.join(path.relative_to(ROOT).with_suffix('').parts)}"
               for folder in ("gateway", "broker") for path in sorted((ROOT / folder).rglob("*.py"))
               if path.name not in ("__init__.py", "__main__.py")]
    modules += ["zeroserve.workers.supervisor", "zeroserve.workers.serve",
                "zeroserve.models.repository", "zeroserve.models.watcher"]
    code = (f"import sys, importlib; [importlib.import_module(m) for m in {modules!r}]; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


SLOW = ("nn.Sequential(nn.Linear(4, 256), *[nn.Linear(256, 256) for _ in range(30)], "
        "nn.Linear(256, 3))")


def test_sigkill_of_a_worker_under_load_answers_every_request(serve):
    repo = short_tmpdir("zsrepo")
    write_model(repo, "slow", 1, SLOW, linear_config("slow", mbs=8))
    srv = serve(repo, workers=2)
    with Client(srv.control) as c:  # both hold the model: the kill leaves one that can serve
        wait_for(lambda: [w["models"] for w in c.control("status")["workers"]]
                 == [["slow/1"]] * 2, 30, "two workers serving 'slow'")
    outcomes: list[str] = []
    lock = threading.Lock()
    stop = threading.Event()

    def load():
        with Client(srv.frontend, timeout_s=30) as c:
            for _ in range(400):
                if stop.is_set():
                    return
                try:
                    c.infer("slow", {"input": np.ones((2, 4), np.float32)})
                    what = "ok"
                except InferError as exc:
                    what = f"{exc.code.value} retryable={exc.retryable}: {exc.message}"
                with lock:
                    outcomes.append(what)

    threads = [threading.Thread(target=load) for _ in range(8)]
    for t in threads:
        t.start()
    wait_for(lambda: outcomes.count("ok") >= 20, 30, "load to flow")
    victim = srv.pids("worker --")[0]
    os.kill(victim, signal.SIGKILL)
    n_at_kill = len(outcomes)
    wait_for(lambda: len(outcomes) >= n_at_kill + 50, 30, "requests after the kill")
    stop.set()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a request hung"
    failures = [o for o in outcomes if o != "ok"]
    # a request lost with its worker is retried on the other one, or fails retryably
    assert all("retryable=True" in f for f in failures), failures
    assert outcomes.count("ok") >= 70, failures
    with Client(srv.control) as c:  # the supervisor brought the worker back
        wait_for(lambda: len(c.control("status")["workers"]) == 2, 30, "worker restarted")
    assert victim not in srv.pids("worker --")


def test_sigterm_stops_every_child(tiny_repo):
    srv = Server(tiny_repo).wait_ready()
    children = srv.pids("")
    assert len(children) >= 3
    srv.proc.send_signal(signal.SIGTERM)
    srv.proc.wait(40)
    wait_for(lambda: not any(Path(f"/proc/{pid}").exists() and
                             "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
                             for pid in children), 20, "children to exit")
    srv.stop()
