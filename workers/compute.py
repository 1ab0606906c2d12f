"""The worker's compute thread: it reads the broker's socket while it is idle and runs each
batch it reads at once, in the thread that received it, then sends the result. At one
request at a time a hand-off to another thread cost a wake-up and the GIL's passing on
every batch (mlp, direct C=1: see the commit that made it so). Between batches it steps
the iterative models' sequences (workers/sequences.py). What it reads that is not its
batch it hands to the main loop's router (workers/worker.py), in order; how the threads
share the socket is workers/channel.py's to say."""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import select
import threading
import time
from typing import Any, Protocol

import zmq
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from zeroserve.broker import protocol as p
from zeroserve.broker.process import RateLimitedLog
from zeroserve.models.loader import LoadedModel
from zeroserve.workers import batching, streaming
from zeroserve.workers.callers import CallerThreads
from zeroserve.workers.channel import BrokerChannel, drain
from zeroserve.workers.loaded import Key, LoadedModels
from zeroserve.workers.sequences import SequenceTable

logger = logging.getLogger(__name__)

# A batch that may run this long has the main thread read the broker's socket meanwhile;
# shorter ones (mlp's, about 0.1-0.5 ms at batch 1) keep the wake-up it costs off them.
TAKEOVER_S = 0.05
# a batch, the deadline by which it must start, and when it was read (monotonic ns)
Job = tuple[p.Batch, float, int]


def _is_batch(frames: list[Any]) -> bool:
    return len(frames) >= 2 and bytes(frames[0]) == p.Kind.BATCH.value


class Router(Protocol):
    """The main loop's side of what the compute thread reads (workers/worker.py)."""

    def route(self, frames: list[Any]) -> bool:
        """Under the channel's lock: a message that is not a batch, to its thread; True
        when it is the main thread's."""

    def heard(self, now: float) -> None:
        """The broker spoke (the main loop counts it lost after its silence); called as
        a batch is read, under the channel's lock."""


