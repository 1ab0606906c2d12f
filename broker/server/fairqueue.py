"""Weighted fair queuing over tenants within one priority level of a model's queue.
Pure: no clock at all (virtual time is work served), so it is tested with plain lists."""

from __future__ import annotations

import heapq
import math
import itertools
from typing import TYPE_CHECKING, Callable, Iterator, Mapping

if TYPE_CHECKING:
    from zeroserve.broker.server.scheduler import Entry

QUEUED, TAKEN, GONE = 0, 1, 2
# A batch's correction is charged at once up to this many times what its tenant's rows
# usually measure a unit (a moving average of their own measured times, not the latency
# model's price, which can be off 30x either way for one tenant's rows); the rest is owed,
# and repaid over the tenant's next batches, at most their usual cost again each. A batch
# measured far past its usual time was stalled by the host (descheduled on a loaded
# machine, a collector's pause). Charged at once, the stall put its tenant that far ahead
# in virtual time, and its next requests waited for the other tenants to catch up: a
# 16-token text's batch measured 1 s made the short texts after it wait another second
# beside a flood of 512-token texts (tests/broker/test_compute_shares.py); fair queuing's
# bound (each tenant within one request's work of its share) holds only while a request's
# charge is bounded. Forgiven, it would bias the shares: on the shared host a few
# 512-token texts of 100-340 ms among 6 ms ones held 7% of their tenant's time (the
# corrections of one bench_compute_shares run, logged), which a cap gives that tenant over
# its share (the test of one long batch in 25 stalled 30x: 63% capped). Repaid, it is the
# tenant's time in the long run, and a tenant that is idle between its requests does not
# wait for it: it restarts at the clock each time, and each of its batches carries at most
# its usual time again.
STALL_FACTOR = 8.0
USUAL_WEIGHT = 0.1   # a new batch's weight in a tenant's usual time a unit


