"""Iterative models: the sequence table that runs a handler's steps (continuous batching).

The contract (docs/generation.md), a class ``Model`` in ``model.py`` with::

    def load(self, version_dir, device): ...
    def join(self, seq_id, inputs) -> state
        # a request becomes a sequence: inputs {name: tensor} are its own (dim 0 its
        # rows when the model batches), as a batch of one; do its prefill here
    def step(self, states) -> {seq_id: (outputs, final)}
        # one step of every sequence running: states {seq_id: the state join returned}
    def advance(self, states): ...    # optional: compute the next step's responses
    def leave(self, seq_id): ...      # optional: the sequence is gone (ended or stopped)
    def pause(self, seq_id): ...      # optional: it sits out the steps until resume
    def resume(self, seq_id): ...     # optional: it steps again

``step`` maps a sequence to ``(outputs, final)`` as a decoupled generator's yield maps a
request (workers/streaming.py): ``outputs`` a dict of that request's outputs, ``None`` or
``{}`` for an empty response (final only), and ``final`` ends its stream. A step names
only the sequences it has a response for. The state is the handler's: the table keeps
what ``join`` returned and hands it back; a state that changes is changed in place (a
dict, an object), or kept by the handler under ``seq_id``.

A handler with ``advance`` splits a step in two: ``step`` answers what is ready (a
join's first token from its prefill, the token the last decode chose) and ``advance``
computes the next ones (a decode). The table calls ``advance`` with the sequences still
running right after it has sent the step's responses, so a token leaves the worker as
soon as it exists instead of waiting for the next decode. Without it ``step`` does both.

At each step boundary the table retires the sequences the broker stopped (a cancel, a
client gone, a deadline before the first response), pauses those the broker paused (a
request of a higher priority takes their slot: PAUSE), joins waiting requests up to
``sequences.max``, resumes paused ones into the slots still free (the first paused
first; not a slot owed to a preemptor whose batch the worker has not read yet), runs one
step and sends its responses at once, a PARTIAL per join (the broker's batch), together
in one STEPS where the broker reads it, then calls ``advance`` where the handler has it;
a join gets its RESULT once every request of it has left. An exception in ``join``,
``step`` or ``advance`` fails the joins of the sequences it touched, whole: their
requests still open end with the message, their sequences leave the table.
"""

from __future__ import annotations

import collections
import itertools
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import AbstractSet, Any, Callable

import torch

from zeroserve.broker import protocol as p
from zeroserve.models.loader import LoadedModel
from zeroserve.workers.batching import BatchError, assemble, rows
from zeroserve.workers.streaming import response_tensors

logger = logging.getLogger(__name__)

# A PAUSE's slot is kept for the request that preempted, whose batch the broker sends
# right behind it, this long at most (then a paused sequence may take it back: the
# broker sent none after all, its request gone before it left).
PREEMPTOR_WAIT_NS = 100_000_000


@dataclass
class Timeline:
    """One sequence's moments, on this host's monotonic clock (ns)."""

    received_ns: int       # the worker read its join
    prefill_ns: int        # its join() began
    prefilled_ns: int = 0  # and returned
    first_ns: int = 0      # its first response was sent
    end_ns: int = 0        # it left (its last response, a stop, a failure)
    steps: int = 0         # responses it was sent, a step each
    paused: int = 0        # times it was paused for a request of a higher priority
    waited_steps: int = 0  # steps run while it waited to join (0: at the first boundary)

    def step(self, now_ns: int) -> None:
        if not self.steps:
            self.first_ns = now_ns
        self.steps += 1


class _Join:
    """One batch of the broker's: its requests join as sequences, its RESULT goes once
    every one has left."""

    __slots__ = ("batch", "left", "start_s", "taken_ns", "received_ns", "step", "timelines")

    def __init__(self, batch: p.Batch, taken_ns: int, received_ns: int, step: int) -> None:
        self.batch = batch
        self.step = step   # the table's steps when it came: its sequences' wait in steps
        self.left = len(batch.items)   # requests that have not left yet
        self.start_s = time.perf_counter()
        self.taken_ns = taken_ns
        self.received_ns = received_ns
        # a traced join's sequences that left, by request id: their spans' times
        self.timelines: dict[str, Timeline] = {}


class _Seq:
    __slots__ = ("join", "item", "rows", "state", "timeline")

    def __init__(self, join: _Join, item: p.BatchItem, rows: int, state: Any,
                 timeline: Timeline) -> None:
        self.join, self.item, self.rows, self.state = join, item, rows, state
        self.timeline = timeline


