"""Ensembles run by the broker: a pipeline request becomes its steps' requests.

Each step is an ordinary request, with an internal id from the broker's own client
identity, in its model's queue: it carries the pipeline request's priority, its
remaining deadline and its API key (its tenant), and batches with every other caller
of that model. A step starts once every tensor it reads exists, so steps that do not
depend on each other run at the same time. Its answer comes back through the request
path's one reply function (:meth:`Pipelines.reply` sits in front of the socket): the
tensor frames stay in the broker and become the next steps' inputs.

The pipeline request holds a key in the answer ledger like every request, and is
answered once: by its outputs, or by the first step that fails, expires or loses its
worker (named in the message), or by the client's cancel; its steps still queued are
withdrawn then. A request whose critical path (the latency model of each step, the
queue ahead of the first ones) cannot finish before its deadline is refused before any
step runs, on the admission ladder of every request (admission.py).
"""

from __future__ import annotations

import itertools
import logging
import math
from typing import Any, Callable, Protocol, Sequence

from msgspec.structs import replace

from zeroserve.broker import protocol as p
from zeroserve.broker import tracing
from zeroserve.broker.server.admission import deadline_of, decoupled
from zeroserve.broker.server.catalog import Catalog, CatalogModel
from zeroserve.broker.server.ledger import AnswerLedger, Key
from zeroserve.broker.server.metrics import BrokerMetrics
from zeroserve.broker.server.pool import WorkerState
from zeroserve.broker.server.stats import ModelStatistics
from zeroserve.broker.server.swap import Placed
from zeroserve.broker.server.types import Send
from zeroserve.models import ensemble as ens
from zeroserve.models.repository import ModelConfig

logger = logging.getLogger(__name__)

# the broker's own identity as the client of the steps: ZeroMQ reserves identities that
# start with a zero byte for itself, and generates 5-byte ones, so no peer has this one
INTERNAL = b"\x00zeroserve-pipeline"


class Steps(Protocol):
    """What a pipeline asks of the request path (the intake's): ``submit`` a step, admitted
    as any request; withdraw a queued one (``on_cancel``); ``refuse`` a request that holds
    no place. Handed in with each pipeline request, so it is the path that admitted it."""

    def submit(self, client: bytes, req: p.InferRequest, now: float,
               bundled: bool = False) -> None: ...

    def on_cancel(self, client: bytes, request_id: str) -> None: ...

    def refuse(self, client: bytes, request_id: str, code: p.ErrorCode, message: str,
               model: str, retry_after_s: float | None = None) -> None: ...


class Run:
    """One pipeline request in progress."""

    __slots__ = ("key", "request", "config", "version", "tensors", "waiting", "running",
                 "arrival_s", "deadline_s", "compute_ms", "traces", "path")

    def __init__(self, key: Key, request: p.InferRequest, model: CatalogModel, version: int,
                 arrival_s: float, deadline_s: float, path: Steps) -> None:
        self.key = key
        self.request = request
        self.config = model.config   # as it was: a change of the ensemble mid-run moves no step
        self.version = version
        self.tensors: dict[str, p.Tensor] = {t.meta.name: t for t in request.tensors}
        self.waiting = list(range(len(model.config.ensemble)))   # steps not started
        self.running: dict[str, int] = {}                          # step request id -> step
        self.arrival_s = arrival_s
        self.deadline_s = deadline_s
        self.compute_ms = 0.0
        self.traces: list[dict[str, Any]] = []   # a traced pipeline's steps' stamps
        self.path = path

    @property
    def steps(self) -> tuple[ens.Step, ...]:
        return self.config.ensemble

    def where(self, i: int) -> str:
        return f"step {i} (model {self.steps[i].model_name!r}) of ensemble " \
               f"{self.config.name!r}"


