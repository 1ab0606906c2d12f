"""Where components find each other: the runtime folder, its endpoints, and the lock
that keeps a second broker out of a folder one already serves."""

from __future__ import annotations

import os
import socket
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


ELSEWHERE = ("point at the broker's runtime folder with --runtime-dir DIR or "
             "ZEROSERVE_RUNTIME_DIR=DIR (or name the endpoint itself)")


def no_socket(endpoint: str) -> str | None:
    """Why nothing can listen at an ``ipc://`` endpoint (its socket file is absent), or
    None: a tcp:// endpoint, or a file that is there."""
    if not endpoint.startswith("ipc://"):
        return None
    path = Path(endpoint[len("ipc://"):])
    if path.exists():
        return None
    return f"no broker listens at {endpoint}: {path} does not exist; {ELSEWHERE}"


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


class RuntimeDirError(RuntimeError):
    """A runtime folder the broker must not serve from; the message says why."""


def ensure_runtime_dir(folder: Path) -> None:
    """Create the folder 0700, or check an existing one: the ipc sockets in it accept
    anyone who can reach them, so nobody else may be able to write there."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = folder.stat()
    if st.st_uid != os.getuid() and os.getuid() != 0:
        raise RuntimeDirError(f"runtime folder {folder} belongs to uid {st.st_uid}, not to "
                              f"this user (uid {os.getuid()})")
    if st.st_mode & 0o022:
        raise RuntimeDirError(f"runtime folder {folder} is writable by others (mode "
                              f"{st.st_mode & 0o777:o}); chmod go-w it, or use another one")


class BrokerLock:
    """An flock on ``<runtime>/broker.lock`` held for the broker's life, with its pid in
    it: a second broker on the same folder would take over the first one's sockets."""

    ROLE = "broker"

    def __init__(self, folder: Path) -> None:
        self.path = folder / f"{self.ROLE}.lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        import fcntl

        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RuntimeDirError(f"another {self.ROLE} (pid {holder}) already serves "
                                  f"{self.path.parent}; stop it or use another "
                                  "--runtime-dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def check_free(self) -> None:
        """Raise RuntimeDirError when another broker holds the folder (a probe: the
        lock is taken and let go at once)."""
        self.acquire()
        self.release()

    def holder(self) -> int | None:
        """The pid holding the lock, or None when nobody does."""
        try:
            self.check_free()
        except RuntimeDirError:
            try:
                return int(self.path.read_text().strip())
            except (OSError, ValueError):
                return -1
        return None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class ServerLock(BrokerLock):
    """Held by ``zeroserve serve`` for its whole life. The broker's own lock is let go
    while the supervisor restarts it: a second server started in that moment passed the
    check, then ran its gateway through the first one's broker and its workers under the
    first one's ids. A broker whose folder is held by a server not its parent refuses
    to start."""

    ROLE = "server"


def hostname() -> str:
    return socket.gethostname().split(".")[0]


def is_exposed(endpoint: str) -> bool:
    """Whether a tcp:// endpoint reaches beyond loopback (ipc:// and the rest never do)."""
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    return host not in ("127.0.0.1", "localhost", "::1") and not host.startswith("127.")


def exposed_endpoints(endpoints: Endpoints) -> list[str]:
    """tcp:// endpoints bound beyond loopback. Anything that reaches them can run
    models, so the broker binds them only with CurveZMQ keys (the frontend and the
    backend; the control socket never)."""
    return [ep for ep in (endpoints.frontend, endpoints.backend, endpoints.control)
            if is_exposed(ep)]
