"""Server readiness tells the truth at start-up: a model that loads slowly (a Python
handler waiting on a file the test creates) keeps /v2/health/ready, tritonclient's
is_server_ready (sync and aio), systemd's READY=1 and serve's "ready" line false under
strict readiness, and only one ready model is needed under ``--readiness any``."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
from pathlib import Path
from typing import Iterator

import grpc
import pytest
import tritonclient.http as triton
import tritonclient.http.aio as triton_aio

from zeroserve.broker.client import Client
from zeroserve.models.proto import health_pb2
from tests.conftest import Server, http, linear_config, short_tmpdir, wait_for, write_model

pytestmark = pytest.mark.timeout(180)

SLOW = '''
import os
import time


class Model:
    """Loads only once the test creates RELEASE (bounded, so a failed test ends)."""

    def load(self, version_dir, device):
        deadline = time.monotonic() + 90
        while not os.path.exists(RELEASE) and time.monotonic() < deadline:
            time.sleep(0.05)  # noqa: sleep-ok (waits on a file the test creates)

    def predict(self, inputs):
        return {"output": inputs["input"]}
'''


def write_slow(repo: Path, release: Path) -> None:
    (repo / "slow" / "1").mkdir(parents=True)
    (repo / "slow" / "1" / "model.py").write_text(SLOW.replace("RELEASE", repr(str(release))))
    (repo / "slow" / "config.json").write_text(json.dumps(
        {**linear_config("slow", n_out=4), "platform": "python"}))


def broken_version(repo: Path, name: str, version: int) -> None:
    tmp = repo / name / f".tmp-{version}"
    tmp.mkdir()
    (tmp / "model.pt").write_bytes(b"not a TorchScript archive")
    os.rename(tmp, repo / name / str(version))


def good_version(repo: Path, name: str, version: int) -> None:
    scratch = short_tmpdir("zsver")
    write_model(scratch, name, version, "nn.Linear(4, 3)")
    os.rename(scratch / name / str(version), repo / name / str(version))
    shutil.rmtree(scratch)


@pytest.fixture
def repo() -> Iterator[tuple[Path, Path]]:
    repo = short_tmpdir("zsrepo")
    release = repo.parent / f"{repo.name}.release"
    write_model(repo, "linear", 1, "nn.Linear(4, 3)", linear_config("linear"))
    write_slow(repo, release)
    yield repo, release
    shutil.rmtree(repo, ignore_errors=True)
    release.unlink(missing_ok=True)


def ready(srv: Server) -> tuple[int, str]:
    status, _, body = http("GET", srv.url + "/v2/health/ready")
    return status, (json.loads(body)["error"] if status != 200 else "")


def linear_loaded(srv: Server) -> bool:
    try:
        with Client(srv.control, timeout_s=2) as c:
            return c.control("models")["models"]["linear"]["ready"] == [1]
    except Exception:  # the broker is still starting
        return False


async def aio_ready(url: str) -> bool:
    client = triton_aio.InferenceServerClient(url)
    try:
        return bool(await client.is_server_ready())
    finally:
        await client.close()


class Notify:
    """systemd's notify socket, as the test's stand-in; the children inherit it."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.setblocking(False)
        self.seen: list[str] = []

    def gateway_ready(self) -> bool:
        while True:
            try:
                self.seen.append(self.sock.recv(4096).decode())
            except BlockingIOError:
                break
        return any("READY=1" in m.splitlines() and "STATUS=serving" in m for m in self.seen)