class Pipelines:
    """The pipelines in progress; ``send`` is the socket's reply."""

    def __init__(self, catalog: Catalog, ledger: AnswerLedger, stats: ModelStatistics,
                 metrics: BrokerMetrics, send: Send, clock: Callable[[], float]) -> None:
        self.catalog = catalog
        self.ledger = ledger
        self.stats = stats
        self.metrics = metrics
        self._send = send
        self.clock = clock
        self._runs: dict[Key, Run] = {}
        self._steps: dict[str, Key] = {}     # a step's request id -> its pipeline
        self._ids = itertools.count(1)

    def __bool__(self) -> bool:
        return bool(self._runs)

    def census(self) -> dict[str, int]:
        return {"pipelines.runs": len(self._runs), "pipelines.steps": len(self._steps)}

    # -- the request path's reply, with the steps' answers taken out ------------------
    def reply(self, client: bytes, frames: list[Any]) -> bool:
        if client != INTERNAL:
            return self._send(client, frames)
        kind, header, bufs = p.unpack(frames)
        if kind is p.Kind.REPLY:
            rep = p.decode_reply(header, bufs)
            self._step_done(rep.request_id, rep, None)
        elif kind is p.Kind.REPLIES:   # a batch's steps, in one message
            for rep in p.decode_replies(header, bufs):
                self._step_done(rep.request_id, rep, None)
        elif kind is p.Kind.ERROR:
            err = p.decode_error(header)
            self._step_done(err.request_id, None, err)
        elif kind is p.Kind.PARTS:
            for part in p.decode_parts(header, bufs):
                self._step_part(part)
        else:   # nothing else is ever sent to the pipelines' identity
            logger.error("pipeline step answered with a %s message; dropped", kind.name)
        return True

    # -- intake -------------------------------------------------------------------
    def start(self, client: bytes, req: p.InferRequest, model: CatalogModel, now: float,
              path: Steps) -> None:
        """A request for an ensemble, admitted (admission.py): its first steps queued
        through ``path``, which takes its steps' answers back and its refusals."""
        key = (client, req.request_id)
        _, deadline = deadline_of(req, model.config, now)
        version = req.version if req.version is not None else model.default_version
        run = Run(key, req, model, version, now, deadline, path)
        self.ledger.admit(key, req.model)
        self._runs[key] = run
        self._advance(run, now)

    # -- steps --------------------------------------------------------------------
    def _advance(self, run: Run, now: float) -> None:
        """Queue every step whose inputs all exist."""
        ready = [i for i in run.waiting
                 if all(t in run.tensors for t in run.steps[i].reads())]
        for i in ready:
            run.waiting.remove(i)
        for i in ready:
            if run.key not in self._runs:
                return   # a step before this one was refused: the pipeline is answered
            left_ms = (run.deadline_s - now) * 1000.0
            if left_ms <= 0.0:
                self._fail(run, p.ErrorCode.DEADLINE, f"{run.where(i)}: deadline exceeded "
                           "before the step could start")
                return
            step = run.steps[i]
            rid = f"{next(self._ids)}/{i}"   # unique: the counter; the step: for logs
            run.running[rid] = i
            self._steps[rid] = run.key
            req = run.request
            tensors = [p.Tensor(replace(run.tensors[t].meta, name=name), run.tensors[t].data)
                       for name, t in step.input_map]
            run.path.submit(INTERNAL, p.InferRequest(
                request_id=rid, model=step.model_name, tensors=tensors,
                version=None if step.model_version < 0 else step.model_version,
                priority=req.priority, timeout_ms=left_ms if left_ms < math.inf else 0.0,
                api_key=req.api_key, stream=decoupled(self.catalog, step.model_name),
                trace=req.trace), now, True)   # bundled: a batch's answers come at once

    def _step_done(self, rid: str, rep: p.InferReply | None, err: p.ErrorReply | None
                   ) -> None:
        key = self._steps.pop(rid, None)
        run = self._runs.get(key) if key is not None else None
        if run is None:
            return   # its pipeline was answered already (a late step, a withdrawn one)
        i = run.running.pop(rid)
        if err is not None:
            self._fail(run, err.code, f"{run.where(i)} failed: {err.message}")
            return
        assert rep is not None
        got = {t.meta.name: t for t in rep.tensors}
        for name, tensor in run.steps[i].output_map:
            if name not in got:
                self._fail(run, p.ErrorCode.MODEL_ERROR, f"{run.where(i)} returned no "
                           f"output {name!r}")
                return
            run.tensors[tensor] = got[name]
        run.compute_ms += float(rep.stats.get("compute_ms", 0.0))
        if rep.trace is not None:   # the gateway writes one record per step, its parent's
            run.traces.append({**rep.trace, "model": rep.model, "version": rep.version})
        now = self.clock()
        if run.waiting:
            self._advance(run, now)
            if run.key in self._runs and not run.running:   # a graph load refuses
                self._fail(run, p.ErrorCode.INTERNAL, f"ensemble {run.config.name!r}"
                           " has steps whose inputs no step produces")
        elif not run.running:
            self._finish(run, now)

    def _step_part(self, part: p.StreamPart) -> None:
        """A response of the decoupled last step: one response of the pipeline's stream,
        its outputs renamed as the ensemble's; the final one answers the pipeline."""
        key = self._steps.get(part.request_id)
        run = self._runs.get(key) if key is not None else None
        if run is None:
            return
        i = run.running[part.request_id]
        names = dict(run.steps[i].output_map)
        wanted = set(run.request.outputs or [t.name for t in run.config.outputs])
        tensors = [p.Tensor(replace(t.meta, name=names[t.meta.name]), t.data)
                   for t in part.tensors
                   if t.meta.name in names and names[t.meta.name] in wanted]
        stats: dict[str, float] = {}
        if part.final:
            del self._steps[part.request_id]
            del run.running[part.request_id]
            self._runs.pop(run.key)
            for rid in list(run.running):   # a step read by none, still running: let go
                self._steps.pop(rid, None)
                run.path.on_cancel(INTERNAL, rid)
            if not self.ledger.close(run.key):
                return
            total_s = self.clock() - run.arrival_s
            cfg = run.config
            self.stats.batch_done(cfg.name, run.version, _samples(cfg.max_batch_size,
                                                                  run.request.tensors),
                                  {}, total_s * 1000.0)
            self.stats.request_done(cfg.name, run.version, 0.0, total_s, {}, total_s * 1000.0)
            self.metrics.requests_done(cfg.name, run.version, [total_s])
            stats = {"queue_ms": 0.0, "responses": float(part.index + 1)}
        self._send(run.key[0], p.encode_parts([p.StreamPart(
            run.request.request_id, run.config.name, run.version, part.index,
            part.final, tensors, stats)]))

    # -- answers -------------------------------------------------------------------
    def _finish(self, run: Run, now: float) -> None:
        del self._runs[run.key]
        if not self.ledger.close(run.key):
            return
        cfg, req = run.config, run.request
        wanted = req.outputs or [t.name for t in cfg.outputs]
        tensors = [p.Tensor(replace(run.tensors[n].meta, name=n), run.tensors[n].data)
                   for n in wanted]
        total_s = now - run.arrival_s
        trace = None if req.trace is None else \
            {**tracing.broker_stamps(run.arrival_s, run.arrival_s, now, None),
             "steps": run.traces}
        part = p.reply_part(req.request_id, cfg.name, run.version, tensors,
                            {"queue_ms": 0.0, "compute_ms": run.compute_ms}, trace)
        self._send(run.key[0], p.encode_reply_parts([part]))
        samples = _samples(cfg.max_batch_size, req.tensors)
        self.stats.batch_done(cfg.name, run.version, samples, {}, total_s * 1000.0)
        self.stats.request_done(cfg.name, run.version, 0.0, total_s, {}, total_s * 1000.0)
        self.metrics.requests_done(cfg.name, run.version, [total_s])

    def _fail(self, run: Run, code: p.ErrorCode, message: str) -> None:
        """The pipeline's one error answer; its queued steps leave their queues (those
        running finish, and their answers find no pipeline)."""
        self._runs.pop(run.key, None)
        for rid in list(run.running):
            self._steps.pop(rid, None)
        for rid in list(run.running):
            run.path.on_cancel(INTERNAL, rid)
        run.running.clear()
        if not self.ledger.close(run.key):
            return
        self.stats.request_failed(run.config.name, run.version,
                                  max(0.0, self.clock() - run.arrival_s))
        run.path.refuse(run.key[0], run.key[1], code, message, run.config.name)

    def cancel(self, key: Key, message: str) -> bool:
        """The client cancelled or went away: every step is withdrawn."""
        run = self._runs.get(key)
        if run is None:
            return False
        self._fail(run, p.ErrorCode.CANCELLED, message)
        return True

    def sync_ready(self) -> None:
        """An ensemble is ready while every step's model is (the catalog's verbs)."""
        for name, model in list(self.catalog.models.items()):
            steps = model.config.ensemble
            if not steps:
                continue
            if all((m := self.catalog.get(s.model_name)) is not None and m.ready
                   for s in steps):
                for v in model.versions:
                    if v not in model.ready:
                        self.catalog.mark_ready(name, v)
            elif model.ready:
                self.catalog.routable((), name)


class OnWorkers:
    """A placement strategy with the ensembles left out: the broker runs them, so none
    is ever loaded on a worker."""

    def __init__(self, placed: Placed) -> None:
        self._placed = placed

    def __call__(self, cfg: ModelConfig, worker: WorkerState) -> bool:
        return not cfg.ensemble and self._placed(cfg, worker)


def _samples(max_batch_size: int, tensors: Sequence[p.Tensor]) -> int:
    if max_batch_size <= 0 or not tensors or not tensors[0].meta.shape:
        return 1
    return int(tensors[0].meta.shape[0])
