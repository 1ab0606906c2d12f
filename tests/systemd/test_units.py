"""The systemd units: they verify, and the command lines they run speak the notify
protocol truthfully (READY=1 only once the component serves, STOPPING=1 on SIGTERM)."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

from tests.conftest import ROOT, free_port, linear_config, short_tmpdir, wait_for, write_model
from zeroserve.broker.client import Client

UNITS = ROOT / "systemd"
NAMES = ["zeroserve.target", "zeroserve-broker.service", "zeroserve-worker@.service",
         "zeroserve-gateway.service"]
BINARY = Path(sys.executable).parent / "zeroserve"

pytestmark = pytest.mark.timeout(120)


def unit(name: str) -> dict[str, list[str]]:
    """Each key of a unit file with all its values (sections flattened)."""
    out: dict[str, list[str]] = {}
    for line in (UNITS / name).read_text().splitlines():
        if "=" in line and not line.lstrip().startswith(("#", "[")):
            key, value = line.split("=", 1)
            out.setdefault(key.strip(), []).append(value.strip())
    return out


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
def test_systemd_analyze_verify_passes_on_every_unit(tmp_path: Path) -> None:
    for name in NAMES:
        text = (UNITS / name).read_text().replace("/usr/local/bin/zeroserve", str(BINARY))
        (tmp_path / name).write_text(text)
    paths = [str(tmp_path / n) for n in NAMES if "@." not in n]
    paths.append(str(tmp_path / "zeroserve-worker@0.service"))  # an instance of the template
    out = subprocess.run(["systemd-analyze", "verify", "--man=no", *paths],
                         capture_output=True, text=True, cwd=tmp_path, timeout=60)
    # verify exits 0 on unknown keys and bad values too; it only *says* so
    complaints = [line for line in (out.stdout + out.stderr).splitlines()
                  if str(tmp_path) in line or "zeroserve" in line]
    assert out.returncode == 0 and not complaints, out.stdout + out.stderr


def test_units_are_notify_hardened_and_stop_slower_than_they_drain() -> None:
    for name in NAMES[1:]:
        u = unit(name)
        assert u["Type"] == ["notify"] and u["ExecStart"][0].startswith("/usr/local/bin/zeroserve ")
        for key in ("NoNewPrivileges", "PrivateTmp"):
            assert u[key] == ["yes"], (name, key)
        assert u["ProtectSystem"] == ["strict"] and u["User"] == ["zeroserve"]
        assert "/run/zeroserve" in u["ReadWritePaths"][0]
        assert float(u["TimeoutStopSec"][0]) > 30  # the default drain bound
        assert u["WatchdogSec"]
    assert unit("zeroserve-broker.service")["RuntimeDirectory"] == ["zeroserve"]
    assert unit("zeroserve-broker.service")["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    worker = unit("zeroserve-worker@.service")
    assert "CUDA_VISIBLE_DEVICES=%i" in worker["Environment"]
    # a device map (a MIG slice per instance): the instance's own file, read last, wins
    assert worker["EnvironmentFile"][-1] == "-/etc/zeroserve/worker-%i.env"


def test_the_runtime_folder_systemd_makes_passes_the_brokers_own_check(tmp_path: Path
                                                                     ) -> None:
    """Every unit may create /run/zeroserve first; the broker refuses a folder others can
    write to, so each unit's mode must pass ensure_runtime_dir (0770 did not)."""
    from zeroserve.broker.runtime import ensure_runtime_dir
    for name in NAMES[1:]:
        (mode,) = unit(name)["RuntimeDirectoryMode"]
        folder = tmp_path / name
        folder.mkdir()
        folder.chmod(int(mode, 8))
        ensure_runtime_dir(folder)
        assert int(mode, 8) & 0o050 == 0o050, name  # the group may reach the sockets
    # sockets bound under UMask 0007 are group-connectable: members run the CLI
    assert unit("zeroserve-broker.service")["UMask"] == ["0007"]


def test_stopping_the_target_signals_every_component_at_once() -> None:
    """The stop order lives in the components (gateway drains, broker keeps the workers
    until its work is answered): systemd must not hold one back, as After=/Before=
    between them would (a worker ordered after the broker is stopped before it)."""
    components = NAMES[1:]
    stems = [n.split("@")[0].removesuffix(".service") for n in components]
    for name in components:
        u = unit(name)
        assert u["PartOf"] == ["zeroserve.target"], name
        assert u["KillMode"] == ["mixed"], name          # SIGTERM to the main process
        ordering = " ".join(u.get("After", []) + u.get("Before", []))
        assert not any(stem in ordering for stem in stems), (name, ordering)
        # none starts first, so each may create the shared sockets' folder, and none
        # removes it when it stops while the others still use it
        assert u["RuntimeDirectory"] == ["zeroserve"], name
        assert u["RuntimeDirectoryPreserve"] == ["yes"], name
    assert "Stopping it" in (UNITS / "zeroserve.target").read_text()


