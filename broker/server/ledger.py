"""The answer ledger: every admitted request's key, from admission to its one answer.

It holds the request path's invariant, exactly one answer per request: whatever answers a
request (a reply, an error, a stream's final part) first closes its key here, and sends
only if that close was the first. A late result from a worker presumed dead, a retry
racing a cancel, or an expiry racing a result then finds the key closed and sends
nothing. The unary path and the stream path are each given the one ledger.
"""

from __future__ import annotations

from typing import Callable, Sequence

from zeroserve.broker.server.types import RequestKey

Key = RequestKey


class AnswerLedger:
    """Open keys by client; each of ``on_close`` lets go of what others hold for a key
    (its tenant's slot, its stream's state) at the moment it is answered."""

    def __init__(self, on_close: Sequence[Callable[[Key], object]] = ()) -> None:
        self._open: dict[Key, str] = {}               # key -> model
        self._by_client: dict[bytes, set[str]] = {}
        self._on_close = tuple(on_close)

    def __len__(self) -> int:
        return len(self._open)

    def is_open(self, key: Key) -> bool:
        return key in self._open

    def admit(self, key: Key, model: str) -> None:
        self._open[key] = model
        ids = self._by_client.get(key[0])
        if ids is None:
            ids = self._by_client[key[0]] = set()
        ids.add(key[1])

    def close(self, key: Key) -> bool:
        """Mark a request answered; False if it already was (then send nothing)."""
        if self._open.pop(key, None) is None:
            return False
        for let_go in self._on_close:
            let_go(key)
        ids = self._by_client.get(key[0])
        if ids is not None:
            ids.discard(key[1])
            if not ids:
                del self._by_client[key[0]]
        return True

    def ids_of(self, client: bytes) -> list[str]:
        """A client's open request ids (a copy: answering them changes the set)."""
        return list(self._by_client.get(client, ()))

    def census(self) -> dict[str, int]:
        return {"requests.open": len(self._open), "requests.by_client": len(self._by_client)}
