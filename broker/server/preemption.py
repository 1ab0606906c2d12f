"""VIP first: which running sequence of an iterative model a waiting request takes the
slot of, when every slot is held. Pure: no sockets, no clock (the queue's order, aging
included, is the scheduler's, which chose the newcomer).

A request of a higher priority (1 is highest) takes the slot of a running sequence of a
lower one: the lowest priority, then the latest deadline, then the latest arrival (the
least of its work kept aside). A tighter deadline alone takes no slot: any client could
then jump the queue by asking a short one, and a waiting request's deadline already
orders the queue. The victim pauses (its state kept on its worker, or recomputed there
on resume) and resumes, with the same output, once a slot is free: the request path
sends nothing new to a worker while a paused sequence waits there for a slot (paused
ones count as held).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from zeroserve.broker.server.scheduler import Entry


@dataclass(frozen=True)
class Running:
    """A sequence running on a worker: where it is, and the request it answers."""

    worker: Any      # the caller's own (the request path's WorkerState)
    batch_id: int
    item: str
    entry: Entry


def victim(newcomer: Entry, running: Iterable[Running]) -> Running | None:
    """The sequence whose slot ``newcomer`` takes, or None: it waits for a free one."""
    best, best_rank = None, None
    for r in running:
        e = r.entry
        if e.priority <= newcomer.priority:
            continue
        rank = (e.priority, e.deadline_s, e.arrival_s)
        if best_rank is None or rank > best_rank:
            best, best_rank = r, rank
    return best
