"""Streams in flight: the requests of decoupled models that a worker is running.

A stream request is in the request path's books like any other (open until its one
final answer); this adds what only a stream has once it runs: which batch item it is
on which worker (to tell that worker when it is answered early), how many responses
it has had (each part's ``index``, and whether a retry is still safe: one that has
sent a response must not start again elsewhere, or the client would see its first
responses twice), and its deadline, which bounds the first response only.

Pure bookkeeping, no sockets; the request path drives it.
"""

from __future__ import annotations

import math

from zeroserve.broker.server.types import RequestKey

Key = RequestKey
# a stream told to pause (an iterative model's sequence, broker/server/preemption.py):
# PAUSING until its preemptor's first response says the pause took effect (a response of
# its own before that was made before it), PAUSED until its next response (it resumed)
NOT_PAUSED, PAUSING, PAUSED = 0, 1, 2


class StreamState:
    __slots__ = ("batch_id", "item", "worker", "deadline_s", "parts", "model", "arrival_s",
                 "last_s", "paused")

    def __init__(self, batch_id: int, item: str, worker: bytes, deadline_s: float,
                 model: str, arrival_s: float) -> None:
        self.batch_id = batch_id
        self.item = item
        self.worker = worker
        self.deadline_s = deadline_s
        self.parts = 0
        self.model = model
        self.arrival_s = arrival_s
        self.last_s = arrival_s   # when its last response went out (its arrival: none yet)
        self.paused = NOT_PAUSED


class Streams:
    def __init__(self) -> None:
        self._running: dict[Key, StreamState] = {}
        # running, no response yet, with a deadline: it bounds the first response. Few
        # (the items of the stream batches in flight), so a scan finds the soonest.
        self._awaiting: dict[Key, float] = {}
        self._pausing: dict[Key, Key] = {}   # a preemptor -> the stream it paused

    def __len__(self) -> int:
        return len(self._running)

    def started(self, key: Key, state: StreamState) -> None:
        self._running[key] = state
        if state.deadline_s < math.inf:
            self._awaiting[key] = state.deadline_s
        else:
            self._awaiting.pop(key, None)

    def get(self, key: Key) -> StreamState | None:
        return self._running.get(key)

    def responded(self, state: StreamState, key: Key, now: float) -> tuple[int, float]:
        """The index of the response about to be sent (0 for the first), and the seconds
        since the stream's last response (for the first, since its arrival)."""
        index = state.parts
        state.parts += 1
        paused = self._pausing.pop(key, None) if self._pausing else None
        victim = self._running.get(paused) if paused is not None else None
        if victim is not None and victim.paused == PAUSING:
            victim.paused = PAUSED
        if state.paused == PAUSED:
            state.paused = NOT_PAUSED
        if index == 0:
            self._awaiting.pop(key, None)
        gap_s, state.last_s = now - state.last_s, now
        return index, gap_s

    def has_responded(self, key: Key) -> bool:
        state = self._running.get(key)
        return state is not None and state.parts > 0

    def pause(self, key: Key, by: Key) -> None:
        """The stream ``key`` pauses, its slot the request ``by``'s."""
        state = self._running.get(key)
        if state is not None:
            state.paused = PAUSING
            self._pausing[by] = key

    def paused(self) -> list[Key]:
        """The streams told to pause that have not resumed."""
        return [key for key, state in self._running.items() if state.paused]

    def forget(self, key: Key) -> StreamState | None:
        self._awaiting.pop(key, None)
        self._pausing.pop(key, None)
        return self._running.pop(key, None)

    def next_deadline(self) -> float | None:
        return min(self._awaiting.values(), default=None)

    def late(self, now: float) -> list[Key]:
        """Running streams whose deadline passed before their first response."""
        return [key for key, deadline in self._awaiting.items() if deadline <= now]

    def sizes(self) -> dict[str, int]:
        return {"running": len(self._running), "awaiting_first": len(self._awaiting)}
