"""Where components find each other, and the one log format every process uses."""

from __future__ import annotations

import logging
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path


def runtime_dir() -> Path:
    """$ZEROSERVE_RUNTIME_DIR, else $XDG_RUNTIME_DIR/zeroserve, else /tmp/zeroserve-<uid>."""
    explicit = os.environ.get("ZEROSERVE_RUNTIME_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "zeroserve"
    return Path(f"/tmp/zeroserve-{os.getuid()}")


def cache_dir() -> Path:
    """$ZEROSERVE_CACHE_DIR, else $XDG_CACHE_HOME/zeroserve, else ~/.cache/zeroserve."""
    explicit = os.environ.get("ZEROSERVE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "zeroserve"


@dataclass(frozen=True)
class Endpoints:
    frontend: str
    backend: str
    control: str

    @classmethod
    def in_dir(cls, folder: Path | None = None) -> "Endpoints":
        folder = folder or runtime_dir()
        return cls(f"ipc://{folder}/frontend", f"ipc://{folder}/backend",
                   f"ipc://{folder}/control")


def ensure_runtime_dir(folder: Path) -> None:
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)


def hostname() -> str:
    return socket.gethostname().split(".")[0]


def setup_logging(role: str, level: str = "info") -> None:
    """One format for every process: time, level, role and pid, logger, message."""
    fmt = f"%(asctime)s %(levelname)s {role}[%(process)d] %(name)s: %(message)s"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(fmt))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def exposed_endpoints(endpoints: Endpoints) -> list[str]:
    """tcp:// endpoints bound beyond loopback. Anything that reaches them can run
    models, so the broker refuses them until CurveZMQ keys are supported."""
    exposed = []
    for ep in (endpoints.frontend, endpoints.backend, endpoints.control):
        if not ep.startswith("tcp://"):
            continue
        host = ep[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
        if host not in ("127.0.0.1", "localhost", "::1") and not host.startswith("127."):
            exposed.append(ep)
    return exposed
