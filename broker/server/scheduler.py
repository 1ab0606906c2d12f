"""Queues, priority, deadlines and batch formation: pure logic, no sockets, no clock.

Every method that depends on time takes ``now`` (seconds, the caller's monotonic
clock), so tests drive it with a fake clock.

Order within a model's queue:
  1. requests that have waited ``aging_s`` or more, oldest first (the aging bound:
     no request waits behind younger, higher-priority traffic for longer than that);
  2. then strict priority, 1 highest;
  3. within a priority, weighted fair queuing over tenants (see :class:`_Level`);
  4. earliest deadline first within a tenant, arrival order among equals.
With one tenant (no tenants file) 3 is a no-op: the order is what it was before tenants.

A batch takes its shape key (models/shapes.py: the non-batch dims, after any padding the
config declares) from the first entry that order picks, and fills only from entries with
the same key, in the same order: requests of another shape wait for the next batch, and
no request is failed, or refused, for the shape of another. Time is predicted from units
(rows x scale, a row's cost against the declared shape's), not rows alone. A padded
model's key leaves the length out, and a request joins a batch of another length only
where the latency model says padding pays: where the batch with it, run at its longest
row, costs no more than the batch and the request run apart (on a GPU, whose batch costs
much the same at any size, nearly always; on a CPU at long lengths, rarely).

Shedding under overload takes the newest entry of the worst QoS class first
(``shed_rank``: best_effort before burstable before guaranteed), lowest priority
within a class.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Hashable, Iterable, Iterator

from zeroserve.broker.server.fairqueue import GONE, QUEUED, TAKEN, FairLevel as _Level, \
    measured, reckon
from zeroserve.broker.server.tokenfill import Predict, fill

__all__ = ["GONE", "QUEUED", "TAKEN"]

# why a batch left the queue (label of zeroserve_batches_total{reason})
FULL, IDLE, DELAY, DEADLINE = "full", "idle", "delay_expired", "deadline"


@dataclass(eq=False)
class Entry:
    key: Any   # hashable, the caller's own (the request path's is (client, request id))
    model: str
    priority: int
    arrival_s: float
    deadline_s: float = math.inf
    samples: int = 1
    version: int | None = None
    payload: Any = None
    seq: int = 0
    state: int = QUEUED
    tenant: str = ""          # fair share unit within a priority
    weight: float = 1.0       # the tenant's share
    shed_rank: int = 0        # QoS class: the highest rank is shed first
    shape: Hashable = None    # shape key: only equal keys share a batch
    scale: float = 1.0        # a row's cost in units of the declared shape's
    length: int = 0           # tokens a row: its length along the padded dimension
    by_time: bool = False     # its tenant's share counts compute time, not rows
    charged_s: float = 0.0    # by time: the seconds its tenant was charged when taken

    @property
    def units(self) -> float:
        return self.samples * self.scale

    def again(self) -> "Entry":
        """A fresh entry for the same request, to queue it again (a retry): the old one may
        still sit in the queue's heaps; one object in two places would be taken twice."""
        return replace(self, seq=0, state=QUEUED, charged_s=0.0)


@dataclass(frozen=True)
class Policy:
    """What the scheduler needs of a model's config."""

    max_batch_size: int = 0            # 0: no batching; each request runs alone
    max_queue_delay_s: float = 0.0
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_size: int = 1024
    aging_s: float = 1.0
    max_batch_tokens: int = 0          # 0: batches bounded by rows alone
    packed: bool = False               # tokens counted as the sum of lengths, not padded
    # while the model's requests mix tenants or priorities: a batch's predicted run time
    # at most this (one request always goes), so that a request of another tenant waits
    # for one short batch, not one long one (0: no cap)
    mixed_batch_s: float = 0.0

    @property
    def cap(self) -> int:
        return max(self.max_batch_size, 1)

    def tokens(self, rows: int, longest: int, total: int) -> int:
        """What a batch costs against ``max_batch_tokens``: its rows at the longest
        row's length, or (packed) the sum of its rows' lengths."""
        return total if self.packed else rows * longest


