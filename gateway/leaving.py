"""Requests whose HTTP client went away are withdrawn: one timer for all of them.

A request still unanswered ``after_s`` after it was handed to the broker starts
watching for ``http.disconnect`` (a task per request, which most, answered sooner,
never need); a disconnect cancels the request's handler task, and cancelling the
client call sends the broker a CANCEL. The waiting requests sit in arrival order and
one timer, due when the oldest turns ``after_s`` old, starts the watches: a timer per
request (``call_later`` and its cancel) cost 12 us in uvloop on this host, about a
tenth of the gateway's CPU for a request at C=64. The loop is the request task's own
(``Task.get_loop``, 0.02 us): asking asyncio for the running loop (``get_running_loop``,
``ensure_future`` without one) costs 0.19 us, a ``getpid`` system call each time
(CPython 3.11 checks for a fork).
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.types import Receive


class Waiting:
    """One request between its hand-off to the broker and its answer."""

    __slots__ = ("task", "receive", "since", "gone", "watcher")

    def __init__(self, task: "asyncio.Task[Any]", receive: Receive, since: float) -> None:
        self.task = task
        self.receive = receive
        self.since = since
        self.gone = False          # its client left: the task was cancelled for it
        self.watcher: "asyncio.Future[Any] | None" = None

    def watch(self) -> None:
        self.watcher = asyncio.ensure_future(self.receive(), loop=self.task.get_loop())
        self.watcher.add_done_callback(self._heard)

    def _heard(self, watched: "asyncio.Future[Any]") -> None:
        if watched.cancelled() or watched.exception() is not None:
            return
        if watched.result().get("type") == "http.disconnect":
            self.gone = True
            self.task.cancel()

    def stop(self) -> None:
        if self.watcher is not None:
            self.watcher.remove_done_callback(self._heard)
            self.watcher.cancel()


class Leaving:
    """The requests of one event loop that may yet be withdrawn."""

    def __init__(self, after_s: float) -> None:
        self.after_s = after_s
        self._waiting: dict[Waiting, None] = {}   # oldest first
        self._timer: asyncio.TimerHandle | None = None

    def add(self, task: "asyncio.Task[Any]", receive: Receive) -> Waiting:
        loop = task.get_loop()
        entry = Waiting(task, receive, loop.time())
        self._waiting[entry] = None
        if self._timer is None:
            self._timer = loop.call_at(entry.since + self.after_s, self._sweep)
        return entry

    def remove(self, entry: Waiting) -> None:
        self._waiting.pop(entry, None)
        entry.stop()

    def __len__(self) -> int:
        return len(self._waiting)

    def _sweep(self) -> None:
        self._timer = None
        if not self._waiting:
            return
        loop = next(iter(self._waiting)).task.get_loop()
        due = loop.time() - self.after_s
        while self._waiting:
            oldest = next(iter(self._waiting))
            if oldest.since > due:
                self._timer = loop.call_at(oldest.since + self.after_s, self._sweep)
                return
            del self._waiting[oldest]
            oldest.watch()
