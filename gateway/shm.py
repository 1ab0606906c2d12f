"""System shared memory (Triton's extension), gateway side: regions that clients on
this host register by POSIX shm key (``/dev/shm/<key>``, as
``tritonclient.utils.shared_memory`` creates them); inputs are read from them and
outputs written into them, so no tensor bytes cross HTTP.

Regions live in this gateway process: with several gateway processes on one port
(``--http-workers``) a registration reaches only the process that answered it.
"""

from __future__ import annotations

import mmap
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zeroserve.broker.protocol import ErrorCode
from zeroserve.gateway.v2 import DecodeError

SHM_ROOT = Path("/dev/shm")


class ShmError(DecodeError):
    """A shared-memory request the gateway refuses; ``code`` picks its row of the error
    table (gateway/errors.py)."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.BAD_INPUT) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Region:
    name: str
    key: str
    offset: int
    byte_size: int
    view: mmap.mmap          # the segment from 0 to offset + byte_size

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "key": self.key, "offset": self.offset,
                "byte_size": self.byte_size}


def _segment_path(key: str) -> Path:
    """/dev/shm/<key>: one plain name, so a key cannot reach any other file."""
    name = key[1:] if key.startswith("/") else key
    if not name or "/" in name or name in (".", "..") or "\0" in name:
        raise ShmError(f"shared-memory key {key!r} must be one POSIX shm name such as "
                       "'/input_data'")
    return SHM_ROOT / name


def _natural(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ShmError(f"{what} must be a non-negative integer, got {value!r}")
    return value


class SharedMemory:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.regions: dict[str, Region] = {}

    def check_enabled(self) -> None:
        if not self.enabled:
            raise ShmError("system shared memory is off: start the gateway with "
                           "--allow-shared-memory", ErrorCode.FORBIDDEN)

    def register(self, name: str, key: Any, offset: Any, byte_size: Any) -> None:
        self.check_enabled()
        if not isinstance(key, str):
            raise ShmError(f"region {name!r}: 'key' must be a string")
        offset = _natural(offset, f"region {name!r}: 'offset'")
        byte_size = _natural(byte_size, f"region {name!r}: 'byte_size'")
        if name in self.regions:
            raise ShmError(f"shared-memory region {name!r} is already registered")
        path = _segment_path(key)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise ShmError(f"region {name!r}: cannot open shared-memory key {key!r}: "
                           f"{exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ShmError(f"region {name!r}: key {key!r} is not a shared-memory segment")
            if offset + byte_size > st.st_size:
                raise ShmError(f"region {name!r}: offset {offset} + byte_size {byte_size} "
                               f"runs past the segment {key!r} of {st.st_size} bytes")
            view = mmap.mmap(fd, max(1, offset + byte_size))
        finally:
            os.close(fd)
        self.regions[name] = Region(name, key, offset, byte_size, view)

    def unregister(self, name: str | None = None) -> None:
        """One region, or all; an unknown name is no error (as Triton)."""
        self.check_enabled()
        names = list(self.regions) if name is None else [name]
        for n in names:
            region = self.regions.pop(n, None)
            if region is not None:
                region.view.close()

    def status(self, name: str | None = None) -> list[dict[str, Any]]:
        self.check_enabled()
        if name is None:
            return [r.describe() for _, r in sorted(self.regions.items())]
        region = self.regions.get(name)
        if region is None:
            raise ShmError(f"unknown shared-memory region {name!r}", ErrorCode.NOT_FOUND)
        return [region.describe()]

    def _span(self, name: str, offset: int, size: int) -> tuple[Region, int]:
        region = self.regions.get(name)
        if region is None:
            raise ShmError(f"unknown shared-memory region {name!r}")
        if offset + size > region.byte_size:
            raise ShmError(f"shared-memory region {name!r}: offset {offset} + byte_size "
                           f"{size} runs past the region's {region.byte_size} bytes")
        return region, region.offset + offset

    def read(self, name: str, offset: int, size: int) -> bytes:
        """A copy: the bytes travel on to the broker, and the client may reuse the
        region as soon as the response is back."""
        region, start = self._span(name, offset, size)
        return region.view[start:start + size]

    def write(self, name: str, offset: int, size: int, data: memoryview) -> None:
        region, start = self._span(name, offset, size)
        region.view[start:start + size] = data

    def close(self) -> None:
        for region in self.regions.values():
            region.view.close()
        self.regions.clear()
