"""The response cache: answers the broker gives again, without a worker, to requests
identical to one it has answered.

A model opts in with Triton's ``response_cache { enable: true }`` (config.json:
``"response_cache": {"enable": true}``). The key is the model, the sha256 of the
version that answered (the catalog's, so new content never meets an old answer) and a
digest of what changes the answer: each input's name, datatype, shape and bytes, and
the outputs asked for. Priority, timeout and tenant do not change it. The value is the
reply's tensors, copied out of the worker's message as bytes.

Bounded by bytes: every entry counts its tensor bytes and a fixed overhead per entry
and per tensor (the key, the objects around the bytes, the LRU links), measured with
tracemalloc in tests/broker/test_cache.py; the least recently used go first, and an
answer larger than the whole bound is not kept. A pure class: the request path asks
and fills it, the lifecycle drops what a retired version or removed model left.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any, Iterable, Sequence

from zeroserve.broker.tensors import Tensor, TensorMeta

DEFAULT_BOUND_BYTES = 64 << 20
# What an entry holds besides its tensor bytes: the key's tuple and digest, the Answer,
# its OrderedDict node and dict slot; and per tensor its Tensor, TensorMeta, shape tuple
# and bytes header. Measured (tracemalloc, CPython 3.12): about 570 bytes for an entry
# of one tensor, the key included; counted as 832, so the bound is never an underestimate.
ENTRY_OVERHEAD_BYTES = 512
TENSOR_OVERHEAD_BYTES = 320
DIGEST_BYTES = 32

Key = tuple[str, str, bytes]   # (model, the version's sha256, request digest)


def request_digest(tensors: Sequence[Tensor], outputs: Sequence[str] | None) -> bytes:
    """What of a request changes its answer, hashed over the frames in place (no copy).
    Lengths prefix every field so that no two different requests write the same stream."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    for t in tensors:
        meta = t.meta
        data = t.data if isinstance(t.data, memoryview) else memoryview(t.data)
        head = f"{len(meta.name)}:{meta.name}|{meta.datatype}|{meta.shape}|{data.nbytes};"
        h.update(head.encode())
        h.update(data)
    h.update(b"outputs:" if outputs is None else
             f"outputs={len(outputs)}:{'|'.join(f'{len(o)}:{o}' for o in outputs)}".encode())
    return h.digest()


class Answer:
    """A cached reply: the version that computed it and its tensors (bytes)."""

    __slots__ = ("version", "tensors", "nbytes")

    def __init__(self, version: int, tensors: Sequence[Tensor]) -> None:
        self.version = version
        self.tensors = tuple(Tensor(TensorMeta(t.meta.name, t.meta.datatype,
                                               tuple(t.meta.shape)), bytes(t.data))
                             for t in tensors)
        self.nbytes = ENTRY_OVERHEAD_BYTES + sum(
            TENSOR_OVERHEAD_BYTES + len(t.data) for t in self.tensors)


def answer_bytes(tensors: Sequence[Tensor]) -> int:
    """What :class:`Answer` would count for ``tensors``, without copying them."""
    return ENTRY_OVERHEAD_BYTES + sum(TENSOR_OVERHEAD_BYTES + memoryview(t.data).nbytes
                                      for t in tensors)


class ResponseCache:
    """Least recently used answers by :data:`Key`, within ``bound_bytes`` (0: off)."""

    def __init__(self, bound_bytes: int = DEFAULT_BOUND_BYTES) -> None:
        if bound_bytes < 0:
            raise ValueError(f"the response cache's bound must be >= 0, got {bound_bytes}")
        self.bound_bytes = bound_bytes
        self._entries: OrderedDict[Key, Answer] = OrderedDict()
        self._bytes = 0
        self.evicted = 0   # entries pushed out by the bound (not those invalidated)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def get(self, key: Key) -> Answer | None:
        found = self._entries.get(key)
        if found is not None:
            self._entries.move_to_end(key)
        return found

    def put(self, key: Key, version: int, tensors: Sequence[Tensor]) -> bool:
        """Keep an answer; False when it is larger than the whole bound (not kept)."""
        if answer_bytes(tensors) > self.bound_bytes:
            return False
        self._drop(key)
        answer = Answer(version, tensors)
        while self._entries and self._bytes + answer.nbytes > self.bound_bytes:
            _, old = self._entries.popitem(last=False)
            self._bytes -= old.nbytes
            self.evicted += 1
        self._entries[key] = answer
        self._bytes += answer.nbytes
        return True

    def retain(self, model: str, shas: Iterable[str]) -> int:
        """Only answers of these versions' content stay for ``model`` (none: the model
        was removed or no longer caches); returns how many went."""
        keep = set(shas)
        gone = [k for k in self._entries if k[0] == model and k[1] not in keep]
        for key in gone:
            self._drop(key)
        return len(gone)

    def _drop(self, key: Key) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self._bytes -= old.nbytes

    def describe(self) -> dict[str, Any]:
        return {"entries": len(self._entries), "bytes": self._bytes,
                "bound_bytes": self.bound_bytes, "evicted": self.evicted}
