"""Process plumbing every component shares: the one log format, a rate-limited log,
the collector's settings, and systemd's notify protocol in a few lines, no dependency.

A unit with ``Type=notify`` sets ``$NOTIFY_SOCKET`` (a unix datagram socket; a
leading ``@`` means the abstract namespace). Each component says ``READY=1`` once
it really serves, ``RELOADING=1`` while it reloads, ``STOPPING=1`` when it starts
to shut down, and pings ``WATCHDOG=1`` at half of ``$WATCHDOG_USEC``. Without
``$NOTIFY_SOCKET`` every call is a no-op, so the components run the same
anywhere.
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import socket
import sys
import time
from typing import Any

logger = logging.getLogger(__name__)

# Python's cyclic collector by default walks the young objects every 700 allocations and
# everything (the modules, the catalog, torch's wrappers) every 70,000; a request makes
# hundreds. Measured, mlp over HTTP at C=64, same run: 5,900 -> 6,350 req/s, p99 25 ->
# 15 ms. Cyclic garbage waits longer to go, at most this many objects of it.
GC_YOUNG_THRESHOLD = 20_000


def setup_logging(role: str, level: str = "info") -> None:
    """One format for every process: time, level, role and pid, logger, message."""
    fmt = f"%(asctime)s %(levelname)s {role}[%(process)d] %(name)s: %(message)s"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(fmt))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def tune_gc() -> None:
    """Freeze what start-up made (it lives as long as the process: full collections no
    longer walk it) and collect less often, see GC_YOUNG_THRESHOLD."""
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, 20, 20)


@functools.lru_cache(maxsize=1)
def _libc() -> Any:
    """glibc, opened once: ctypes.util.find_library runs ``ldconfig -p`` in a child
    process, which the broker did at each trim (twice a second under light load)."""
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        name = ctypes.util.find_library("c")
        return ctypes.CDLL(name) if name else None


def trim_memory() -> bool:
    """Give freed heap memory back to the system (glibc ``malloc_trim``). Message buffers
    of tens of KB come from the heap once glibc's mmap threshold has grown, and a burst
    of them leaves the heap large long after they are freed. False where unavailable."""
    try:
        libc = _libc()
        return bool(libc is not None and libc.malloc_trim(0))
    except (OSError, AttributeError):
        return False


class RateLimitedLog:
    """At most one line per ``1/per_s`` seconds; the lines held back are counted and
    their number said on the next one, so a flood of bad input cannot flood the log."""

    def __init__(self, log: logging.Logger, per_s: float = 1.0) -> None:
        self._log = log
        self._interval_s = 1.0 / per_s
        self._next_s = 0.0
        self._held = 0

    def log(self, level: int, msg: str, *args: Any, exc_info: Any = None) -> bool:
        now = time.monotonic()
        if now < self._next_s:
            self._held += 1
            return False
        self._next_s = now + self._interval_s
        if self._held:
            msg += f" ({self._held} similar line(s) held back)"
            self._held = 0
        self._log.log(level, msg, *args, exc_info=exc_info)
        return True


def notify(state: str) -> bool:
    """Send one datagram such as ``"READY=1"``; False when not under systemd or on error."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(state.encode())
        return True
    except OSError as exc:  # systemd went away or the socket is not ours: never fatal
        logger.debug("sd_notify %r failed: %s", state, exc)
        return False


def watchdog_interval_s() -> float | None:
    """Half the watchdog timeout systemd asks for, or None when no watchdog is set."""
    usec = os.environ.get("WATCHDOG_USEC", "")
    pid = os.environ.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0 or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 2e6


class Notifier:
    """The states one process sends, with a self-throttled watchdog ping."""

    def __init__(self) -> None:
        self.interval_s = watchdog_interval_s()
        self._next_ping = 0.0
        self.ready_sent = False

    def ready(self, status: str = "") -> None:
        self.ready_sent = True
        notify("READY=1" + (f"\nSTATUS={status}" if status else ""))

    def reloading(self) -> None:
        # systemd ≥ 253 wants MONOTONIC_USEC beside RELOADING=1; older ones ignore it
        notify(f"RELOADING=1\nMONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")

    def stopping(self) -> None:
        notify("STOPPING=1")

    def watchdog(self, now: float | None = None) -> None:
        """Call from the loop as often as you like; pings at most every interval."""
        if self.interval_s is None:
            return
        now = time.monotonic() if now is None else now
        if now >= self._next_ping:
            self._next_ping = now + self.interval_s
            notify("WATCHDOG=1")
