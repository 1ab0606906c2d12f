"""The versions a worker holds: the one map its three threads share."""

from __future__ import annotations

import threading

from zeroserve.models.loader import LoadedModel

Key = tuple[str, int]   # (model, version)


class LoadedModels:
    """The versions loaded on this worker, by (model, version).

    Writer: the loader thread alone (``put``, ``pop``; workers/loading.py).
    Readers: the compute thread (``get``: the version a batch runs on), the main thread
    (``items`` for READY and heartbeats, ``len``) and, for a batch it reads itself, the
    main thread's ``get`` too.
    Lock: ``_lock``, held by every write and by every walk of the map (``items``, and
    the walk ``pop`` makes), so no reader walks it while it changes size. A single
    ``get`` or ``len`` takes no lock: one dict operation is atomic under the GIL, and
    ``get`` is on the path of every batch.
    """

    def __init__(self) -> None:
        self._by_key: dict[Key, LoadedModel] = {}
        self._lock = threading.Lock()

    def get(self, key: Key) -> LoadedModel | None:
        return self._by_key.get(key)

    def __getitem__(self, key: Key) -> LoadedModel:
        return self._by_key[key]

    def __len__(self) -> int:
        return len(self._by_key)

    def items(self) -> list[tuple[Key, LoadedModel]]:
        """A copy, taken under the lock."""
        with self._lock:
            return list(self._by_key.items())

    def put(self, key: Key, loaded: LoadedModel) -> LoadedModel | None:
        """From the loader: ``loaded`` in; the version it replaces, if any, out."""
        with self._lock:
            old = self._by_key.get(key)
            self._by_key[key] = loaded
        return old

    def pop(self, key: Key) -> tuple[LoadedModel | None, list[int]]:
        """From the loader: the version out, and the memory of the versions loaded after
        it that are still held, taken under the same lock (what may stay in memory once
        it is gone)."""
        with self._lock:
            loaded = self._by_key.pop(key, None)
            later = [m.memory_bytes for m in self._by_key.values()
                     if loaded is not None and m.extra.get("seq", 0) > loaded.extra.get("seq", 0)]
        return loaded, later