class Resting:
    """The compute thread's wait while every sequence it holds is paused, its slot owed
    to a preemptor whose batch is not read yet: on its wake-up pipe, rather than a loop
    of empty step boundaries (which spun a core for up to PREEMPTOR_WAIT_NS). The main
    thread says each batch and STOP it hands over; one while it waits wakes it."""

    def __init__(self, channel: BrokerChannel) -> None:
        self._channel = channel
        # the pipe alone: the main thread reads the socket while sequences run
        self._poller = select.poll()
        self._poller.register(channel.compute_wake.fileno(), select.POLLIN)
        self._waiting = False
        self.count = 0   # batches and STOPs handed over (the main thread its one writer)

    def news(self) -> None:
        """From the main thread, once it has handed a batch or a STOP over."""
        # counted first: wait() looks at the count once it says it waits, so one of the
        # two threads sees the other
        self.count += 1
        if self._waiting:
            self._channel.wake_compute()

    def wait(self, seen: int, lapses: list[int]) -> None:
        """Until news since ``seen`` (the count before the step boundary that found
        nothing to step) or the first owed slot's lapse (``lapses``, monotonic ns);
        with none owed, a second at most (a missed edge costs that, never a hang)."""
        wait_ms = 1000 if not lapses else \
            max(1, (min(lapses) - time.monotonic_ns()) // 1_000_000 + 1)
        self._waiting = True
        try:
            if self.count == seen and self._poller.poll(wait_ms):
                drain(self._channel.compute_wake)
        finally:
            self._waiting = False


class Compute:
    """The compute thread and what only it runs: batches, sequence steps, the batches of
    handlers that call models handed to their caller threads (workers/callers.py).

    Shared with the main thread: ``queue`` (a batch the main thread read, for this thread
    to run next), ``stop`` (a stream's items the broker answered already) and the
    read-only ``busy_since`` and ``handed`` it polls to decide whether it reads the
    socket itself. The loader calls ``forget`` when a version's files may run
    differently."""

    def __init__(self, models: LoadedModels, worker_id: str, registry: CollectorRegistry, *,
                 spans: Any, bad_log: RateLimitedLog) -> None:
        self.models = models
        self.worker_id = worker_id
        self.spans = spans   # opentelemetry mode: a workers/spans.py BatchSpans
        self._bad_log = bad_log
        # batches the main thread read while this thread ran one, for it to run next
        self._jobs: collections.deque[Job] = collections.deque()
        self._busy_since: float | None = None   # this thread's batch began then
        self._handed = False      # it runs a stream or a long batch: the main thread reads
        self._last_run: dict[Key, tuple[float, float]] = {}  # seconds, units
        self._closing = False
        # stream batches received and not finished -> their items the broker answered
        # already (STOP); the main thread adds, this thread reads and forgets
        self._stops: dict[int, set[str]] = {}
        # iterative models' items to pause (PAUSE), taken by the sequence table at its next
        # step boundary; under the same lock
        self._pauses: dict[int, dict[str, int]] = {}   # item -> when read (monotonic ns)
        self._stops_lock = threading.Lock()
        # iterative models' running sequences, by the loaded version they run on (this
        # thread's alone); while one is busy this thread steps it between the batches it
        # runs, and the main thread reads the socket
        self._tables: dict[int, SequenceTable] = {}
        self._seq_ids = itertools.count(1)
        self._callers = CallerThreads(self._execute, self._finish, self._waiting)
        self._thread: threading.Thread | None = None
        self._claimed: Job | None = None   # the batch _claim took, for _read_batch
        self._channel: BrokerChannel   # from start()
        self._router: Router
        self._resting: Resting
        r = registry
        self.m_compute = Histogram("zeroserve_worker_batch_seconds", "Batch run time",
                                   ["model"], registry=r,
                                   buckets=(.001, .002, .005, .01, .02, .05, .1, .2, .5, 1, 5))
        self.m_expired = Counter("zeroserve_worker_expired_requests",
                                 "Requests not run because their deadline passed first",
                                 registry=r)
        self.m_sequences = Gauge("zeroserve_worker_sequences",
                                 "Sequences an iterative model runs on this worker now",
                                 ["model"], registry=r)
        self.m_paused = Gauge("zeroserve_worker_sequences_paused", "Sequences of an iterative "
                              "model paused on this worker for a request of a higher "
                              "priority", ["model"], registry=r)
        self.m_steps = Counter("zeroserve_worker_steps", "Steps an iterative model ran",
                               ["model"], registry=r)

    # -- what the main thread sees and does ---------------------------------------
    @property
    def busy_since(self) -> float | None:
        """When the batch this thread runs began (or its sequences' last step ended);
        None while it is idle, reading the socket."""
        return self._busy_since

    @property
    def handed(self) -> bool:
        """It runs a stream, a batch that may run long, or sequences: the main thread
        reads the socket meanwhile."""
        return self._handed

    def start(self, channel: BrokerChannel, router: Router) -> threading.Thread:
        self._channel, self._router = channel, router
        self._resting = Resting(channel)
        thread = self._thread = threading.Thread(target=self._loop, name="compute",
                                                 daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        self._closing = True
        self._channel.wake_compute()

    def queue(self, header: dict[str, Any], bufs: Any, received_s: float) -> None:
        """From the main thread: a batch it read, run next."""
        self._jobs.append(self._job(header, bufs, received_s))
        self._resting.news()
        if self._busy_since is None:   # it finished meanwhile and may be asleep
            self._channel.wake_compute()

    def stop(self, stop: p.Stop) -> None:
        """From the main thread: a stream's items the broker answered already."""
        with self._stops_lock:
            if stop.batch_id in self._stops:   # else it is done already
                self._stops[stop.batch_id].update(stop.items)
        self._resting.news()   # a paused sequence stopped may leave its table empty

    def pause(self, pause: p.Pause) -> None:
        """From the main thread: sequences of an iterative batch to pause (PAUSE)."""
        with self._stops_lock:
            if pause.batch_id in self._stops:
                # on a join's received_ns clock: the table owes the preemptor read
                # after it a slot (workers/sequences.py)
                read_ns = int(time.monotonic() * 1e9)
                self._pauses.setdefault(pause.batch_id, {}).update(
                    dict.fromkeys(pause.items, read_ns))

    def forget(self, key: Key) -> None:
        """From the loader: the version's last batch says nothing of its next."""
        self._last_run.pop(key, None)

    # -- the thread ---------------------------------------------------------------
    def _loop(self) -> None:
        wake = self._channel.compute_wake
        poller = select.poll()
        poller.register(wake.fileno(), select.POLLIN)
        polled = -1
        while not self._closing:
            if self._jobs:
                self._run(self._jobs.popleft())
                continue
            if self._tables:
                # a step boundary: what came meanwhile ran or joined first
                seen = self._resting.count
                if not self._step() and self._tables:
                    self._resting.wait(seen, [t for t in (
                        table.lapse_ns() for table in self._tables.values()) if t is not None])
                continue
            try:
                job = self._read_batch()
            except (zmq.ZMQError, OSError) as exc:  # the main thread closed it: we are exiting
                logger.debug("compute thread stops reading: %s", exc)
                return
            if job is not None:
                self._run(job)
                continue
            if polled != self._channel.fd:   # a reconnect made a new socket
                if polled >= 0:
                    poller.unregister(polled)
                polled = self._channel.fd
                poller.register(polled, select.POLLIN)
            # bounded: a missed edge costs at most a second, never a hang
            if any(fd == wake.fileno() for fd, _ in poller.poll(1000)):
                drain(wake)

    def _read_batch(self) -> Job | None:
        """A batch from the socket if one is waiting; any other message goes to the main
        thread (in order, and while the lock is held, so before anything it reads)."""
        while not self._closing:
            self._claimed = None
            if self._channel.recv_batch(self._claim, self._router.route) is None:
                return None
            if self._claimed is not None:
                return self._claimed
        return None

    def _claim(self, frames: list[Any]) -> bool:
        """Under the channel's lock: whether a message is a batch, and if so the batch,
        decoded into ``_claimed``. A stream's batch is registered for its STOPs here, while
        the main thread cannot read: a STOP it read right behind the batch, before the
        batch was registered, would be taken for one of a batch already done and dropped."""
        if not _is_batch(frames):
            return False
        received_s = time.monotonic()
        self._router.heard(received_s)
        try:
            kind, header, bufs = p.unpack(frames)
            self._claimed = self._job(header, bufs, received_s)
        except (p.ProtocolError, KeyError, ValueError, TypeError) as exc:
            self._bad_log.log(logging.WARNING, "dropped a malformed batch from the "
                              "broker: %s", str(exc)[:300])
        return True

    def _job(self, header: dict[str, Any], bufs: Any, received_s: float) -> Job:
        batch = p.decode_batch(header, bufs)
        # the budget is relative; turn it into our own clock's deadline on receipt
        start_by = received_s + batch.timeout_ms / 1000.0 \
            if batch.timeout_ms > 0 else float("inf")
        loaded = self.models.get((batch.model, batch.version))
        if loaded is not None and loaded.config.decoupled:
            with self._stops_lock:
                self._stops[batch.batch_id] = set()
        return batch, start_by, int(received_s * 1e9)

    def _run(self, job: Job) -> None:
        batch, start_by, received_ns = job
        taken_ns = time.monotonic_ns()
        self._busy_since = time.monotonic()
        loaded = self.models.get((batch.model, batch.version))
        if self._busy_since >= start_by:
            self.m_expired.inc(len(batch.items))
            result = p.BatchResult(batch.batch_id, [], 0.0, expired=True,
                                   error="deadline exceeded before the batch could start")
        elif loaded is None:
            result = p.BatchResult(batch.batch_id, [], 0.0, retry=True, error=(
                f"model {batch.model}/{batch.version} is not loaded on "
                f"worker {self.worker_id}"))
        elif loaded.config.max_sequences:
            self._table(loaded).join(batch, taken_ns, received_ns)   # at the next step boundary
            self._handed = True   # the main thread reads meanwhile (STOPs, joins)
            self._channel.wake_main()
            return
        elif loaded.calls_models:
            # it may wait on models this very worker runs: off the compute thread
            self._callers.run(loaded, batch, start_by, taken_ns)
            self._settle()
            return
        else:
            units = batching.units(loaded, batch.items)
            if loaded.config.decoupled or self._long(batch, units):
                # the main thread reads meanwhile: at once, so that what the broker sends
                # behind it (a stream's STOPs, the next batches with their deadlines)
                # is read when it comes
                self._handed = True
                self._channel.wake_main()
            result = self._execute(loaded, batch)
            if not loaded.config.decoupled:
                self._last_run[(batch.model, batch.version)] = (result.compute_ms / 1e3, units)
        self._finish(batch, result, taken_ns)
        self._settle()
        del loaded, result  # hold no version between batches: unloads free it

    def _settle(self) -> None:
        """The compute thread is idle after a batch, or steps sequences on."""
        self._handed = bool(self._tables)
        self._busy_since = time.monotonic() if self._tables else None

    def _table(self, loaded: LoadedModel) -> SequenceTable:
        table = self._tables.get(id(loaded))
        if table is None:
            table = self._tables[id(loaded)] = SequenceTable(
                loaded, functools.partial(self._send_step, loaded), self._finish,
                self._stopped, self._seq_ids, self._take_pauses,
                self._sequence_spans if self.spans is not None else None)
        return table

    def _send_step(self, loaded: LoadedModel, parts: list[p.Partial]) -> None:
        """A step's responses: one STEPS where the broker reads it (its LOAD said so),
        else a PARTIAL per batch."""
        if len(parts) > 1 and loaded.extra.get("steps"):
            for i in range(0, len(parts), p.MAX_BUNDLE):
                self._send_result(p.encode_steps(parts[i:i + p.MAX_BUNDLE]))
            return
        for part in parts:
            self._send_result(p.encode_partial(part))

    def _step(self) -> bool:
        """One step of every iterative model with sequences; a table with none left
        goes (it holds its version). False when no table had a sequence to step."""
        stepped = False
        for key, table in list(self._tables.items()):
            name = table.loaded.name
            if table.step():
                stepped = True
                self.m_steps.labels(name).inc()
            self.m_sequences.labels(name).set(table.running)
            self.m_paused.labels(name).set(table.paused)
            if not table.busy:
                del self._tables[key]
        if not self._tables:
            self._settle()
        return stepped

    def _execute(self, loaded: LoadedModel, batch: p.Batch) -> p.BatchResult:
        """Run a batch (on the compute thread, or a caller thread: workers/callers.py)."""
        if loaded.config.decoupled:
            result = streaming.run_stream(
                loaded, batch, lambda part: self._send_result(p.encode_partial(part)),
                lambda: self._stopped(batch.batch_id))
        else:
            result = batching.run(loaded, batch)
        self.m_compute.labels(batch.model).observe(result.compute_ms / 1000.0)
        return result

    def _finish(self, batch: p.Batch, result: p.BatchResult, taken_ns: int) -> None:
        """Send a batch's result (from the thread that ran it), then its spans."""
        if self._stops:
            with self._stops_lock:
                self._stops.pop(batch.batch_id, None)
                self._pauses.pop(batch.batch_id, None)
        done_ns = time.monotonic_ns()
        self._send_result(p.encode_result(result))
        if self.spans is not None and batch.trace is not None:   # after the answer
            self._emit_spans(batch, result, taken_ns, done_ns)

    def _send_result(self, frames: list[Any]) -> None:
        """From the compute thread or a caller thread."""
        off_compute = threading.current_thread() is not self._thread
        if not self._channel.send_result(frames, off_compute):
            logger.debug("result not sent: the socket is closed (we are exiting)")

    def _waiting(self, batch_id: int) -> None:
        """From a caller thread: the batch waits on the models it called."""
        self._channel.send(p.encode(p.Waiting(batch_id)))

    def _emit_spans(self, batch: p.Batch, result: p.BatchResult, taken_ns: int,
                    done_ns: int) -> None:
        try:
            self.spans.emit(batch, result, taken_ns, done_ns)
        except Exception as exc:  # tracing must never stop the compute thread
            self._bad_log.log(logging.WARNING, "batch %d's spans not emitted: %s",
                              batch.batch_id, exc)

    def _sequence_spans(self, batch: p.Batch, timelines: Any) -> None:
        try:
            self.spans.sequences(batch, timelines)
        except Exception as exc:  # tracing must never stop the compute thread
            self._bad_log.log(logging.WARNING, "batch %d's sequence spans not emitted: %s",
                              batch.batch_id, exc)

    def _long(self, batch: p.Batch, units: float) -> bool:
        """Whether a batch may run past TAKEOVER_S: its version has not run here yet, or
        its last batch, scaled to this one's units (rows x length), took more than half
        of it. One that runs long all the same is found by the main thread within a
        heartbeat."""
        last = self._last_run.get((batch.model, batch.version))
        if last is None:
            return True
        seconds, last_units = last
        return seconds * units / max(1.0, last_units) > TAKEOVER_S / 2

    def _stopped(self, batch_id: int) -> frozenset[str]:
        with self._stops_lock:
            return frozenset(self._stops.get(batch_id, ()))

    def _take_pauses(self, batch_id: int) -> dict[str, int]:
        """A batch's items to pause received since the last call (each applies once),
        with when each PAUSE was read."""
        if not self._pauses:
            return {}
        with self._stops_lock:
            return self._pauses.pop(batch_id, {})