class FairLevel:
    """One priority level: weighted fair queuing over tenants, EDF within a tenant.

    Why this scheme (start-time fair queuing over tenants, not over requests, and not
    deficit round robin): each tenant has a virtual time, the work it has been served
    divided by its weight; the tenant with the smallest goes next. Over any backlogged
    period each tenant's service is proportional to its weight within one request's
    work, whatever the arrival pattern, so a flooding tenant only lengthens its own
    queue. Tagging tenants instead of requests keeps earliest-deadline-first order
    *within* a tenant (tagging each request would turn a single tenant's EDF into
    FIFO). A tenant that was idle restarts at the level's virtual clock (the virtual
    time of the last tenant served), so idleness banks no credit to burst with later.
    DRR would need a quantum tuned to request sizes and serves in rounds; this needs
    neither. Cost: a heap over the tenants that have work at this level.
    """

    __slots__ = ("heaps", "vt", "clock", "samples", "weights", "per_unit", "usual", "owed")

    def __init__(self) -> None:
        self.heaps: dict[str, list[tuple[float, int, Entry]]] = {}
        self.vt: dict[str, float] = {}
        self.clock = 0.0
        self.samples: dict[str, int] = {}     # queued, per tenant with work here
        self.weights: dict[str, float] = {}
        # seconds a unit of work took, last seen: what a row shared by compute time is
        # reckoned to cost before it is taken (ordering only; the charge is its own)
        self.per_unit = 0.0
        # per tenant: the seconds a unit of its rows usually measures (a moving average),
        # and the stalls' seconds it owes (:meth:`corrected`); kept when the level
        # empties (they are about its rows, not virtual time), bounded by the tenants
        self.usual: dict[str, float] = {}
        self.owed: dict[str, float] = {}

    def _live(self, tenant: str) -> list[tuple[float, int, Entry]]:
        heap = self.heaps.get(tenant)
        if heap is None:
            return []
        while heap and heap[0][2].state != QUEUED:
            heapq.heappop(heap)
        return heap

    def push(self, e: Entry) -> None:
        heap = self._live(e.tenant)
        if not heap:
            self.vt[e.tenant] = max(self.vt.get(e.tenant, 0.0), self.clock)
            self.heaps[e.tenant] = heap
        heapq.heappush(heap, (e.deadline_s, e.seq, e))
        self.samples[e.tenant] = self.samples.get(e.tenant, 0) + e.samples
        self.weights[e.tenant] = e.weight

    def forget(self, e: Entry) -> None:
        """``e`` left the queue (taken, cancelled, expired, shed)."""
        left = self.samples.get(e.tenant, 0) - e.samples
        if left > 0:
            self.samples[e.tenant] = left
        else:
            self.samples.pop(e.tenant, None)
            self.weights.pop(e.tenant, None)

    def ahead(self, tenant: str, weight: float, samples: int) -> int:
        """Queued samples served before a new request of ``samples`` from ``tenant``:
        its own queue, and of every other tenant at most its weight's worth of the same
        virtual time (an estimate: it ignores how far apart virtual times are now)."""
        mine = self.samples.get(tenant, 0)
        span = (mine + samples) / weight
        return mine + sum(min(n, math.ceil(span * self.weights[u]))
                          for u, n in self.samples.items() if u != tenant)

    def cost(self, e: Entry) -> float:
        """The work ``e`` will be charged: its rows, or (shares by compute time) the
        seconds its units are reckoned to take."""
        if not e.by_time:
            return e.samples
        return e.units * (self.per_unit or 1.0)

    def charge(self, e: Entry) -> None:
        """``e`` was taken: its tenant has been served its work (by compute time: the
        seconds the scheduler put on it, ``charged_s``)."""
        v = self.vt.get(e.tenant, self.clock)
        self.clock = max(self.clock, v)
        if e.by_time:
            if e.charged_s > 0 and e.units > 0:
                self.per_unit = e.charged_s / e.units
            work = e.charged_s
        else:
            work = e.samples
        self.vt[e.tenant] = v + work / e.weight

    def corrected(self, tenant: str, share: float, units: float) -> float:
        """What ``tenant`` is charged for its rows of a batch (``units`` of them,
        measured ``share`` seconds): up to :data:`STALL_FACTOR` times their usual time,
        the rest owed; plus what it owes, up to their usual time again. The usual time
        learns from what is charged at once, once a batch, so a stall moves it little."""
        usual = self.usual.get(tenant)
        if usual is None or units <= 0:   # its first batch: nothing to tell a stall by
            if units > 0:
                self.usual[tenant] = share / units
            return share
        typical = usual * units
        now = min(share, STALL_FACTOR * typical)
        owed = self.owed.pop(tenant, 0.0) + share - now
        paid = min(owed, typical)
        if owed > paid:
            self.owed[tenant] = owed - paid
        self.usual[tenant] = usual + USUAL_WEIGHT * (now / units - usual)
        return now + paid

    def adjust(self, tenant: str, weight: float, delta_s: float, units: float = 0.0,
               seconds: float = 0.0) -> None:
        """A batch came back: a tenant's charge corrected by what its rows really took
        (``delta_s``, measured less predicted); ``units``/``seconds`` the measured rate.
        A tenant with no virtual time here (the level emptied since) has nothing to
        correct: idleness restarts it at the clock either way."""
        if units > 0 and seconds > 0:
            self.per_unit = seconds / units
        v = self.vt.get(tenant)
        if v is not None:
            self.vt[tenant] = max(0.0, v + delta_s / weight)

    def clear(self) -> None:
        """The level emptied: every tenant is idle, so all restart level (virtual times
        matter only relative to each other)."""
        self.heaps.clear()
        self.vt.clear()
        self.clock = 0.0
        self.samples.clear()
        self.weights.clear()

    def size(self) -> int:
        return sum(map(len, self.heaps.values()))

    def compact(self) -> None:
        for t in list(self.heaps):
            live = [x for x in self.heaps[t] if x[2].state == QUEUED]
            if live:
                heapq.heapify(live)
                self.heaps[t] = live
            else:
                del self.heaps[t]

    def ordered(self) -> Iterator[Entry]:
        """Live entries in dispatch order, lazily; simulates the virtual times forward
        without changing them (only :meth:`charge` does, for what is really taken)."""
        if len(self.heaps) == 1:  # the common case, one tenant: plain EDF
            (t,) = self.heaps
            for _, _, e in in_order(self._live(t)):
                if e.state == QUEUED:
                    yield e
            return
        turns: list[tuple[float, float, int, str, Iterator[tuple[float, int, Entry]]]] = []
        for t in list(self.heaps):
            heap = self._live(t)
            if not heap:
                continue
            it = in_order(heap)
            first = next(it)
            turns.append((self.vt.get(t, self.clock), first[0], first[1], t,
                          itertools.chain([first], it)))
        heapq.heapify(turns)
        while turns:
            v, _, _, t, it = heapq.heappop(turns)
            for _, _, e in it:
                if e.state == QUEUED:
                    yield e
                    v += self.cost(e) / e.weight
                    break
            nxt = next(it, None)
            if nxt is not None:
                heapq.heappush(turns, (v, nxt[0], nxt[1], t, itertools.chain([nxt], it)))