class NotifySocket:
    """A unix datagram socket the test binds, standing in for systemd."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))

    def expect(self, state: str, proc: subprocess.Popen[bytes],
               timeout_s: float = 60.0) -> list[str]:
        """Datagrams up to and including one that holds ``state`` (a line such as READY=1)."""
        seen: list[str] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None and not seen:
                raise AssertionError(f"process exited with {proc.returncode} before {state}")
            self.sock.settimeout(max(0.01, min(0.5, deadline - time.monotonic())))
            try:
                msg = self.sock.recv(4096).decode()
            except TimeoutError:
                continue
            seen.append(msg)
            if state in msg.splitlines():
                return seen
        raise AssertionError(f"no {state} within {timeout_s}s (got {seen})")

    def close(self) -> None:
        self.sock.close()


def unit_command(name: str, env: dict[str, str],
                 swap: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The unit's ExecStart and Environment, with its paths swapped for the test's."""
    u = unit(name)

    def sub(text: str) -> str:
        for old, new in swap.items():
            text = text.replace(old, new)
        return text

    argv = shlex.split(sub(u["ExecStart"][0]))
    full = {**os.environ, **env}
    for line in u.get("Environment", []):
        for pair in shlex.split(sub(line)):
            key, value = pair.split("=", 1)
            full[key] = value
    return argv, full


@pytest.fixture
def place() -> Iterator[Path]:
    folder = short_tmpdir("zsunit")
    write_model(folder / "repo", "linear", 1, "nn.Linear(4, 3)", linear_config("linear"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_unit_command_lines_notify_ready_when_serving_and_stopping_on_sigterm(place: Path) -> None:
    port = free_port()
    swap = {"/usr/local/bin/zeroserve": str(BINARY), "/run/zeroserve": str(place / "run"),
            "/var/cache/zeroserve": str(place / "cache"), "%i": "0"}
    env = {"ZEROSERVE_BROKER_MODEL_DIR": str(place / "repo"),
           "ZEROSERVE_GATEWAY_HTTP_PORT": str(port), "ZEROSERVE_WORKER_THREADS": "1",
           "WATCHDOG_USEC": "1000000"}
    (place / "run").mkdir()  # systemd's RuntimeDirectory=
    procs: list[subprocess.Popen[bytes]] = []
    sockets: list[NotifySocket] = []
    control = f"ipc://{place / 'run'}/control"
    try:
        def start(name: str) -> tuple[subprocess.Popen[bytes], NotifySocket]:
            ns = NotifySocket(place / f"{name}.notify")
            sockets.append(ns)
            argv, full = unit_command(name, {**env, "NOTIFY_SOCKET": str(ns.path)}, swap)
            procs.append(subprocess.Popen(argv, env=full, stderr=subprocess.DEVNULL))
            return procs[-1], ns

        broker, ns = start("zeroserve-broker.service")
        ns.expect("READY=1", broker)
        with Client(control, timeout_s=2) as c:  # serving the moment it says so
            assert c.control("ping") == {"ok": True}
        assert "WATCHDOG=1" in "\n".join(ns.expect("WATCHDOG=1", broker, 10))

        worker, ns_w = start("zeroserve-worker@.service")
        ns_w.expect("READY=1", worker)
        with Client(control, timeout_s=2) as c:
            workers = c.control("status")["workers"]
        assert len(workers) == 1 and workers[0]["models"] == ["linear/1"], workers
        assert workers[0]["id"].endswith("/0")

        gateway, ns_g = start("zeroserve-gateway.service")
        ns_g.expect("READY=1", gateway)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/live", timeout=2) as r:
            assert r.status == 200

        # systemctl reload: SIGHUP rescans the repository and the worker loads what is new
        write_model(place / "repo", "other", 1, "nn.Linear(4, 3)", linear_config("other"))
        broker.send_signal(signal.SIGHUP)
        said = ns.expect("READY=1", broker, 20)
        assert any("RELOADING=1" in m.splitlines() for m in said), said

        def other_ready() -> bool:
            with Client(control, timeout_s=2) as c:
                return c.control("models")["models"].get("other", {}).get("ready") == [1]
        wait_for(other_ready, 20, "the new model on the worker")

        for proc, sock in ((gateway, ns_g), (worker, ns_w), (broker, ns)):
            proc.send_signal(signal.SIGTERM)
            sock.expect("STOPPING=1", proc, 20)
            assert proc.wait(30) == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        for ns in sockets:
            ns.close()
