"""Pushing a version over the API (``POST /v1/models/{name}/versions`` and ``zeroserve
push``), and the build every answer names: HTTP's X-Model-Build, gRPC's trailing
metadata, the direct client's ``InferResult.build``."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from tests.conftest import ZEROSERVE, http, linear_config, short_tmpdir, wait_for
from tests.e2e.test_lifecycle import save_versioned
from zeroserve.broker.client import Client
from zeroserve.models.proto import grpc_service_pb2 as pb
from zeroserve.models.repository import version_sha256

pytestmark = pytest.mark.timeout(150)

X = {"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}


@pytest.fixture
def dirs():
    repo, imports = short_tmpdir("zsrepo"), short_tmpdir("zsimp")
    save_versioned(repo / "m" / "1", 1.0)
    (repo / "m" / "config.json").write_text(json.dumps(linear_config("m")))
    yield repo, imports
    shutil.rmtree(repo, ignore_errors=True)
    shutil.rmtree(imports, ignore_errors=True)


def push(url: str, name: str, doc: object = None, raw: bytes | None = None,
         query: str = "", **headers: str) -> tuple[int, dict]:
    body = raw if raw is not None else json.dumps(doc).encode()
    ctype = "application/octet-stream" if raw is not None else "application/json"
    status, _, out = http("POST", f"{url}/v1/models/{name}/versions{query}", body,
                          {"Content-Type": ctype, **headers})
    return status, json.loads(out)


def infer(url: str) -> tuple[int, str, float]:
    """The version that answered, its X-Model-Build, and the output's first value."""
    status, headers, out = http("POST", url + "/v2/models/m/infer", json.dumps(X).encode())
    assert status == 200, out
    doc = json.loads(out)
    build = {k.lower(): v for k, v in headers.items()}.get("x-model-build", "")
    return int(doc["model_version"]), build, \
        doc["outputs"][0]["data"][0]


def serving(url: str, version: int) -> bool:
    return infer(url)[0] == version


def leftovers(repo: Path) -> list[str]:
    return sorted(str(p.relative_to(repo)) for p in repo.rglob(".*"))


def test_push_build_identity_and_bad_pushes(dirs, serve) -> None:
    repo, imports = dirs
    srv = serve(repo, extra=["--import-root", str(imports)])
    sha1 = version_sha256(repo / "m" / "1")
    version, build, value = infer(srv.url)
    assert (version, build, value) == (1, f"1/{sha1}", 1.0)

    save_versioned(imports / "v2", 2.0)
    status, doc = push(srv.url, "m", {"model_path": str(imports / "v2")})
    sha2 = version_sha256(imports / "v2")
    assert status == 201 and doc == {"name": "m", "version": 2, "sha256": sha2,
                                     "state": "published", "ready": True}, doc
    assert version_sha256(repo / "m" / "2") == sha2
    wait_for(lambda: serving(srv.url, 2), 30, "version 2 to serve")
    assert infer(srv.url) == (2, f"2/{sha2}", 2.0)

    # every HTTP route that infers names it
    for path, doc in (("/models/m/predict", {"inputs": {"input": [1, 2, 3, 4]}}),
                      ("/predictions/m", [1, 2, 3, 4]),
                      ("/v2/models/m/generate", {"input": [1, 2, 3, 4]}),
                      ("/v2/models/m/generate_stream", {"input": [1, 2, 3, 4]})):
        status, headers, out = http("POST", srv.url + path, json.dumps(doc).encode(),
                                    {"Content-Type": "application/json"})
        got = {k.lower(): v for k, v in headers.items()}.get("x-model-build")
        assert status == 200 and got == f"2/{sha2}", (path, status, headers, out)

    # the direct client and gRPC name the same build
    with Client(srv.frontend) as c:
        got = c.infer("m", {"input": np.ones((1, 4), np.float32)})
        assert (got.version, got.build) == (2, sha2)
    with grpc.insecure_channel(srv.grpc_url) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                   request_serializer=pb.ModelInferRequest.SerializeToString,
                                   response_deserializer=pb.ModelInferResponse.FromString)
        req = pb.ModelInferRequest(model_name="m",
                                   raw_input_contents=[np.ones((1, 4), np.float32).tobytes()])
        req.inputs.add(name="input", datatype="FP32", shape=[1, 4])
        _, rpc = call.with_call(req, timeout=30)
        assert ("x-model-build", f"2/{sha2}") in tuple(rpc.trailing_metadata())

    # the same content again: done already, nothing changes; other content: a conflict
    status, doc = push(srv.url, "m", {"model_path": str(imports / "v2"), "version": 2})
    assert status == 200 and doc["state"] == "unchanged" and doc["sha256"] == sha2
    save_versioned(imports / "other", 7.0)
    status, doc = push(srv.url, "m", {"model_path": str(imports / "other")}, query="?version=2")
    assert status == 409 and "exists with other content" in doc["error"], doc

    # bad pushes: a clear 4xx, nothing published, version 2 still serving
    (imports / "corrupt").mkdir()
    (imports / "corrupt" / "model.pt").write_bytes(b"not a torchscript archive")
    status, doc = push(srv.url, "m", {"model_path": str(imports / "corrupt")})
    assert status == 422 and "m/3" in doc["error"], doc
    wrong = imports / "wrong"
    wrong.mkdir()
    torch.jit.save(torch.jit.script(torch.nn.Linear(5, 3)), str(wrong / "model.pt"))
    status, doc = push(srv.url, "m", {"model_path": str(wrong)})
    assert status == 422, doc   # 4 inputs in the model's config, 5 in the model
    status, doc = push(srv.url, "m", {"model_path": str(imports / "v2"),
                                      "config": {"max_batch_size": 2}})
    assert status == 400 and "config as it is" in doc["error"]
    status, doc = push(srv.url, "m", {"model_path": str(imports / "v2"), "version": 0})
    assert status == 400 and "version" in doc["error"]
    status, doc = push(srv.url, "m", raw=b"garbage", query="?version=3")
    assert status == 422, doc
    status, doc = push(srv.url, "nope", {"model_path": str(imports / "v2")})
    assert status == 404
    status, doc = push(srv.url, "m", {"model_path": str(repo / "m" / "1")})
    assert status == 403 and "outside the import roots" in doc["error"]
    assert sorted(p.name for p in (repo / "m").iterdir()) == ["1", "2", "config.json"]
    assert leftovers(repo) == []
    assert infer(srv.url) == (2, f"2/{sha2}", 2.0)

    # an upload (no import root needed for it) as version 5
    save_versioned(imports / "v5", 5.0)
    data = (imports / "v5" / "model.pt").read_bytes()
    status, doc = push(srv.url, "m", raw=data, query="?version=5")
    assert status == 201 and doc["version"] == 5, doc
    wait_for(lambda: serving(srv.url, 5), 30, "version 5 to serve")
    assert infer(srv.url)[1] == f"5/{version_sha256(repo / 'm' / '5')}"