def in_order(heap: list[tuple[float, int, Entry]]) -> Iterator[tuple[float, int, Entry]]:
    """A heap's items in ascending order, lazily, leaving it as it is: the next item is
    always the least of the children of those already given, so taking k of n costs
    O(k log k). Sorting the heap first cost every batch O(n log n) in the queue's depth
    (bench_broker_growth's queued curve). The heap must not change meanwhile."""
    if not heap:
        return
    frontier = [(heap[0], 0)]
    n = len(heap)
    while frontier:
        item, i = heapq.heappop(frontier)
        yield item
        child = 2 * i + 1
        if child < n:
            heapq.heappush(frontier, (heap[child], child))
            if child + 1 < n:
                heapq.heappush(frontier, (heap[child + 1], child + 1))


def split_by_units(entries: list[Entry], seconds: float) -> list[tuple[str, float]]:
    """A batch's time over its rows, in proportion to each row's units (rows x scale,
    what the latency model prices): (tenant, seconds) a row."""
    total = sum(e.units for e in entries)
    if total <= 0:
        return [(e.tenant, seconds / len(entries)) for e in entries]
    return [(e.tenant, seconds * e.units / total) for e in entries]


def reckon(batch: list[Entry], predict: Callable[[float], float]) -> None:
    """The seconds each row of a batch is charged when taken, shares by compute time:
    the batch's predicted time (every row at its longest scale) split by units;
    corrected by :func:`measured` once it is measured."""
    for e in batch:   # a loop: any() over a generator costs more, every batch
        if e.by_time:
            break
    else:
        return
    rows = sum(e.samples for e in batch)
    predicted = predict(rows * max(e.scale for e in batch))
    for e, (_, share) in zip(batch, split_by_units(batch, predicted)):
        e.charged_s = share


def measured(rows: list[Entry], seconds: float, levels: Mapping[int, FairLevel]
             ) -> list[tuple[str, float]]:
    """A batch of ``rows`` ran ``seconds``: each row's share (tenant, seconds); a tenant
    whose share counts compute time has its charge in its level corrected to it, bounded
    (:meth:`FairLevel.corrected`). The shares returned are the measured
    ones (a tenant's compute time, its quota's spend)."""
    out = split_by_units(rows, seconds)
    total = sum(e.units for e in rows)
    # per tenant (and level) of the batch: its rows' measured and charged seconds, units
    # and weight; one measure of the tenant's usual time however many rows it has here
    mine: dict[tuple[int, str], list[float]] = {}
    for e, (_, share) in zip(rows, out):
        if e.by_time and e.priority in levels:
            acc = mine.get((e.priority, e.tenant))
            if acc is None:
                acc = mine[(e.priority, e.tenant)] = [0.0, 0.0, 0.0, e.weight]
            acc[0] += share
            acc[1] += e.charged_s
            acc[2] += e.units
    for (priority, tenant), (share, charged, units, weight) in mine.items():
        level = levels[priority]
        level.adjust(tenant, weight, level.corrected(tenant, share, units) - charged,
                     total, seconds)
    return out