class SequenceTable:
    """One iterative model version's running sequences, on the compute thread."""

    def __init__(self, loaded: LoadedModel, emit: Callable[[list[p.Partial]], None],
                 finish: Callable[[p.Batch, p.BatchResult, int], None],
                 stopped: Callable[[int], AbstractSet[str]],
                 ids: itertools.count[int],
                 pauses: Callable[[int], Mapping[str, int]] = lambda _: {},
                 traced: Callable[[p.Batch, Mapping[str, Timeline]], None] | None = None,
                 clock: Callable[[], int] = time.monotonic_ns) -> None:
        self.loaded = loaded
        self._emit = emit            # a step's responses, a PARTIAL per join, sent at once
        self._finish = finish        # a join's RESULT (and when it was taken, for spans)
        self._stopped = stopped      # a join's items the broker has answered already
        self._ids = ids
        # a join's items the broker paused since last asked, each with when the worker
        # read the PAUSE (monotonic ns, as a join's ``received_ns``)
        self._pauses = pauses
        self._clock = clock
        self._traced = traced        # a traced join's sequences' times, once it is done
        self._steps = 0              # steps run, for a join's wait in steps
        self._handler = loaded.handler
        self._leave = getattr(loaded.handler, "leave", None)
        self._pause = getattr(loaded.handler, "pause", None)
        self._resume = getattr(loaded.handler, "resume", None)
        self._advance = getattr(loaded.handler, "advance", None)
        self._waiting: collections.deque[tuple[_Join, p.BatchItem]] = collections.deque()
        # requests paused before they joined: they join after those waiting, as a paused
        # sequence resumes (into a slot no preemptor is owed)
        self._deferred: collections.deque[tuple[_Join, p.BatchItem]] = collections.deque()
        # when the worker read each PAUSE whose preemptor's batch it has not read yet: a
        # slot each is owed to a request on its way (the broker sends it right behind),
        # not to a paused sequence, which otherwise takes back the slot it just left
        # when the pause is taken at a step boundary before the preemptor is read
        self._owed: list[int] = []
        self._last_received_ns = 0   # the latest join's received_ns
        self._running: dict[int, _Seq] = {}
        # paused, their states kept, in the order they paused (the first resumes first)
        self._paused: dict[int, _Seq] = {}

    @property
    def busy(self) -> bool:
        return bool(self._running or self._waiting or self._deferred or self._paused)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def paused(self) -> int:
        return len(self._paused)

    def lapse_ns(self) -> int | None:
        """When the first slot owed to a preemptor not read yet lapses (this table's
        clock): with nothing to step, what the table waits for on its own; None when
        only a message (a batch, a STOP) can give it a step."""
        return min(self._owed) + PREEMPTOR_WAIT_NS if self._owed else None

    def join(self, batch: p.Batch, taken_ns: int, received_ns: int = 0) -> None:
        """A batch's requests wait to join at the next step boundary; ``received_ns``:
        when the worker read it (monotonic), the start of its sequences' spans."""
        join = _Join(batch, taken_ns, received_ns or taken_ns, self._steps)
        self._waiting.extend((join, item) for item in batch.items)
        # the batches behind a PAUSE on the wire came after it: its preemptor is here
        self._last_received_ns = max(self._last_received_ns, join.received_ns)
        self._owed = [t for t in self._owed if t > self._last_received_ns]

    def step(self) -> bool:
        """One step boundary: retire, join, run one step, answer the joins done; False
        when no sequence was left to step."""
        self._retire_stopped()
        self._pause_asked()
        self._admit()
        self._take_back()
        if not self._running:
            return False
        self._run_step()
        return True

    # -- the step boundary ------------------------------------------------------
    def _retire_stopped(self) -> None:
        known: dict[int, AbstractSet[str]] = {}

        def gone(join: _Join) -> AbstractSet[str]:
            batch_id = join.batch.batch_id
            if batch_id not in known:
                known[batch_id] = self._stopped(batch_id)
            return known[batch_id]

        for table in (self._running, self._paused):
            for seq_id, seq in list(table.items()):
                if seq.item.request_id in gone(seq.join):
                    self._retire(seq_id)
                    self._left(seq.join)
        self._waiting = self._unless_gone(self._waiting, gone)
        self._deferred = self._unless_gone(self._deferred, gone)

    def _unless_gone(self, queue: collections.deque[tuple[_Join, p.BatchItem]],
                     gone: Callable[[_Join], AbstractSet[str]]
                     ) -> collections.deque[tuple[_Join, p.BatchItem]]:
        """A queue of requests not joined, less those stopped (their joins told)."""
        if not queue:
            return queue
        keep: collections.deque[tuple[_Join, p.BatchItem]] = collections.deque()
        for join, item in queue:
            if item.request_id in gone(join):
                self._left(join)
            else:
                keep.append((join, item))
        return keep

    def _pause_asked(self) -> None:
        """The sequences the broker paused sit out the steps from now; one not joined
        yet joins after the requests waiting (its slot is the newcomer's); either's slot
        is owed to the newcomer until its batch is read."""
        asked: dict[int, Mapping[str, int]] = {}
        for join in {id(j): j for j in [*(s.join for s in self._running.values()),
                                        *(j for j, _ in self._waiting)]}.values():
            items = self._pauses(join.batch.batch_id)
            if items:
                asked[join.batch.batch_id] = items
        if not asked:
            return
        for seq_id, seq in list(self._running.items()):
            read_ns = asked.get(seq.join.batch.batch_id, {}).get(seq.item.request_id)
            if read_ns is not None:
                del self._running[seq_id]
                self._paused[seq_id] = seq
                seq.timeline.paused += 1
                self._owe(read_ns)
                if self._pause is not None:
                    self._call(self._pause, seq_id, seq)
        later = [(j, it) for j, it in self._waiting
                 if it.request_id in asked.get(j.batch.batch_id, ())]
        if later:
            self._waiting = collections.deque(
                [(j, it) for j, it in self._waiting
                 if it.request_id not in asked.get(j.batch.batch_id, ())])
            self._deferred.extend(later)
            for j, it in later:
                self._owe(asked[j.batch.batch_id][it.request_id])

    def _owe(self, read_ns: int) -> None:
        """A paused request's slot, owed to its preemptor unless its batch is here."""
        if read_ns > self._last_received_ns:
            self._owed.append(read_ns)

    def _take_back(self) -> None:
        """Requests paused before they joined, then paused sequences (the first paused
        first), take the slots the requests waiting left free and no preemptor on its
        way is owed."""
        if self._waiting or not (self._deferred or self._paused):
            return
        if self._owed:
            since = self._clock() - PREEMPTOR_WAIT_NS
            self._owed = [t for t in self._owed if t > since]
        capacity = self.loaded.config.max_sequences - len(self._owed)
        self._admit(capacity, deferred=True)
        while self._paused and not self._deferred and len(self._running) < capacity:
            seq_id = next(iter(self._paused))
            seq = self._paused.pop(seq_id)
            self._running[seq_id] = seq
            if self._resume is not None:
                self._call(self._resume, seq_id, seq)

    def _call(self, hook: Callable[[int], Any], seq_id: int, seq: _Seq) -> bool:
        """The handler's pause or resume; one that raises fails the sequence's join."""
        try:
            with torch.inference_mode():
                hook(seq_id)
        except Exception as exc:  # the model's code can raise anything
            self._fail([seq.join], f"{hook.__name__}() failed: {type(exc).__name__}: {exc}")
            return False
        return True

    def _admit(self, capacity: int | None = None, deferred: bool = False) -> None:
        """Requests waiting (or, ``deferred``, those paused before they joined) join
        while fewer than ``capacity`` (the slots, by default) run."""
        if capacity is None:
            capacity = self.loaded.config.max_sequences
        while len(self._running) < capacity:
            queue = self._deferred if deferred else self._waiting   # _fail replaces it
            if not queue:
                return
            join, item = queue.popleft()
            seq_id = next(self._ids)
            timeline = Timeline(join.received_ns, time.monotonic_ns(),
                                waited_steps=self._steps - join.step)
            try:
                inputs, _ = assemble(self.loaded, [item],
                                     pin=self.loaded.device.startswith("cuda"))
                named = {spec.name: t for spec, t in zip(self.loaded.config.inputs, inputs)}
                with torch.inference_mode():
                    state = self._handler.join(seq_id, named)
            except Exception as exc:  # the model's code can raise anything
                self._fail([join], f"join() failed: {type(exc).__name__}: {exc}")
                continue
            timeline.prefilled_ns = time.monotonic_ns()
            self._running[seq_id] = _Seq(join, item, rows(self.loaded, [item]), state,
                                         timeline)

    def _run_step(self) -> None:
        states = {seq_id: seq.state for seq_id, seq in self._running.items()}
        try:
            with torch.inference_mode():
                out = self._handler.step(states)
            parts = self._parts(out)
        except Exception as exc:  # the model's code can raise anything
            self._fail(list({id(s.join): s.join for s in self._running.values()}.values()),
                       f"{type(exc).__name__}: {exc}")
            return
        # first responses lead the message: a joiner (a VIP that preempted, a newcomer)
        # reaches its client ahead of the running streams' tokens of the step it joined,
        # not behind them (it came last in the table's order)
        parts.sort(key=lambda part: self._running[part[0]].timeline.steps > 0)
        by_join: dict[int, tuple[_Join, list[p.PartialItem]]] = {}
        self._steps += 1
        now_ns = time.monotonic_ns()
        for seq_id, part in parts:
            seq = self._running[seq_id]
            seq.timeline.step(now_ns)
            by_join.setdefault(seq.join.batch.batch_id, (seq.join, []))[1].append(part)
        ended = [(seq_id, self._running[seq_id].join) for seq_id, part in parts if part.final]
        for seq_id, _ in ended:
            self._retire(seq_id)
        if by_join:
            self._emit([p.Partial(join.batch.batch_id, items)
                        for join, items in by_join.values()])
        for _, join in ended:
            self._left(join)
        if self._advance is not None and self._running:
            self._advance_running(self._advance)

    def _advance_running(self, advance: Callable[[dict[int, Any]], Any]) -> None:
        """The handler computes the next step's responses, after this step's are sent."""
        states = {seq_id: seq.state for seq_id, seq in self._running.items()}
        try:
            with torch.inference_mode():
                advance(states)
        except Exception as exc:  # the model's code can raise anything
            self._fail(list({id(s.join): s.join for s in self._running.values()}.values()),
                       f"advance() failed: {type(exc).__name__}: {exc}")

    def _parts(self, out: Any) -> list[tuple[int, p.PartialItem]]:
        """A step's responses, checked whole before any is sent (a bad one fails the
        step, and no stream gets half of it)."""
        if not isinstance(out, Mapping):
            raise BatchError(f"step() returned {type(out).__name__}; it maps a sequence's "
                             "id to (outputs, final)")
        parts = []
        for seq_id, value in out.items():
            seq = self._running.get(seq_id)
            if seq is None:
                raise BatchError(f"step() answered sequence {seq_id!r}, which is not "
                                 "running (it was not in the states it was given)")
            if not (isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], bool)):
                raise BatchError(f"sequence {seq_id}: each response is (outputs, final), "
                                 f"got {type(value).__name__}")
            outputs, final = value
            if outputs is None or (isinstance(outputs, Mapping) and not outputs):
                if not final:
                    raise BatchError(f"sequence {seq_id}: an empty response must be final")
                tensors: list[p.Tensor] = []
            else:
                tensors = response_tensors(self.loaded, outputs, seq.rows, seq.item.outputs)
            parts.append((seq_id, p.PartialItem(seq.item.request_id, final, tensors)))
        return parts

    # -- leaving ------------------------------------------------------------------
    def _retire(self, seq_id: int) -> None:
        seq = self._running.pop(seq_id, None) or self._paused.pop(seq_id, None)
        if seq is not None and seq.join.batch.trace is not None:
            seq.timeline.end_ns = time.monotonic_ns()
            seq.join.timelines[seq.item.request_id] = seq.timeline
        if self._leave is not None:
            try:
                # as join and step: a handler's leave may write the tensors they made
                # (outside inference mode the causal LM's slab refused the row's move,
                # and every left sequence's row stayed in every decode after)
                with torch.inference_mode():
                    self._leave(seq_id)
            except Exception as exc:  # the model's code can raise anything
                logger.warning("%s: leave(%s) raised %s: %s", self.loaded.name, seq_id,
                               type(exc).__name__, exc)

    def _left(self, join: _Join) -> None:
        join.left -= 1
        if join.left == 0:
            elapsed_ms = (time.perf_counter() - join.start_s) * 1000.0
            self._finish(join.batch, p.BatchResult(join.batch.batch_id, [], elapsed_ms,
                                                   phases_ms={"infer": elapsed_ms}),
                         join.taken_ns)
            self._trace(join)

    def _fail(self, joins: list[_Join], error: str) -> None:
        """Each of ``joins`` fails whole: its RESULT carries the error, its sequences
        leave, running or waiting."""
        doomed = {id(j) for j in joins}
        for table in (self._running, self._paused):
            for seq_id, seq in list(table.items()):
                if id(seq.join) in doomed:
                    self._retire(seq_id)
        self._waiting = collections.deque((j, it) for j, it in self._waiting
                                          if id(j) not in doomed)
        self._deferred = collections.deque((j, it) for j, it in self._deferred
                                           if id(j) not in doomed)
        for join in joins:
            if join.left > 0:
                join.left = 0
                elapsed_ms = (time.perf_counter() - join.start_s) * 1000.0
                self._finish(join.batch, p.BatchResult(join.batch.batch_id, [], elapsed_ms,
                                                       error=error), join.taken_ns)
                self._trace(join)

    def _trace(self, join: _Join) -> None:
        """A traced join's sequences' spans, after its RESULT (workers/spans.py)."""
        if self._traced is not None and join.batch.trace is not None and join.timelines:
            self._traced(join.batch, join.timelines)
