"""The worker pool: membership, credits, heartbeats, what each worker loads, holds and
retires, and the one place that sends anything to a worker; beside it, the batches in
flight on each worker (:class:`Batches`). The two are the one writer of
:class:`WorkerState`: the lifecycle, swaps, placement and the control verbs read a worker
and ask their verbs (``begin_load``, ``loaded``, ``failed``, ``retire``, ``heard``,
``beat``, ``keep``, ``send_batch``, ``finish``...).

It decides nothing about requests: when a worker is lost it hands back that
worker's in-flight batches, and the request path decides what each request gets.
"""

from __future__ import annotations

import enum
import itertools
import logging
import math
from dataclasses import dataclass
from typing import AbstractSet, Any, Callable, Iterable, Mapping, Sequence

from msgspec.structs import replace

from zeroserve.broker import protocol as p
from zeroserve.broker.server.scheduler import Entry
from zeroserve.broker.server.types import Clock, ModelVersion, ReadOnly, Send, earliest

logger = logging.getLogger(__name__)


class Loss(enum.Enum):
    """How a worker was lost, which decides what its in-flight requests get."""

    CRASHED = "its connection closed (the process died)"
    REREGISTERED = "it registered again (it restarted)"
    SILENT = "its heartbeats stopped"
    HUNG = "a batch ran past max_execution_ms"
    UNREACHABLE = "a send to it failed"
    LEFT = "it left"


@dataclass
class Inflight:
    """A batch sent to a worker and not yet answered."""

    batch_id: int
    worker: bytes
    model: str
    version: int
    entries: dict[str, Entry]
    samples: int
    reason: str
    sent_s: float
    exec_deadline_s: float = math.inf
    stream: bool = False   # a decoupled model's: its responses come as PARTIAL messages
    started_s: float = math.inf   # when the worker is taken to have begun it (it runs its
                                  # batches in order: when the one before it returned)
    units: float = 0.0   # what the latency model prices it by: rows x the longest scale


class WorkerState:
    """One worker as the broker sees it. Everyone reads it; only its :class:`WorkerPool`
    changes it, through the pool's verbs (its fields are private to this module, which
    ``tests/test_layout.py`` checks)."""

    __slots__ = ("_identity", "_worker_id", "_credits", "_info", "_last_seen_s",
                 "_loading", "_load_errors", "_inflight", "_waiting", "_draining", "_stalled",
                 "_exiting", "_recycle", "_metrics_text", "_memory", "_loaded", "_versions",
                 "_load_s", "_sequences")

    def __init__(self, identity: bytes, worker_id: str, credits: int, last_seen_s: float,
                 info: dict[str, Any]) -> None:
        self._identity = identity
        self._worker_id = worker_id
        self._credits = credits
        self._info = info
        self._last_seen_s = last_seen_s
        self._loading: set[ModelVersion] = set()
        self._load_errors: dict[ModelVersion, str] = {}
        self._inflight: list[int] = []   # batch ids, in the order sent
        # batches that left the worker's compute thread to wait on models they called
        # (workers/bls.py): still ours to answer, but they hold no credit
        self._waiting: set[int] = set()
        self._draining = False
        self._stalled = False   # its running batch overran far past its prediction
        self._exiting = False
        self._recycle = False
        self._metrics_text = ""
        self._memory: dict[str, Any] = {}
        # ``holds`` is asked for every worker several times a request, so what it holds
        # is kept by model too
        self._loaded: set[ModelVersion] = set()
        self._versions: dict[str, set[int]] = {}
        # the seconds the worker spent loading each version it holds, as it said: what a
        # load costs it (the broker's own measure adds the wait before and after)
        self._load_s: dict[ModelVersion, float] = {}
        # batches of iterative models whose requests run as sequences there: they hold
        # sequence slots (counted by their open requests), not a credit
        self._sequences: set[int] = set()

    def __repr__(self) -> str:
        return f"WorkerState({self._worker_id!r})"

    identity: ReadOnly[bytes] = ReadOnly()
    worker_id: ReadOnly[str] = ReadOnly()
    credits: ReadOnly[int] = ReadOnly()
    info: ReadOnly[Mapping[str, Any]] = ReadOnly()
    last_seen_s: ReadOnly[float] = ReadOnly()
    loaded: ReadOnly[AbstractSet[ModelVersion]] = ReadOnly()
    loading: ReadOnly[AbstractSet[ModelVersion]] = ReadOnly()
    load_errors: ReadOnly[Mapping[ModelVersion, str]] = ReadOnly()
    load_s: ReadOnly[Mapping[ModelVersion, float]] = ReadOnly()
    inflight: ReadOnly[Sequence[int]] = ReadOnly()
    waiting: ReadOnly[AbstractSet[int]] = ReadOnly()
    sequences: ReadOnly[AbstractSet[int]] = ReadOnly()
    draining: ReadOnly[bool] = ReadOnly()
    stalled: ReadOnly[bool] = ReadOnly()
    exiting: ReadOnly[bool] = ReadOnly()
    recycle: ReadOnly[bool] = ReadOnly()
    metrics_text: ReadOnly[str] = ReadOnly()
    memory: ReadOnly[Mapping[str, Any]] = ReadOnly()

    @property
    def free(self) -> int:
        return 0 if self._draining or self._stalled else self._credits - len(self._inflight)

    @property
    def on_cpu(self) -> bool:
        """Its models run on host cores (device ``cpu``), not on an accelerator."""
        return str(self._info.get("device", "")).startswith("cpu")

    def holds(self, model: str, version: int | None = None) -> bool:
        versions = self._versions.get(model)
        if versions is None:
            return False
        return version is None or version in versions

    def versions_of(self, model: str) -> set[int]:
        return set(self._versions.get(model, ()))

    def describe(self, now: float) -> dict[str, Any]:
        return {
            "id": self._worker_id,
            "state": "draining" if self._draining else "stalled" if self._stalled else "ready",
            "credits": self._credits,
            "inflight_batches": len(self._inflight),
            "waiting_batches": len(self._waiting),
            "sequence_batches": len(self._sequences),
            "models": sorted(str(k) for k in self._loaded),
            "loading": sorted(str(k) for k in self._loading),
            "load_errors": {str(k): e for k, e in self._load_errors.items()},
            "last_seen_s": round(now - self._last_seen_s, 3),
            "memory": self._memory,
            **{k: v for k, v in self._info.items()
               if k in ("pid", "host", "device", "protocol_versions")},
        }