@dataclass
class Decision:
    entries: list[Entry]
    reason: str
    doomed: list[Entry] = field(default_factory=list)  # cannot finish in time: answer now
    tokens: int = 0          # the rows' own tokens (a model with a padded input)
    padded_tokens: int = 0   # what the batch computes: rows x its longest row

    @property
    def padding_ratio(self) -> float:
        """The share of the computed tokens that is padding."""
        return 1.0 - self.tokens / self.padded_tokens if self.padded_tokens else 0.0


# how far past the head of the queue a token-budget batch looks for rows of a similar
# length (the in-process baseline sorts a window of the same size)
TOKEN_WINDOW = 256


def _no_latency(_: float) -> float:
    return 0.0


def _sizes(batch: list[Entry]) -> tuple[int, int, int]:
    """A batch's rows, longest row's tokens and tokens: one pass, every batch (sum, max)."""
    rows = longest = tokens = 0
    for e in batch:
        rows, tokens = rows + e.samples, tokens + e.samples * e.length
        longest = e.length if e.length > longest else longest
    return rows, longest, tokens


@dataclass
class _Queue:
    policy: Policy
    levels: dict[int, _Level] = field(default_factory=dict)
    fifo: deque[Entry] = field(default_factory=deque)
    # per (shed rank, priority): arrival order (the newest is shed first); per priority:
    # queued samples, so that admission and shedding cost the same at any queue depth
    arrivals: dict[tuple[int, int], deque[Entry]] = field(default_factory=dict)
    level_samples: dict[int, int] = field(default_factory=dict)
    count: int = 0
    samples: int = 0
    units: float = 0.0
    # entries that left the queue but may still sit in fifo, arrivals or the levels'
    # heaps (they leave those lazily, from the ends only): compacted once they outnumber
    # the live ones, so memory follows the live queue at any load, not just when full
    dead: int = 0

    def push(self, e: Entry) -> None:
        if self.dead > self.count + 64:
            self._compact()
        level = self.levels.get(e.priority)
        if level is None:
            level = self.levels[e.priority] = _Level()
        level.push(e)
        self.fifo.append(e)
        arrivals = self.arrivals.get((e.shed_rank, e.priority))
        if arrivals is None:
            arrivals = self.arrivals[(e.shed_rank, e.priority)] = deque()
        arrivals.append(e)
        self.level_samples[e.priority] = self.level_samples.get(e.priority, 0) + e.samples
        self.count += 1
        self.samples += e.samples
        self.units += e.units

    def _compact(self) -> None:
        """Drop answered entries from the middle of the arrival lists and heaps (they
        leave lazily from the ends otherwise), so memory follows the live queue."""
        self.fifo = deque(e for e in self.fifo if e.state == QUEUED)
        self.arrivals = {lvl: deque(e for e in d if e.state == QUEUED)
                         for lvl, d in self.arrivals.items()}
        for level in self.levels.values():
            level.compact()
        self.dead = 0

    def forget(self, e: Entry) -> None:
        self.count -= 1
        self.samples -= e.samples
        self.units -= e.units
        self.level_samples[e.priority] -= e.samples
        self.levels[e.priority].forget(e)
        self.dead += 1
        if not self.count:  # empty: nothing of any request may stay behind
            self.units = 0.0   # no float drift left over from the sums
            self.fifo.clear()
            self.arrivals.clear()
            self.level_samples.clear()
            for level in self.levels.values():
                level.clear()
            self.dead = 0

    def census(self) -> dict[str, int]:
        return {"fifo": len(self.fifo), "arrivals": sum(map(len, self.arrivals.values())),
                "fair_heaps": sum(lv.size() for lv in self.levels.values()),
                "queued": self.count}

    def newest(self, level: tuple[int, int]) -> Entry | None:
        arrivals = self.arrivals.get(level)
        while arrivals and arrivals[-1].state != QUEUED:
            arrivals.pop()
        while arrivals and arrivals[0].state != QUEUED:
            arrivals.popleft()
        return arrivals[-1] if arrivals else None

    def samples_at_or_above(self, priority: int, tenant: str | None = None,
                            weight: float = 1.0, samples: int = 0) -> int:
        """Queued samples that run before a new request: every higher priority, and at its
        own, all of it (no tenant named) or what fair queuing serves first."""
        if tenant is None or priority not in self.levels:
            return sum(n for lvl, n in self.level_samples.items() if lvl <= priority)
        return sum(n for lvl, n in self.level_samples.items() if lvl < priority) \
            + self.levels[priority].ahead(tenant, weight, samples)

    def scale(self) -> float:
        """The mean scale of what is queued: the units of a batch not yet formed."""
        return self.units / self.samples if self.samples > 0 else 1.0

    def oldest(self) -> Entry | None:
        while self.fifo and self.fifo[0].state != QUEUED:
            self.fifo.popleft()
        return self.fifo[0] if self.fifo else None

    def ordered(self, now: float) -> Iterator[Entry]:
        """Live entries in dispatch order; lazily, so taking a few costs little."""
        if self.count == 1:   # one request at a time: its order is itself, nothing to weigh
            only = self.oldest()
            assert only is not None   # every live entry is in the fifo
            yield only
            return
        self.oldest()  # drop answered entries from the front, so the scan below stays short
        aged_ids = set()
        # aging lifts over higher priorities; among the top level's tenants shares decide
        top = min((lvl for lvl, n in self.level_samples.items() if n > 0), default=0)
        shared = top in self.levels and len(self.levels[top].samples) > 1
        for e in self.fifo:
            if e.arrival_s + self.policy.aging_s > now:
                break
            if e.state == QUEUED and not (shared and e.priority == top):
                aged_ids.add(id(e))
                yield e
        for level in sorted(self.levels):
            for e in self.levels[level].ordered():
                if id(e) not in aged_ids:
                    yield e