def test_push_from_the_command_line_with_the_admin_token(dirs, serve) -> None:
    repo, imports = dirs
    srv = serve(repo, extra=["--import-root", str(imports)],
                env={"ZEROSERVE_ADMIN_TOKEN": "s3cret"})
    save_versioned(imports / "v2", 2.0)
    status, doc = push(srv.url, "m", {"model_path": str(imports / "v2")})
    assert status == 401
    status, doc = push(srv.url, "m", {"model_path": str(imports / "v2")},
                       Authorization="Bearer nope")
    assert status == 403

    def cli(*argv: str, token: str = "s3cret") -> subprocess.CompletedProcess[str]:
        return subprocess.run([*ZEROSERVE, "push", *argv, "--runtime-dir", str(srv.runtime),
                               "--timeout", "10"], capture_output=True, text=True, timeout=60,
                              env={"ZEROSERVE_ADMIN_TOKEN": token, "PATH": "/usr/bin:/bin"})

    out = cli("m", str(imports / "v2" / "model.pt"), token="wrong")
    assert out.returncode != 0 and "token" in out.stderr
    out = cli("m", str(imports / "v2" / "model.pt"), "--version", "3")
    assert out.returncode == 0 and "version 3 published" in out.stdout, out.stderr
    out = cli("m", str(imports / "v2"), "--version", "3", "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["kind"] == "same", out.stderr
    out = cli("m", str(repo / "m" / "1" / "model.pt"), "--version", "3")
    assert out.returncode != 0 and "exists with other content" in out.stderr
    wait_for(lambda: serving(srv.url, 3), 30, "version 3 to serve")
    assert infer(srv.url)[2] == 2.0


def test_no_request_sent_after_the_commit_is_answered_by_the_old_build(dirs, serve) -> None:
    """Two workers under load while version 2 is pushed: every answer's build is the
    one that computed it (the outputs tell), and every request sent once the broker
    committed (its monotonic clock is this host's) is answered by version 2."""
    repo, imports = dirs
    srv = serve(repo, workers=2, extra=["--import-root", str(imports)])
    sha1 = version_sha256(repo / "m" / "1")
    save_versioned(imports / "v2", 2.0)
    sha2 = version_sha256(imports / "v2")
    got: list[tuple[float, float, str]] = []
    errors: list[str] = []
    stop = threading.Event()

    def load() -> None:
        with Client(srv.frontend) as c:
            while not stop.is_set():
                sent = time.monotonic()
                try:
                    r = c.infer("m", {"input": np.ones((1, 4), np.float32)})
                except Exception as exc:  # noqa: BLE001 - counted, and fails the test
                    errors.append(repr(exc))
                    continue
                got.append((sent, float(r.outputs["output"][0, 0]), r.build))

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: len(got) > 50, 30, "answers from version 1")
        status, doc = push(srv.url, "m", {"model_path": str(imports / "v2")})
        assert status == 201, doc

        def committed() -> float | None:
            with Client(srv.control) as c:
                m = c.control("models")["models"]["m"]
            return m.get("committed_s") if m["versions"] == [2] else None
        commit_s = wait_for(committed, 30, "the commit of version 2")
        wait_for(lambda: sum(1 for s, _, _ in got if s > commit_s) > 50, 30, "answers after")
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not errors, errors[:3]
    assert {(value, build) for _, value, build in got} == {(1.0, sha1), (2.0, sha2)}
    assert all(build == sha2 for sent, _, build in got if sent > commit_s)
