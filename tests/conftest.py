"""Shared fixtures: tiny TorchScript models made by the tests, real server processes
on ipc:// endpoints in a short temp folder and a free loopback port."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from hypothesis import settings

from tests.layers import starts_processes

ROOT = Path(__file__).resolve().parent.parent
# the one command, run from the checkout (the installed copy is a snapshot of it)
ZEROSERVE = [sys.executable, str(ROOT / "bin" / "zeroserve")]
# how each component's process shows in `ps` (zeroserve serve starts them by module)
ROLE_MODULES = {"broker": "zeroserve.broker.server.main", "worker": "zeroserve.workers.main",
                "gateway": "zeroserve.gateway.serve", "": "zeroserve"}
# Many servers run at once here (and other checkouts' test runs beside this one): the
# fixed default gRPC port would collide. A server a test starts has no gRPC unless the
# test asks (Server below always does, on a free port of its own).
os.environ.setdefault("ZEROSERVE_GATEWAY_GRPC_PORT", "0")
os.environ.setdefault("ZEROSERVE_SERVE_GRPC_PORT", "0")
# The property tests check what decodes and what the scheduler does, not how fast: on a
# host shared with other test runs one example can take past hypothesis's 200 ms default
# and fail a test that is right (seen once at load 14, not reproducible by its seed).
# pytest-timeout still bounds every test. Between edits a property test tries a tenth of
# its examples (the fast layer stays under a minute); CI (.ci/run sets
# HYPOTHESIS_PROFILE=ci) tries them all.
FULL_EXAMPLES = os.environ.get("HYPOTHESIS_PROFILE") == "ci"
settings.register_profile("ci", deadline=None)
settings.register_profile("fast", deadline=None, max_examples=10)
settings.load_profile("ci" if FULL_EXAMPLES else "fast")


def examples(full: int) -> int:
    """A property test's example count: ``full`` in CI, a tenth of it (10 at least)
    between edits."""
    return full if FULL_EXAMPLES else max(10, full // 10)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """``e2e``: the tests that start a process or a server, found in their code (see
    tests/layers.py), but for a short static tool (``tool``); ``pytest -m "not e2e and
    not slow"`` runs the fast layer."""
    for item in items:
        if not isinstance(item, pytest.Function):
            continue
        names = [item.originalname] + ([item.cls.__name__] if item.cls is not None else [])
        if starts_processes(Path(item.path), *names) and not item.get_closest_marker("tool"):
            item.add_marker(pytest.mark.e2e)


def load_cli() -> Any:
    """bin/zeroserve as a module, to call its main() in-process."""
    import importlib.machinery
    import importlib.util

    loader = importlib.machinery.SourceFileLoader("zeroserve_bin", str(ROOT / "bin" / "zeroserve"))
    spec = importlib.util.spec_from_loader("zeroserve_bin", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def wait_for(cond: Callable[[], Any], timeout_s: float = 20.0, what: str = "condition") -> Any:
    """Poll ``cond`` until it returns something truthy; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    delay = 0.005
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(delay)  # noqa: sleep-ok (polling interval of a deadline-bound wait)
        delay = min(delay * 2, 0.1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def short_tmpdir(prefix: str) -> Path:
    # ipc:// paths must stay under zmq.IPC_PATH_MAX_LEN (107 bytes)
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


def write_model(repo: Path, name: str, version: int, factory: str,
                config: dict[str, Any] | None = None) -> Path:
    """Script a tiny model in a subprocess-free way: the test process imports torch."""
    import torch

    torch.manual_seed(version)
    module = eval(factory, {"torch": torch, "nn": torch.nn})
    vdir = repo / name / str(version)
    vdir.mkdir(parents=True, exist_ok=True)
    torch.jit.save(torch.jit.script(module.eval()), str(vdir / "model.pt"))
    if config is not None:
        (repo / name / "config.json").write_text(json.dumps(config))
    return vdir


def linear_config(name: str, n_in: int = 4, n_out: int = 3, mbs: int = 8,
                  **extra: Any) -> dict[str, Any]:
    return {"name": name, "platform": "pytorch_torchscript", "max_batch_size": mbs,
            "inputs": [{"name": "input", "datatype": "FP32", "shape": [n_in]}],
            "outputs": [{"name": "output", "datatype": "FP32", "shape": [n_out]}], **extra}


@pytest.fixture
def tiny_repo() -> Iterator[Path]:
    repo = short_tmpdir("zsrepo")
    write_model(repo, "linear", 1, "nn.Linear(4, 3)", linear_config("linear"))
    yield repo
    shutil.rmtree(repo, ignore_errors=True)


class Server:
    """``zeroserve serve`` as a real process group; always reaped."""

    def __init__(self, model_dir: Path, workers: int = 1, extra: list[str] | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.runtime = short_tmpdir("zsrt")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.grpc_port = free_port()
        self.grpc_url = f"127.0.0.1:{self.grpc_port}"   # as tritonclient.grpc takes it
        self.model_dir = model_dir
        self.log_path = self.runtime / "serve.log"
        argv = [*ZEROSERVE, "serve",
                "--model-dir", str(model_dir), "--http-port", str(self.port),
                "--grpc-port", str(self.grpc_port),
                "--runtime-dir", str(self.runtime), "--workers", str(workers),
                "--threads", "1", "--log-level", "info",
                # the gateway's loop-lag shed (50 ms by default) fires on a host loaded by
                # other test runs and answers 503 where a test expects its own answer
                # (a 504, a 400); tests of the shed set their own (extra comes after)
                "--shed-lag-ms", "1000", *(extra or [])]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})},
                                     start_new_session=True)

    @property
    def frontend(self) -> str:
        return f"ipc://{self.runtime}/frontend"

    @property
    def control(self) -> str:
        return f"ipc://{self.runtime}/control"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout_s: float = 60.0) -> "Server":
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"serve exited early:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.url + "/v2/health/ready", timeout=1) as r:
                    return r.status == 200
            except OSError:
                return False
        try:
            wait_for(ready, timeout_s, "the server to become ready")
        except AssertionError:
            log = self.log()
            self.stop()
            raise AssertionError(f"server not ready:\n{log}") from None
        return self

    def pids(self, role: str) -> list[int]:
        """PIDs of this server's children whose command line holds ``role``."""
        pattern = ROLE_MODULES[role.strip(" -")]
        out = subprocess.run(["pgrep", "-s", str(self.proc.pid), "-f", pattern],
                             capture_output=True, text=True)
        return [int(x) for x in out.stdout.split()]

    @staticmethod
    def alive(pid: int) -> bool:
        """Whether ``pid`` runs (a zombie waiting for its parent does not count)."""
        try:
            return "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(40)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # anything left in the group
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._log.close()
        shutil.rmtree(self.runtime, ignore_errors=True)


@pytest.fixture
def serve() -> Iterator[Callable[..., Server]]:
    started: list[Server] = []

    def start(model_dir: Path, **kw: Any) -> Server:
        server = Server(model_dir, **kw)
        started.append(server)
        return server.wait_ready()

    yield start
    for server in started:
        server.stop()


def http(method: str, url: str, body: bytes | None = None,
         headers: dict[str, str] | None = None,
         timeout: float = 30.0) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()