class Scheduler:
    """Per-model queues. The broker admits, cancels, expires and takes batches."""

    def __init__(self) -> None:
        self._queues: dict[str, _Queue] = {}
        self._by_key: dict[Hashable, Entry] = {}
        self._deadlines: list[tuple[float, int, Entry]] = []
        self._seq = itertools.count(1)  # 0: never queued

    # -- configuration ------------------------------------------------------
    def set_policy(self, model: str, policy: Policy) -> None:
        q = self._queues.get(model)
        if q is None:
            self._queues[model] = _Queue(policy)
        else:
            q.policy = policy

    def knows(self, model: str) -> bool:
        return model in self._queues

    def drop_model(self, model: str) -> list[Entry]:
        """Forget a model; returns its queued entries for the caller to answer."""
        q = self._queues.get(model)
        if q is None:
            return []
        left = [e for e in q.fifo if e.state == QUEUED]
        for e in left:
            self._remove(e)  # needs the queue still in place
        del self._queues[model]
        return left

    # -- intake -------------------------------------------------------------
    def add(self, entry: Entry) -> list[Entry]:
        """Queue an entry. Returns the entries shed to make room (answer them
        'overloaded'); if the entry itself is shed it is the one returned."""
        q = self._queues[entry.model]
        if entry.key in self._by_key:
            raise KeyError(f"duplicate request key {entry.key!r}")
        if entry.seq:
            raise ValueError("an entry is queued once; queue entry.again() to retry it")
        entry.seq = next(self._seq)
        shed: list[Entry] = []
        if q.count >= q.policy.max_queue_size:
            victim = self._lowest_newest(q)
            if victim is None or (victim.shed_rank, victim.priority) <= \
                    (entry.shed_rank, entry.priority):
                entry.state = GONE
                return [entry]
            self._remove(victim)
            shed.append(victim)
        entry.state = QUEUED
        q.push(entry)
        self._by_key[entry.key] = entry
        if entry.deadline_s != math.inf:
            if len(self._deadlines) > 2 * len(self._by_key) + 64:
                self._deadlines = [t for t in self._deadlines if t[2].state == QUEUED]
                heapq.heapify(self._deadlines)
            heapq.heappush(self._deadlines, (entry.deadline_s, entry.seq, entry))
        return shed

    def cancel(self, key: Hashable) -> Entry | None:
        e = self._by_key.get(key)
        if e is None:
            return None
        self._remove(e)
        return e

    def expire(self, now: float) -> list[Entry]:
        """Entries whose deadline has passed while queued; they leave the queue."""
        out = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, e = heapq.heappop(self._deadlines)
            if e.state == QUEUED:
                self._remove(e)
                out.append(e)
        return out

    def next_deadline(self) -> float | None:
        while self._deadlines and self._deadlines[0][2].state != QUEUED:
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

    # -- queries ------------------------------------------------------------
    def depth(self, model: str) -> int:
        q = self._queues.get(model)
        return q.count if q else 0

    def queued_samples(self, model: str) -> int:
        q = self._queues.get(model)
        return q.samples if q else 0

    def queued_units(self, model: str) -> float:
        q = self._queues.get(model)
        return q.units if q else 0.0

    def queued(self, model: str) -> list[Entry]:
        """The model's live queued entries (for the lifecycle: re-route or fail them)."""
        q = self._queues.get(model)
        return [e for e in q.fifo if e.state == QUEUED] if q else []

    def head(self, model: str, now: float) -> Entry | None:
        """The live entry a free slot would take first (dispatch order), or None."""
        q = self._queues.get(model)
        if q is None or not q.count:
            return None
        return next((e for e in q.ordered(now) if e.deadline_s > now), None)

    def strongest(self, model: str, now: float) -> Entry | None:
        """The live entry of the highest priority, first of its level: the one whose
        claim on a running sequence's slot preemption weighs (aging orders the free
        slots, not that)."""
        q = self._queues.get(model)
        if q is None or not q.count:
            return None
        for level in sorted(q.levels):
            live = next((e for e in q.levels[level].ordered() if e.deadline_s > now), None)
            if live is not None:
                return live
        return None

    def oldest_arrival(self, model: str) -> float | None:
        """When the longest-queued live entry arrived (the autoscaler's queue time)."""
        q = self._queues.get(model)
        e = q.oldest() if q and q.count else None
        return e.arrival_s if e is not None else None

    def models_waiting(self) -> list[str]:
        """Models with requests queued, in the order a free worker should serve them:
        the best priority waiting, then the longest wait. In the order the queues were
        made, the first model (the busiest, usually) took every credit a result freed,
        and a model asked for now and then waited behind all of it: 80 ms for the tenth
        of twelve models under Zipf(1.1), against 5 ms for the first."""
        if not self._by_key:   # asked several times a turn, mostly with nothing queued
            return []
        waiting = [(m, q) for m, q in self._queues.items() if q.count]
        if len(waiting) == 1:   # one model's: nothing to sort
            return [waiting[0][0]]
        return [m for _, _, m in sorted((min((lvl for lvl, n in q.level_samples.items() if n),
                                             default=0),
                                         q.oldest().arrival_s, m)   # type: ignore[union-attr]
                                        for m, q in waiting)]

    def estimate_wait(self, model: str, priority: int, predict: Predict, workers: int,
                      tenant: str | None = None, weight: float = 1.0,
                      samples: int = 0) -> float:
        """Seconds until the work queued ahead of a new request has run: at this priority
        or above, or, with ``tenant`` (and the request's ``weight`` and ``samples``), what
        fair queuing serves before it (a tenant under its share does not wait for the
        backlog of one over it, and is not refused for it)."""
        q = self._queues.get(model)
        if q is None or not q.count:
            return 0.0
        ahead = q.samples_at_or_above(priority, tenant, weight, samples)
        cap = q.policy.cap
        full, rest = divmod(ahead, cap)
        scale = q.scale()
        # the last batch is a partial one: predicting it at full size refused requests
        # that had time
        return (full * predict(cap * scale) + (predict(rest * scale) if rest else 0.0)) \
            / max(workers, 1)

    # -- batch formation ----------------------------------------------------
    def take(self, model: str, now: float, predict: Predict = _no_latency,
             resolve: Callable[[Entry], int | None] = lambda e: e.version or 0,
             start_s: float | None = None, max_samples: int | None = None,
             mixed: bool = False) -> Decision | None:
        """Form a batch for a worker with a free credit, or None if it should wait.

        The batch is the longest prefix of the dispatch order that fits the
        model's cap and whose predicted run time still meets the tightest deadline
        in it. ``resolve`` gives the version an entry would run as on this worker,
        or None if it cannot run there; entries of another version than the first
        are skipped. ``start_s`` is when the worker is predicted to start the batch
        (after what it already has in flight); ``max_samples`` caps the batch below the
        model's own cap; ``mixed``: the model's recent requests mix tenants or
        priorities, so the policy's ``mixed_batch_s`` bounds the batch's predicted time.
        An entry that could not finish by its
        deadline even alone is taken out as ``doomed``, to be refused at once rather
        than run late or left to expire (deadline-aware shedding).
        ``next_due`` says when to ask again after a None.
        """
        q = self._queues.get(model)
        if q is None or not q.count:
            return None
        pol = q.policy
        cap = pol.cap if max_samples is None else max(1, min(pol.cap, max_samples))
        reason = self._wait_reason(q, now, predict)
        if reason is None:
            return None
        if pol.preferred_batch_sizes:
            fitting = [p for p in pol.preferred_batch_sizes if p <= min(q.samples, cap)]
            if fitting:
                cap = fitting[-1]
        start = now if start_s is None else max(now, start_s)
        limit = pol.mixed_batch_s if mixed and pol.mixed_batch_s > 0 else math.inf
        if pol.max_batch_tokens:
            batch, doomed = self._by_tokens(q, now, start, cap, predict, resolve, limit)
            return self._taken(q, batch, doomed, reason, predict)
        batch = []
        doomed = []
        total, tightest, version, scale = 0, math.inf, None, 0.0
        for e, v in self._runnable(q, now, start, predict, resolve, doomed):
            if batch and (v != version or e.shape != batch[0].shape):
                continue
            if batch and total + e.samples > cap:
                break
            tight = min(tightest, e.deadline_s)
            # a padded batch runs every row at its longest row's scale
            joined = predict((total + e.samples) * max(scale, e.scale)) if batch else 0.0
            if batch and (start + joined > tight or joined > limit):
                break
            if batch and e.scale != scale and \
                    joined > predict(total * scale) + predict(e.units):
                continue   # padding it in costs more than running it apart: it waits
            batch.append(e)
            total += e.samples
            tightest, version, scale = tight, v, max(scale, e.scale)
            if total >= cap:
                break
        for e in batch:
            e.version = version
        return self._taken(q, batch, doomed, reason, predict)

    def _taken(self, q: _Queue, batch: list[Entry], doomed: list[Entry],
               reason: str, predict: Predict) -> Decision:
        """The batch leaves the queue (charged to its tenants), the doomed with it."""
        reckon(batch, predict)
        for e in batch:
            e.state = TAKEN
            q.levels[e.priority].charge(e)
            q.forget(e)
            del self._by_key[e.key]
        for e in doomed:
            self._remove(e)
        self._settle()
        rows, longest, tokens = _sizes(batch)
        if reason == IDLE and (rows >= q.policy.cap or q.policy.max_batch_tokens and
                               q.policy.tokens(rows, longest, tokens)
                               >= q.policy.max_batch_tokens):
            reason = FULL
        return Decision(batch, reason, doomed, tokens, rows * longest)

    @staticmethod
    def _runnable(q: _Queue, now: float, start: float, predict: Predict,
                  resolve: Callable[[Entry], int | None], doomed: list[Entry]
                  ) -> Iterator[tuple[Entry, int]]:
        """Live entries in dispatch order that can run on this worker, with the version
        each would run as; one that could not finish by its deadline even alone goes to
        ``doomed`` (refused at once rather than run late)."""
        for e in q.ordered(now):
            if e.deadline_s <= now:
                continue   # expired: expire() answers it; never run it
            if start + predict(e.units) > e.deadline_s:
                doomed.append(e)
                continue
            v = resolve(e)
            if v is not None:
                yield e, v

    def _by_tokens(self, q: _Queue, now: float, start: float, cap: int, predict: Predict,
                   resolve: Callable[[Entry], int | None], limit: float
                   ) -> tuple[list[Entry], list[Entry]]:
        """A batch under the token budget: the head of the dispatch order, then rows of
        a length near its own from the next :data:`TOKEN_WINDOW` entries of its version
        and shape, as :func:`tokenfill.fill` chooses them."""
        doomed: list[Entry] = []
        window: list[Entry] = []
        for e, v in self._runnable(q, now, start, predict, resolve, doomed):
            if window and (v != window[0].version or e.shape != window[0].shape):
                continue
            if not window:
                e.version = v
            window.append(e)
            if len(window) > TOKEN_WINDOW:
                break
        if not window:
            return [], doomed
        batch = fill(window[0], window[1:], q.policy, now, start, cap, predict, limit)
        for e in batch:
            e.version = window[0].version
        return batch, doomed

    def next_due(self, model: str, now: float, predict: Predict = _no_latency) -> float | None:
        """When a waiting (delayed) queue must be looked at again."""
        q = self._queues.get(model)
        if q is None or not q.count or q.policy.max_queue_delay_s <= 0:
            return None
        oldest = q.oldest()
        if oldest is None:
            return None
        due = oldest.arrival_s + q.policy.max_queue_delay_s
        head = next(q.ordered(now), None)
        tightest = min((e.deadline_s for e in q.fifo if e.state == QUEUED), default=math.inf)
        if head is not None and tightest != math.inf:
            due = min(due, tightest - predict(min(q.samples, q.policy.cap) * q.scale()))
        return due

    def _wait_reason(self, q: _Queue, now: float, predict: Predict) -> str | None:
        pol = q.policy
        if pol.max_queue_delay_s <= 0 or pol.max_batch_size == 0:
            return IDLE
        target = pol.preferred_batch_sizes[-1] if pol.preferred_batch_sizes else pol.cap
        if q.samples >= min(target, pol.cap):
            return FULL
        oldest = q.oldest()
        assert oldest is not None  # q.count > 0
        if now >= oldest.arrival_s + pol.max_queue_delay_s:
            return DELAY
        tightest = min((e.deadline_s for e in q.fifo if e.state == QUEUED), default=math.inf)
        if now + predict(min(q.samples, pol.cap) * q.scale()) >= tightest:
            return DEADLINE
        return None

    def used(self, model: str, entries: Iterable[Entry], seconds: float) -> list[Any]:
        """A batch ran ``seconds``: (tenant, seconds) a row (:func:`fairqueue.measured`)."""
        q = self._queues.get(model)
        return measured(list(entries), seconds, q.levels if q is not None else {})

    # -- internals ----------------------------------------------------------
    def _remove(self, e: Entry) -> None:
        if e.state == QUEUED:
            self._queues[e.model].forget(e)
        e.state = GONE
        self._by_key.pop(e.key, None)
        self._settle()

    def _settle(self) -> None:
        """With nothing queued, the deadline heap lets go of every answered entry."""
        if not self._by_key and self._deadlines:
            self._deadlines.clear()

    def census(self) -> dict[str, int]:
        """Size of every structure that holds requests, by name: all 0 once every
        request has been answered (the fault tests check it through ``census``)."""
        out = {"scheduler.by_key": len(self._by_key),
               "scheduler.deadlines": len(self._deadlines)}
        for q in self._queues.values():
            for name, n in q.census().items():
                out[f"scheduler.{name}"] = out.get(f"scheduler.{name}", 0) + n
        return out

    @staticmethod
    def _lowest_newest(q: _Queue) -> Entry | None:
        """The newest entry of the worst class, lowest priority within it."""
        for level in sorted(q.arrivals, reverse=True):
            victim = q.newest(level)
            if victim is not None:
                return victim
        return None
