"""The worker's host-memory tier: versions unloaded from the device, parked in host RAM
so that a later load of the same content is a move back instead of a read from disk, a
deserialization and a warm-up (ModelMesh's and Ray Serve multiplexing's tier).

Bounded by bytes (``--host-cache-bytes``; each parked version counts the memory its load
measured), least recently parked out first. A parked version is taken back only when the
broker names the same content (its sha256) and the same config, and the version's files
still have the sizes and modification times they had before its load read them (the
worker's ``extra["stamp"]``): a version changed on disk loads from disk. Parked bytes
are not the device's: the broker's budget never counts them (on a GPU they are moved to
host memory; on a CPU they stay in the process, which is why the worker's unload check
adds them to what may stay resident).
"""

from __future__ import annotations

import collections
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zeroserve.models.loader import LoadedModel

logger = logging.getLogger(__name__)

# A GPU host has tens to hundreds of GB of RAM beside its device; 1 GiB holds a few dozen
# of the small, rarely called models load on demand is for, and is modest beside that.
DEFAULT_HOST_CACHE_BYTES = 1 << 30
Stamp = tuple[tuple[str, int, int], ...]


def files_stamp(version_dir: Path) -> Stamp:
    """The version's files with their sizes and modification times: a cheap check that
    nothing was rewritten since its load (no hash: that is what the park saves)."""
    out = []
    # os.walk, not Path.rglob: taken on every move back, which under load on demand is
    # many a second, and rglob's path objects were most of the move's cost
    for top, dirs, files in os.walk(version_dir, followlinks=True):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        rel_top = os.path.relpath(top, version_dir)
        for f in files:
            try:
                st = os.stat(os.path.join(top, f))
            except FileNotFoundError:   # a dangling link: not a file of the version
                continue
            rel = f if rel_top == "." else f"{rel_top}/{f}".replace(os.sep, "/")
            out.append((rel, st.st_size, st.st_mtime_ns))
    return tuple(sorted(out))


@dataclass
class Parked:
    loaded: LoadedModel
    config: dict[str, Any]
    stamp: Stamp


def parkable(loaded: LoadedModel) -> bool:
    """On a CPU any format (nothing moves); on a GPU a TorchScript module, which ``to``
    moves whole. A Python handler's modules are forgotten at unload: never parked."""
    if loaded.package or loaded.handler is not None or loaded.calls_models \
            or loaded.config.decoupled:
        return False
    return loaded.device == "cpu" or (loaded.format == "TorchScript" and hasattr(loaded.fn, "to"))


class HostCache:
    """Only the worker's loader thread calls it (loads and unloads run there, in order)."""

    def __init__(self, limit_bytes: int, device: str) -> None:
        self.limit_bytes = max(0, limit_bytes)
        self.device = device
        self._parked: collections.OrderedDict[tuple[str, int], Parked] = \
            collections.OrderedDict()
        self.hits = 0
        self.misses = 0

    @property
    def bytes(self) -> int:
        return sum(p.loaded.memory_bytes for p in self._parked.values())

    def resident_after(self, seq: int) -> int:
        """Parked bytes still in this process's memory that were loaded after load
        number ``seq`` (on a CPU; on a GPU the device probe does not see them)."""
        if self.device != "cpu":
            return 0
        return sum(p.loaded.memory_bytes for p in self._parked.values()
                   if p.loaded.extra.get("seq", 0) > seq)

    def __len__(self) -> int:
        return len(self._parked)

    def park(self, loaded: LoadedModel, config: dict[str, Any]) -> list[LoadedModel]:
        """Park ``loaded`` if it is parkable and fits the bound; returns the versions
        dropped for room (and ``loaded`` itself when not parked), for the caller to
        release."""
        key = (loaded.name, loaded.version)
        dropped = [p.loaded for p in [self._parked.pop(key, None)] if p is not None]
        if self.limit_bytes <= 0 or not parkable(loaded) \
                or loaded.memory_bytes > self.limit_bytes:
            return dropped + [loaded]
        stamp = loaded.extra.get("stamp")   # taken before the load read the files
        if stamp is None:
            return dropped + [loaded]
        try:
            if self.device != "cpu":
                loaded.fn.to("cpu")
        except (OSError, RuntimeError) as exc:
            logger.warning("%s/%d not parked in host memory: %s", loaded.name,
                           loaded.version, exc)
            return dropped + [loaded]
        while self._parked and self.bytes + loaded.memory_bytes > self.limit_bytes:
            dropped.append(self._parked.popitem(last=False)[1].loaded)
        self._parked[key] = Parked(loaded, config, stamp)
        return dropped

    def take(self, name: str, version: int, sha256: str, config: dict[str, Any],
             version_dir: Path) -> tuple[LoadedModel | None, list[LoadedModel]]:
        """The parked version if it is the same content and config (moved back to the
        device), else None; and what must be released (a stale parked copy)."""
        got = self._parked.pop((name, version), None)
        if got is None:
            self.misses += 1
            return None, []
        lm = got.loaded
        try:
            same = bool(sha256) and sha256 == lm.sha256 and config == got.config \
                and version_dir == lm.version_dir and files_stamp(version_dir) == got.stamp
            if same and self.device != "cpu":
                lm.fn.to(self.device)
        except (OSError, RuntimeError) as exc:
            logger.warning("%s/%d not taken from host memory: %s", name, version, exc)
            same = False
        if not same:
            self.misses += 1
            return None, [lm]
        self.hits += 1
        return lm, []