class Batches:
    """The batches in flight: sent, answered, waiting on the models their handler called,
    queued behind a running one on their worker, stalled. The one writer of a worker's
    batch fields (its queue, its waiting and running sequences, stalled); ``changes``
    counts what may have freed room (a batch answered)."""

    def __init__(self, send: Send, clock: Clock) -> None:
        self._send = send
        self._clock = clock
        self.inflight: dict[int, Inflight] = {}
        self._owners: dict[int, WorkerState] = {}
        # workers with a batch queued behind another, kept so that what the request path
        # asks every tick does not grow with the workers
        self._stacked: dict[bytes, WorkerState] = {}
        self._batch_ids = itertools.count(1)
        self.changes = 0

    def _pop(self, batch_id: int) -> Inflight:
        self._owners.pop(batch_id, None)
        return self.inflight.pop(batch_id)

    def take(self, worker: WorkerState) -> list[Inflight]:
        """A worker removed: its in-flight batches, oldest first, no longer ours."""
        self._stacked.pop(worker.identity, None)
        lost = [self._pop(b) for b in (*worker.inflight, *worker.waiting,
                                       *sorted(worker.sequences)) if b in self.inflight]
        worker._inflight = []
        worker._waiting = set()
        worker._sequences = set()
        return lost

    def send_batch(self, worker: WorkerState, model: str, version: int,
                   entries: list[Entry], items: list[p.BatchItem], reason: str, now: float,
                   exec_s: float, stream: bool = False,
                   trace: p.BatchTrace | None = None,
                   callers: Sequence[p.Caller] | None = None,
                   sequences: bool = False) -> Inflight | None:
        """Send a batch; None (and the worker is unreachable) if the send failed.
        ``sequences``: an iterative model's, whose requests join the worker's running
        sequences: it holds their slots rather than a credit, and starts at once."""
        batch_id = next(self._batch_ids)
        rows, scale, tightest = 0, -math.inf if entries else 1.0, math.inf
        for e in entries:   # one pass: min, max and sum over generators cost us each here
            rows += e.samples
            scale = e.scale if e.scale > scale else scale
            tightest = e.deadline_s if e.deadline_s < tightest else tightest
        rec = Inflight(batch_id, worker.identity, model, version,
                       {it.request_id: e for it, e in zip(items, entries)}, rows, reason, now,
                       now + exec_s if exec_s > 0 else math.inf, stream,
                       math.inf if worker.inflight and not sequences else now,
                       rows * scale)   # its units: every row at the longest scale (padding)
        frames = p.encode_batch(p.Batch(batch_id, model, version, items,
                                        (tightest - now) * 1000.0 if tightest < math.inf else 0,
                                        trace, callers))
        if not self._send(worker.identity, frames):
            return None
        self.inflight[batch_id] = rec
        self._owners[batch_id] = worker
        if sequences:
            worker._sequences.add(batch_id)
            return rec
        worker._inflight.append(batch_id)
        if len(worker.inflight) > 1:
            self._stacked[worker.identity] = worker
        return rec

    def finish(self, batch_id: int) -> Inflight | None:
        """The in-flight record of an answered batch, or None if it is no longer ours
        (its worker was lost, or it timed out): a late answer is then dropped."""
        rec = self.inflight.pop(batch_id, None)
        if rec is not None:
            worker = self._owners.pop(batch_id, None)
            if worker is not None:
                worker._waiting.discard(batch_id)
                if batch_id in worker.sequences:
                    worker._sequences.discard(batch_id)
                    self.changes += 1
                self._off_queue(worker, batch_id)
        return rec

    def _off_queue(self, worker: WorkerState, batch_id: int) -> None:
        """A batch no longer holds its place in the worker's queue (it was answered, or
        it waits on models it called)."""
        if batch_id in worker.inflight:
            self.changes += 1
            was_head = worker.inflight[0] == batch_id
            worker._inflight.remove(batch_id)
            if len(worker.inflight) < 2:
                self._stacked.pop(worker.identity, None)
            if was_head:
                worker._stalled = False
                if worker.inflight:
                    self.inflight[worker.inflight[0]].started_s = self._clock()

    def waits(self, worker: WorkerState, batch_id: int) -> None:
        """A batch on ``worker`` waits on models its handler called: it gives its credit
        back until its result, so the models it waits on can run there too."""
        rec = self.inflight.get(batch_id)
        if rec is None or rec.worker != worker.identity or batch_id not in worker.inflight:
            return   # answered already, or not this worker's
        self._off_queue(worker, batch_id)
        worker._waiting.add(batch_id)

    def progressed(self, batch_id: int, now: float, exec_s: float) -> Inflight | None:
        """A stream's batch sent a response: ``max_execution_ms`` bounds the time between
        its responses, not the whole stream (a generation may rightly run for minutes).
        Returns its record, or None when it is no longer ours."""
        rec = self.inflight.get(batch_id)
        if rec is not None and exec_s > 0:
            rec.exec_deadline_s = now + exec_s
        return rec

    def stop(self, identity: bytes, batch_id: int, items: list[str], pause: bool = False) -> bool:
        """Tell a worker that these items of a running stream batch are answered (or pause)."""
        return self._send(identity, p.encode((p.Pause if pause else p.Stop)(batch_id, items)))

    def stalled(self, now: float, limit_s: Callable[[WorkerState, Inflight], float]
                ) -> list[tuple[WorkerState, list[Inflight]]]:
        """Workers whose running batch has run past ``limit_s`` of it, with the batches
        queued behind it taken back (the worker has not started them): they move at
        once instead of waiting out the hung one's max_execution_ms. Such a worker gets
        nothing more until that batch returns."""
        out = []
        for w in list(self._stacked.values()):
            if w.stalled:
                continue
            head = self.inflight[w.inflight[0]]
            if now - head.started_s > limit_s(w, head):
                w._stalled = True
                behind = [self._pop(b) for b in w.inflight[1:]]
                del w._inflight[1:]
                del self._stacked[w.identity]
                out.append((w, behind))
        return out

    def next_stall(self, limit_s: Callable[[WorkerState, Inflight], float]) -> float | None:
        return min((head.started_s + limit_s(w, head) for w in self._stacked.values() if not
                    w.stalled and (head := self.inflight[w.inflight[0]]).started_s < math.inf),
                   default=None) if self._stacked else None   # asked every turn, mostly empty

    def overdue(self, now: float) -> list[Inflight]:
        return [r for r in self.inflight.values() if r.exec_deadline_s <= now] \
            if self.inflight else []   # every turn: a comprehension costs ~1 us here

    def next_exec_deadline(self) -> float | None:
        return earliest([r.exec_deadline_s for r in self.inflight.values()]) \
            if self.inflight else None

    def busy(self) -> set[tuple[bytes, str, int]]:
        return {(r.worker, r.model, r.version) for r in self.inflight.values()}

    def busy_models(self, worker: WorkerState) -> set[str]:
        return {self.inflight[b].model for b in worker.inflight if b in self.inflight}

    def running_sequences(self, worker: WorkerState, model: str) -> int:
        """The requests of ``model`` running as sequences on ``worker`` (open ones: a
        final part or a stop frees the slot)."""
        return sum(len(rec.entries) for b in worker.sequences
                   if (rec := self.inflight[b]).model == model)