def test_strict_readiness_waits_for_the_slow_model(repo, tmp_path) -> None:
    root, release = repo
    notify = Notify(tmp_path / "notify")
    srv = Server(root, env={"NOTIFY_SOCKET": str(tmp_path / "notify")})
    try:
        wait_for(lambda: linear_loaded(srv), 60, "linear loaded")
        status, why = ready(srv)
        assert status == 503 and "'slow'" in why and "'linear'" not in why, why
        client = triton.InferenceServerClient(srv.url.removeprefix("http://"))
        assert client.is_server_live() and not client.is_server_ready()
        assert not asyncio.run(aio_ready(srv.url.removeprefix("http://")))
        assert client.is_model_ready("linear") and client.is_model_ready("linear", "1")
        assert not client.is_model_ready("slow") and not client.is_model_ready("linear", "2")
        assert not notify.gateway_ready(), notify.seen
        assert "zeroserve ready on" not in srv.log()

        release.touch()
        wait_for(lambda: ready(srv)[0] == 200, 60, "ready once slow has loaded")
        assert client.is_server_ready() and client.is_model_ready("slow")
        assert asyncio.run(aio_ready(srv.url.removeprefix("http://")))
        wait_for(notify.gateway_ready, 10, "the gateway's READY=1")
        wait_for(lambda: "zeroserve ready on" in srv.log(), 10, "serve's ready line")

        # a failed load keeps strict readiness false, naming the model, until fixed
        broken_version(root, "linear", 2)
        wait_for(lambda: "'linear' failed" in ready(srv)[1], 30, "linear/2 to block readiness")
        assert not client.is_server_ready() and client.is_model_ready("linear")
        good_version(root, "linear", 3)
        wait_for(lambda: ready(srv)[0] == 200, 30, "ready again with linear/3")
        # ... unless the model's config says it is optional
        (root / "spare").mkdir()
        (root / "spare" / "config.json").write_text(json.dumps(
            linear_config("spare", optional=True)))
        good_version(root, "spare", 1)
        wait_for(lambda: client.is_model_ready("spare"), 30, "spare/1")
        broken_version(root, "spare", 2)
        with Client(srv.control, timeout_s=5) as c:
            wait_for(lambda: "spare" in c.control("models")["errors"], 30, "spare/2 to fail")
        assert ready(srv)[0] == 200 and client.is_server_ready()
        # an optional model whose very first load fails does not block either, and a
        # failed model whose folder is deleted leaves the errors
        (root / ".tmp-extra").mkdir()
        (root / ".tmp-extra" / "config.json").write_text(json.dumps(
            linear_config("extra", optional=True)))
        os.rename(root / ".tmp-extra", root / "extra")
        broken_version(root, "extra", 1)
        with Client(srv.control, timeout_s=5) as c:
            wait_for(lambda: "extra" in c.control("models")["errors"], 30, "extra to fail")
            assert "extra" in c.control("models")["optional"]
            assert ready(srv)[0] == 200
            shutil.rmtree(root / "spare")
            wait_for(lambda: "spare" not in c.control("models")["errors"], 30,
                     "spare's failure to leave with its folder")
        client.close()
    finally:
        srv.stop()
        notify.sock.close()


def test_readiness_any_is_ready_with_one_model(repo) -> None:
    root, release = repo
    srv = Server(root, extra=["--readiness", "any"])
    try:
        srv.wait_ready()   # the slow model has not loaded: it waits on release
        client = triton.InferenceServerClient(srv.url.removeprefix("http://"))
        assert client.is_server_ready() and not client.is_model_ready("slow")
        release.touch()
        wait_for(lambda: client.is_model_ready("slow"), 60, "slow to load")
        client.close()
    finally:
        srv.stop()


def test_grpc_health_watch_follows_readiness(repo) -> None:
    """grpc.health.v1's Watch streams the status now and then each change: NOT_SERVING
    while the slow model loads, SERVING once it has; an unknown service is
    SERVICE_UNKNOWN on the stream (Check answers it NOT_FOUND)."""
    root, release = repo
    srv = Server(root)
    status = health_pb2.HealthCheckResponse
    try:
        wait_for(lambda: linear_loaded(srv), 60, "linear loaded")
        with grpc.insecure_channel(srv.grpc_url) as channel:
            grpc.channel_ready_future(channel).result(timeout=30)
            watch = channel.unary_stream(
                "/grpc.health.v1.Health/Watch",
                request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                response_deserializer=status.FromString)
            ready = watch(health_pb2.HealthCheckRequest(service=""), timeout=90)
            assert next(ready).status == status.NOT_SERVING
            release.touch()
            assert next(ready).status == status.SERVING   # the change, within the timeout
            ready.cancel()
            for service, first in (("nothing", status.SERVICE_UNKNOWN),
                                   ("live", status.SERVING)):
                stream = watch(health_pb2.HealthCheckRequest(service=service), timeout=30)
                assert next(stream).status == first
                stream.cancel()
            # a draining gateway says NOT_SERVING and ends the watch, so that its gRPC
            # drain does not wait out the grace period for a stream that never ends
            stream = watch(health_pb2.HealthCheckRequest(service=""), timeout=30)
            assert next(stream).status == status.SERVING
            for pid in srv.pids("gateway"):
                os.kill(pid, signal.SIGTERM)
            assert [m.status for m in stream] == [status.NOT_SERVING]
    finally:
        srv.stop()
