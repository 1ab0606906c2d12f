"""``zeroserve serve``: broker, workers and gateway under one supervisor on one host.

Torch-free: every component starts as a fresh process (never a fork of one that
holds torch), and the example models are built by a child process too.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

ROLES = ("gateway", "broker", "worker")   # the stop order (child names start with these)


def visible_gpus() -> list[str]:
    """The CUDA devices this server may use, as ``CUDA_VISIBLE_DEVICES`` entries, without
    importing torch: the host's own restriction where it has one (a systemd unit's, a
    container runtime's, a scheduler's), read as CUDA reads it (up to the first entry
    that is not a device: ``-1`` or an empty one hides the rest), else every GPU."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [str(i) for i in range(len(list(Path("/dev").glob("nvidia[0-9]*"))))]
    devices: list[str] = []
    for entry in visible.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):
            break
        devices.append(entry)
    return devices


def device_map(devices: str, visible: list[str], workers: int) -> list[str | None]:
    """Each worker's ``CUDA_VISIBLE_DEVICES``, one entry per worker. ``devices``
    (``--devices``) names one device per worker as the driver names it (an index, a
    ``GPU-`` or ``MIG-`` UUID; a MIG slice is a device of its own) and may name one
    twice, so that two workers share it. Without it, worker ``i`` takes the ``i``-th
    visible device, and one beyond them keeps the environment as it is (None).
    ``workers`` 0 means one per device (at least one). ValueError for a map that cannot
    be meant."""
    if not devices:
        n = workers or max(len(visible), 1)
        return [visible[i] if i < len(visible) else None for i in range(n)]
    entries = [e.strip() for e in devices.split(",")]
    for entry in entries:
        # CUDA stops reading its list at an entry that is not a device ("-1", ""): that
        # worker would see no GPU, or another one, without a word
        if not entry or entry.startswith("-") or any(c.isspace() for c in entry):
            raise ValueError(f"--devices {devices!r}: {entry!r} is not a device (an "
                             f"index, a GPU-... or MIG-... UUID, one per worker)")
    if workers and workers != len(entries):
        raise ValueError(f"--devices names {len(entries)} device(s), one per worker, but "
                         f"--workers asks for {workers}")
    return list(entries)


def ensure_examples(cache: Path) -> Path:
    repo = cache / "examples"
    if not all((repo / n / "1" / "model.pt").is_file() for n in ("mlp", "cnn")):
        logger.info("building the example models into %s (once)", repo)
        subprocess.run([sys.executable, "-m", "zeroserve.models.examples", str(repo)],
                       check=True, stdout=subprocess.DEVNULL)
    return repo


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str | None] = field(default_factory=dict)  # None: unset it
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    next_start: float = 0.0
    backoff_s: float = 0.125   # doubled at the first quick exit: 0.25 s
    started_s: float = 0.0

    def start(self) -> None:
        env = {k: v for k, v in {**os.environ, **self.env}.items() if v is not None}
        self.proc = subprocess.Popen(self.argv, env=env)
        self.started_s = time.monotonic()
        logger.info("started %s (pid %d)", self.name, self.proc.pid)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Supervisor:
    """Starts children, restarts the ones that die (with backoff), stops them all."""

    def __init__(self, children: list[Child], stop_timeout_s: float = 35.0) -> None:
        self.children = children
        self.stop_timeout_s = stop_timeout_s
        self.stopping = False

    def run(self, on_started: Any = None) -> int:
        """Event-driven: SIGCHLD, SIGTERM and SIGINT wake the loop through a wakeup fd;
        otherwise it sleeps until the next restart is due."""
        wake_r, wake_w = socket.socketpair()
        wake_r.setblocking(False)
        wake_w.setblocking(False)
        signal.set_wakeup_fd(wake_w.fileno())
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: setattr(self, "stopping", True))
        signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake the select below
        try:
            for child in self.children:
                child.start()
            if on_started:
                on_started()
            while not self.stopping:
                due = self._reap_and_restart(time.monotonic())
                timeout = max(0.0, due - time.monotonic()) if due is not None else None
                select.select([wake_r], [], [], timeout)
                try:
                    wake_r.recv(512)
                except BlockingIOError:
                    pass
        finally:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            wake_r.close()
            wake_w.close()
        return self.shutdown()

    def _reap_and_restart(self, now: float) -> float | None:
        """Notice dead children, start those whose backoff is over; the next due time."""
        due = None
        for child in self.children:
            if child.alive():
                continue
            if child.next_start == 0.0:
                # a child that stayed up a while earns a quick restart; a crash loop backs off
                lived = now - child.started_s
                child.backoff_s = 0.25 if lived > 10.0 else min(child.backoff_s * 2, 10.0)
                child.next_start = now + child.backoff_s
                logger.warning("%s exited with %s; restarting in %.2fs", child.name,
                               child.proc.returncode if child.proc else None, child.backoff_s)
            elif now >= child.next_start:
                child.restarts += 1
                child.next_start = 0.0
                child.start()
                logger.info("%s restarted (%d times since the server started)",
                            child.name, child.restarts)
                continue
            due = child.next_start if due is None else min(due, child.next_start)
        return due

    def shutdown(self) -> int:
        """The server's one stop order: the gateways first (they close their listeners
        and finish the requests of their open connections, which the broker still
        takes), then the broker (it admits nothing new and answers what it accepted),
        then the workers, which the broker has released by then (each exits at once).
        Each stage waits up to ``stop_timeout_s``, longer than the components' own drain
        bounds, before anything is killed."""
        logger.info("stopping %d children", len(self.children))
        for role in ROLES:
            self._stop([c for c in self.children if c.name.startswith(role)])
        self._stop([c for c in self.children if not c.name.startswith(ROLES)])
        return 0

    def _stop(self, children: list[Child]) -> None:
        for child in children:
            if child.alive():
                assert child.proc is not None
                child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout_s
        for child in children:
            if child.proc is None:
                continue
            try:
                child.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.error("%s did not stop within %.0fs; killing it", child.name,
                             self.stop_timeout_s)
                child.proc.kill()
                child.proc.wait()


def wait_http_ready(url: str, timeout_s: float, sup: Supervisor) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not sup.stopping:
        try:
            with urllib.request.urlopen(url, timeout=1.0) as resp:
                if resp.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.05)
    return False
