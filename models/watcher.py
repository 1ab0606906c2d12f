"""Watch the model repository: inotify (polled by the broker's zmq.Poller through
``fileno()``), or a periodic stat scan for filesystems where inotify is silent (NFS).

The watcher only says *which model folders changed* and *when the changes have
settled* (no event for ``debounce_s``); the broker then rescans those models and
keys each version by the sha256 of its files, so a repeated write of the same
content does nothing. Files being written (created or modified, not yet closed)
hold their version back, so a slow in-place copy is never loaded truncated.
Torch-free.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Callable

from inotify_simple import INotify, flags

from zeroserve.models.repository import is_temp_name

logger = logging.getLogger(__name__)

ALL = "*"  # a dirty marker meaning every model (overflow, poll mode's first pass)
SUSPECT_S = 2.0

# MODIFY is watched beside the events that publish, so a file being rewritten in place
# is known to be open for writing until its CLOSE_WRITE arrives.
WATCH_MASK = (flags.CLOSE_WRITE | flags.MOVED_TO | flags.CREATE | flags.DELETE
              | flags.MOVED_FROM | flags.DELETE_SELF | flags.MODIFY)


class RepoWatcher:
    """Debounced change notices for a model repository."""

    def __init__(self, root: Path, mode: str = "inotify", debounce_s: float = 0.2,
                 poll_s: float = 2.0, clock: Callable[[], float] = time.monotonic) -> None:
        if mode not in ("inotify", "poll"):
            raise ValueError(f"watch mode must be 'inotify' or 'poll', got {mode!r}")
        self.root = root
        self.mode = mode
        self.debounce_s = debounce_s
        self.poll_s = poll_s
        self.clock = clock
        self.dirty: set[str] = set()
        self.last_event_s = 0.0
        # files created/modified and not yet closed -> until when to assume so (inf: until
        # CLOSE_WRITE); files found in a folder that appeared get SUSPECT_S, since their
        # CREATE may have come before the folder's watch
        self.writing: dict[Path, float] = {}
        self._wds: dict[int, Path] = {}
        self.inotify: INotify | None = None
        self._stats: dict[Path, tuple[int, int]] = {}
        self._next_poll_s = 0.0
        if mode == "inotify":
            self.inotify = INotify()
            self._watch_tree(root)
        else:
            self._stats = self._stat_tree()
            self._next_poll_s = clock() + poll_s

    def fileno(self) -> int | None:
        return self.inotify.fileno() if self.inotify is not None else None

    def close(self) -> None:
        if self.inotify is not None:
            self.inotify.close()

    # -- inotify ------------------------------------------------------------
    def _watch_tree(self, top: Path, suspect_until: float | None = None) -> None:
        """Watch a folder and every non-temp folder below it (new ones as they appear)."""
        for dirpath, dirnames, filenames in os.walk(top):
            if suspect_until is not None:
                for name in filenames:
                    if not is_temp_name(name):
                        self.writing.setdefault(Path(dirpath) / name, suspect_until)
            dirnames[:] = [d for d in dirnames if not is_temp_name(d) and d != "__pycache__"]
            assert self.inotify is not None
            try:
                wd = self.inotify.add_watch(dirpath, WATCH_MASK)
            except OSError as exc:  # vanished meanwhile, or out of watches
                logger.warning("cannot watch %s: %s", dirpath, exc)
                continue
            self._wds[wd] = Path(dirpath)

    def read(self) -> None:
        """Take the pending inotify events (call when the fd is readable)."""
        assert self.inotify is not None
        now = self.clock()
        for event in self.inotify.read(timeout=0):
            if event.mask & flags.Q_OVERFLOW:
                logger.warning("inotify queue overflowed; rescanning the whole repository")
                self._rewatch()
                self._mark(ALL, now)
                continue
            base = self._wds.get(event.wd)
            if event.mask & flags.IGNORED:
                self._wds.pop(event.wd, None)
                continue
            if base is None:
                continue
            if event.mask & flags.DELETE_SELF:
                self._mark(self._model_of(base) or ALL, now)
                continue
            if not event.name or self._ignored(base, event.name):
                continue
            path = base / event.name
            self._on_path_event(path, event.mask, now)
            self._mark(self._model_of(path) or ALL, now)

    def _on_path_event(self, path: Path, mask: int, now: float) -> None:
        is_dir = bool(mask & flags.ISDIR)
        if mask & (flags.DELETE | flags.MOVED_FROM | flags.MOVED_TO):
            self.writing = {w: t for w, t in self.writing.items()
                            if w != path and path not in w.parents}
        if is_dir and mask & flags.CREATE:
            self._watch_tree(path, now + SUSPECT_S)
        elif is_dir and mask & flags.MOVED_TO:
            self._watch_tree(path)  # published by rename: complete by construction
        elif not is_dir and mask & (flags.CREATE | flags.MODIFY):
            self.writing[path] = float("inf")
        elif not is_dir and mask & flags.CLOSE_WRITE:
            self.writing.pop(path, None)

    def _ignored(self, base: Path, name: str) -> bool:
        rel = (base / name).relative_to(self.root).parts
        return any(is_temp_name(part) or part == "__pycache__" for part in rel)

    def _rewatch(self) -> None:
        assert self.inotify is not None
        for wd in list(self._wds):
            try:
                self.inotify.rm_watch(wd)
            except OSError:
                pass
        self._wds.clear()
        self.writing.clear()
        self._watch_tree(self.root, self.clock() + SUSPECT_S)

    def _model_of(self, path: Path) -> str | None:
        try:
            rel = path.relative_to(self.root).parts
        except ValueError:
            return None
        return rel[0] if rel else None

    def _mark(self, model: str, now: float) -> None:
        self.dirty.add(model)
        self.last_event_s = now

    # -- polling ------------------------------------------------------------
    def _stat_tree(self) -> dict[Path, tuple[int, int]]:
        out: dict[Path, tuple[int, int]] = {}
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames[:] = [d for d in dirnames if not is_temp_name(d) and d != "__pycache__"]
            for name in filenames:
                if is_temp_name(name):
                    continue
                path = Path(dirpath) / name
                try:
                    st = path.stat()
                except OSError:
                    continue
                out[path] = (st.st_size, st.st_mtime_ns)
            out[Path(dirpath)] = (0, 0)  # folders: presence only
        return out

    def _poll(self, now: float) -> None:
        stats = self._stat_tree()
        changed = {p for p in set(stats) | set(self._stats)
                   if stats.get(p) != self._stats.get(p)}
        self._stats = stats
        # a file that changed since the last pass may still be growing: it settles
        # (no change for one interval) before its version is considered
        settled = set(self.writing) - changed
        self.writing = {p: float("inf") for p in changed if p in stats and stats[p] != (0, 0)}
        for path in changed | settled:
            self._mark(self._model_of(path) or ALL, now)

    # -- what the broker asks -----------------------------------------------
    def next_due(self) -> float | None:
        """When to call ``take_due`` next (the poll timeout includes it)."""
        due = []
        if self.dirty:
            due.append(self.last_event_s + self.debounce_s)
        if self.mode == "poll":
            due.append(self._next_poll_s)
        due.extend(t for t in self.writing.values() if t != float("inf"))
        return min(due) if due else None

    def take_due(self) -> set[str] | None:
        """The model folders to rescan, once changes have been quiet for the debounce."""
        now = self.clock()
        if self.mode == "poll" and now >= self._next_poll_s:
            self._next_poll_s = now + self.poll_s
            self._poll(now)
        for path, until in list(self.writing.items()):
            if until <= now:  # a suspect that stayed quiet: assume it is complete
                del self.writing[path]
                self._mark(self._model_of(path) or ALL, now - self.debounce_s)
        if not self.dirty or now < self.last_event_s + self.debounce_s:
            return None
        dirty, self.dirty = self.dirty, set()
        return dirty

    def is_writing(self, folder: str, version: int) -> bool:
        """Whether a file of this version folder is still being written."""
        vdir = self.root / folder / str(version)
        now = self.clock()
        return any(vdir in path.parents and until > now for path, until in self.writing.items())