class WorkerPool:
    def __init__(self, send: Send, clock: Clock, *, heartbeat_s: float = 0.5,
                 expiry_s: float = 2.0, batches: Batches | None = None) -> None:
        self._send = send
        self._clock = clock
        self.heartbeat_s = heartbeat_s
        self.expiry_s = expiry_s
        self.workers: dict[bytes, WorkerState] = {}
        # the batches in flight: a test's pool makes its own, the broker's is handed in
        self._batches = batches if batches is not None else Batches(send, clock)
        # what the request path asks every tick or every request, kept so that its cost
        # does not grow with the workers: holders by model (dropped whenever a worker
        # joins, leaves, loads or unloads), and workers leaving
        self._holders: dict[tuple[str, int | None], list[WorkerState]] = {}
        self._leaving: dict[bytes, WorkerState] = {}
        self._changes = 0   # see :attr:`changes`
        self._retiring: list[tuple[bytes, ModelVersion]] = []   # out of routing, unloaded idle
        self.log_settings: dict[str, Any] = {}   # what /v2/logging changed, for joiners too

    # -- membership ---------------------------------------------------------
    def register(self, identity: bytes, ready: p.WorkerReady, now: float) -> WorkerState:
        self._holders.clear()
        self._changes += 1
        worker = WorkerState(identity, ready.worker_id or identity.decode(errors="replace"),
                             max(1, min(ready.credits, 64)), now,
                             {"pid": ready.pid, "host": ready.host, "device": ready.device,
                              "memory_budget_bytes": ready.memory_budget_bytes,
                              "protocol_versions": sorted(set(ready.versions))})
        for m, v in ready.models:
            self._hold(worker, ModelVersion(str(m), int(v)))
        worker._memory = dict(ready.memory)   # the memory planner's inputs until a heartbeat
        self.workers[identity] = worker
        if self.log_settings:  # a worker that joins later logs as the others do
            self._send(identity, p.encode(p.LogSettings(dict(self.log_settings))))
        logger.info("worker %s ready (pid %s, %s, %d credits)", worker.worker_id, ready.pid,
                    ready.device, worker.credits)
        return worker

    @staticmethod
    def speaks(worker: WorkerState, version: int) -> bool:
        """Whether a worker reads messages of protocol ``version`` (its READY said so): a
        kind newer than version 1 goes only to a worker that does."""
        return version in worker.info.get("protocol_versions", (1,))

    def get(self, identity: bytes) -> WorkerState | None:
        return self.workers.get(identity)

    def by_id(self, worker_id: str) -> WorkerState | None:
        return next((w for w in self.workers.values() if w.worker_id == worker_id), None)

    @property
    def changes(self) -> int:
        """Bumped whenever what a worker holds, runs or reports may have freed room (a
        batch answered, a load ended, a model dropped, a memory report, a worker come,
        gone or drained): load on demand retries the models that wait for room only then
        or when a time it knows comes, not on every request of every tick."""
        return self._changes + self._batches.changes

    @property
    def batches(self) -> Batches:
        """The batches in flight on these workers (a test's harness hands them on)."""
        return self._batches

    @property
    def inflight(self) -> Mapping[int, Inflight]:
        """Every batch in flight, by id (read-only: :class:`Batches` writes it)."""
        return self._batches.inflight

    def busy_models(self, worker: WorkerState) -> set[str]:
        return self._batches.busy_models(worker)

    def census(self) -> dict[str, int]:
        return {"pool.inflight": len(self._batches.inflight),
                "pool.worker_batches": sum(len(w.inflight) for w in self.workers.values()),
                "pool.worker_sequences": sum(len(w.sequences) for w in self.workers.values())}

    def holders(self, model: str, version: int | None = None) -> list[WorkerState]:
        """The workers that hold the model (that version); the caller must not change
        the list."""
        key = (model, version)
        got = self._holders.get(key)
        if got is None:
            got = self._holders[key] = [w for w in self.workers.values()
                                        if w.holds(model, version)]
        return got

    def free_holder(self, model: str) -> WorkerState | None:
        """The least busy worker with a free credit that holds the model; the first idle
        one at once (none can be less busy)."""
        best = None
        for w in self.holders(model):
            if w.free > 0:
                if not w._inflight:
                    return w
                if best is None or len(w._inflight) < len(best._inflight):
                    best = w
        return best

    def sequence_holder(self, model: str, most: int) -> tuple[WorkerState | None, int]:
        """The worker holding an iterative ``model`` with the most free sequence slots of
        ``most``, and how many; (None, 0) when every slot is taken."""
        best, free = None, 0
        for w in self.holders(model):
            if w.draining or w.stalled:
                continue
            left = most - self._batches.running_sequences(w, model)
            if left > free:
                best, free = w, left
        return best, free

    def named(self, worker_id: str) -> WorkerState:
        worker = self.by_id(worker_id)
        if worker is None:
            known = ", ".join(sorted(w.worker_id for w in self.workers.values()))
            raise LookupError(f"unknown worker {worker_id!r} (known: {known or 'none'})")
        return worker

    def set_draining(self, worker_id: str, draining: bool) -> WorkerState:
        """Stop (or resume) sending new batches to a worker; its in-flight ones finish."""
        worker = self.named(worker_id)
        if not draining and worker.exiting:
            raise LookupError(f"worker {worker_id!r} is leaving and cannot be undrained")
        worker._draining = draining
        self._changes += 1
        logger.info("worker %s %s", worker_id, "drained" if draining else "undrained")
        return worker

    def leave(self, worker: WorkerState, recycle: bool = False) -> None:
        """The worker drains, then exits once nothing of ours runs on it (see drained)."""
        worker._draining = worker._exiting = True
        self._changes += 1
        worker._recycle = worker._recycle or recycle
        self._leaving[worker.identity] = worker

    def keep(self, worker: WorkerState) -> None:
        """A leaving worker takes batches again until the broker's queue is done (the
        whole server stops, and it was signalled with the broker)."""
        worker._draining = False
        self._changes += 1

    def drain_leavers(self) -> None:
        """The workers kept by :meth:`keep` drain again (``undrain --all``)."""
        for worker in self.workers.values():
            worker._draining = worker._draining or worker._exiting
        self._changes += 1

    def heard(self, worker: WorkerState, now: float) -> None:
        """Any message from the worker: it is alive now."""
        worker._last_seen_s = now

    def beat(self, worker: WorkerState, beat: p.WorkerHeartbeat) -> None:
        """A heartbeat's report: its metrics text and its memory."""
        worker._metrics_text, worker._memory = beat.metrics, beat.memory
        self._changes += 1

    def remove(self, worker: WorkerState, loss: Loss, quiet: bool = False) -> list[Inflight]:
        """Forget a worker; returns its in-flight batches, oldest first."""
        if self.workers.pop(worker.identity, None) is None:
            return []
        self._holders.clear()
        self._leaving.pop(worker.identity, None)
        self._changes += 1
        if not quiet:
            logger.warning("worker %s removed: %s", worker.worker_id, loss.value)
        return self._batches.take(worker)

    # -- messages to workers ----------------------------------------------------
    def load(self, worker: WorkerState, msg: p.LoadModel) -> None:
        worker._loading.add(ModelVersion(msg.model, msg.version))
        # the worker learns from it what it may send back (a handler's WAITING: version 3)
        self._send(worker.identity,
                   p.encode(replace(msg, versions=list(p.SUPPORTED_VERSIONS))))

    def unload(self, worker: WorkerState, model: str, version: int) -> None:
        self._drop(worker, ModelVersion(model, version))
        self._send(worker.identity, p.encode(p.UnloadModel(model, version)))

    # -- what a worker loads, holds and retires ---------------------------------
    def begin_load(self, worker: WorkerState, key: ModelVersion) -> None:
        """Seen as loading from now on, its last failure forgotten, before the LOAD is
        sent (an operator's reload waits on the outcome from this moment)."""
        worker._loading.add(key)
        worker._load_errors.pop(key, None)

    def end_load(self, worker: WorkerState, key: ModelVersion) -> None:
        """No longer loading, and nothing learned: a trial load's answer, or a reload
        given up before its LOAD was sent."""
        worker._loading.discard(key)
        self._changes += 1

    def loaded(self, worker: WorkerState, key: ModelVersion, load_s: float = 0.0) -> None:
        """The worker loaded it (in ``load_s``, by its clock): it holds it (routable
        where the catalog serves it)."""
        worker._loading.discard(key)
        worker._load_errors.pop(key, None)
        worker._load_s[key] = load_s
        self._hold(worker, key)

    def failed(self, worker: WorkerState, key: ModelVersion, error: str) -> None:
        """The worker did not load it (or loaded other files): why, for status."""
        worker._loading.discard(key)
        worker._load_errors[key] = error
        self._changes += 1

    def retire(self, worker: WorkerState, key: ModelVersion) -> None:
        """No new batches to it on this worker; unloaded once idle (:meth:`take_idle`)."""
        self._drop(worker, key)
        self._retiring.append((worker.identity, key))

    def unretire(self, worker: WorkerState, key: ModelVersion) -> bool:
        """Loaded again before it went: whether it was retiring (unload it first)."""
        if (worker.identity, key) not in self._retiring:
            return False
        self._retiring.remove((worker.identity, key))
        return True

    @property
    def retiring(self) -> Sequence[tuple[bytes, ModelVersion]]:
        return self._retiring

    def take_idle(self) -> list[tuple[WorkerState, ModelVersion]]:
        """The retiring versions with nothing in flight, no longer retiring, on the
        workers still here."""
        busy = self._batches.busy()
        idle = [(i, k) for i, k in self._retiring if (i, k.name, k.version) not in busy]
        self._retiring = [(i, k) for i, k in self._retiring
                          if (i, k.name, k.version) in busy]
        return [(w, k) for i, k in idle if (w := self.workers.get(i)) is not None]

    def _hold(self, worker: WorkerState, key: ModelVersion) -> None:
        worker._loaded.add(key)
        worker._versions.setdefault(key.name, set()).add(key.version)
        self._holders.clear()
        self._changes += 1

    def _drop(self, worker: WorkerState, key: ModelVersion) -> None:
        worker._loaded.discard(key)
        worker._load_s.pop(key, None)
        versions = worker._versions.get(key.name)
        if versions is not None:
            versions.discard(key.version)
            if not versions:
                del worker._versions[key.name]
        self._holders.clear()
        self._changes += 1

    def set_log_settings(self, update: dict[str, Any]) -> None:
        """The logging extension's changes, to every worker now and to later joiners."""
        self.log_settings.update(update)
        frames = p.encode(p.LogSettings(dict(update)))
        for worker in self.workers.values():
            self._send(worker.identity, frames)

    def disconnect(self, identity: bytes, reason: p.DisconnectReason,
                   restart: bool = False, detail: str = "") -> None:
        self._send(identity, p.encode(p.Disconnect(reason, restart, detail)))

    def alive(self, worker: WorkerState, now: float) -> bool:
        """Heard from within the expiry: its connection is live, whatever says otherwise."""
        return now - worker.last_seen_s < self.expiry_s

    def heartbeat(self, now: float) -> list[WorkerState]:
        """Heartbeat every worker; returns the ones that fell silent (not yet removed)."""
        silent = [w for w in self.workers.values() if now - w.last_seen_s > self.expiry_s]
        frames = p.encode(p.BrokerHeartbeat(self.heartbeat_s, self.expiry_s))
        for worker in self.workers.values():
            if worker not in silent:
                self._send(worker.identity, frames)
        return silent

    def drained(self) -> Iterable[WorkerState]:
        """Workers leaving with nothing of ours in flight: they may go now."""
        return [w for w in self._leaving.values()   # asked every turn: mostly none leave
                if not w.inflight and not w.waiting and not w.sequences] if self._leaving else []

    def release(self, worker: WorkerState) -> None:
        """A drained worker that is leaving: tell it to exit and forget it."""
        self.disconnect(worker.identity, p.DisconnectReason.DRAINED, restart=worker.recycle)
        logger.info("worker %s drained %s", worker.worker_id,
                    "to restart" if worker.recycle else "for shutdown")
        self.remove(worker, Loss.LEFT, quiet=True)
