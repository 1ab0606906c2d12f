"""sd_notify over a real unix datagram socket, as systemd would read it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from zeroserve.broker import process as sdnotify


@pytest.fixture
def listener(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify"))
    sock.settimeout(5)
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify"))
    yield sock
    sock.close()


def test_states_arrive_as_datagrams(listener: socket.socket) -> None:
    n = sdnotify.Notifier()
    n.ready("serving 2 models")
    assert listener.recv(4096) == b"READY=1\nSTATUS=serving 2 models"
    n.reloading()
    first, stamp = listener.recv(4096).decode().splitlines()
    assert first == "RELOADING=1" and stamp.startswith("MONOTONIC_USEC=")
    n.stopping()
    assert listener.recv(4096) == b"STOPPING=1"


def test_watchdog_pings_at_half_the_timeout(listener: socket.socket,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "2000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    n = sdnotify.Notifier()
    assert n.interval_s == 1.0
    n.watchdog(100.0)
    n.watchdog(100.5)  # too soon: nothing
    n.watchdog(101.0)
    listener.settimeout(0.5)
    assert [listener.recv(64), listener.recv(64)] == [b"WATCHDOG=1", b"WATCHDOG=1"]
    with pytest.raises(TimeoutError):
        listener.recv(64)


def test_abstract_socket_names_work(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"zeroserve-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert sdnotify.notify("READY=1")
        assert sock.recv(64) == b"READY=1"


def test_without_systemd_everything_is_a_no_op(monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    assert sdnotify.notify("READY=1") is False
    assert sdnotify.Notifier().interval_s is None
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone"))
    assert sdnotify.notify("READY=1") is False  # never fatal


def test_trimming_memory_starts_no_process() -> None:
    # ctypes.util.find_library runs `ldconfig -p` in a child: the broker did so at every
    # trim, twice a second under light load
    code = ("import sys; seen = []\n"
            "sys.addaudithook(lambda e, a: seen.append(e) if e == 'subprocess.Popen' else None)\n"
            "from zeroserve.broker.process import trim_memory\n"
            "done = [trim_memory() for _ in range(3)]\n"
            "print(len(seen))")
    assert _python(code) == "0"


def test_every_component_starts_with_the_collector_tuned() -> None:
    """What start-up made is frozen and the young generation waits longer: the defaults
    cost mlp over HTTP 7% of its throughput and doubled its p99 (see tune_gc)."""
    code = ("import gc\n"
            "from zeroserve.broker import options\n"
            "def run(args):\n"
            "    print(gc.get_threshold()[0], gc.get_freeze_count())\n"
            "    return 0\n"
            "options.run_component('gateway', run, [])")
    threshold, frozen = map(int, _python(code).split())
    assert threshold == sdnotify.GC_YOUNG_THRESHOLD
    assert frozen > 10_000, "the imported modules' objects are frozen"


def _python(code: str) -> str:
    """What ``code`` prints, run in a fresh interpreter (its collector and audit hooks
    are its own)."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()
