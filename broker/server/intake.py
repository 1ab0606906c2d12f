"""The request path's door: a client's REQUEST, REQUESTS and CANCEL, and its going away.
A decoded request is admitted (admission.py) and queued, answered from the response
cache, started as a pipeline (pipeline.py), or refused at once; from here on it holds
a key in the answer ledger until its one answer."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import msgspec

from zeroserve.broker import protocol as p, tracing
from zeroserve.broker.server.admission import Admission, Cached
from zeroserve.broker.server.answering import Answering
from zeroserve.broker.server.breaker import Breakers, refusal
from zeroserve.broker.server.cachepath import CachedAnswers, Hit
from zeroserve.broker.server.catalog import Catalog
from zeroserve.broker.server.ledger import AnswerLedger, Key
from zeroserve.broker.server.pipeline import Pipelines
from zeroserve.broker.server.scheduler import Scheduler
from zeroserve.broker.server.stopping import StopState
from zeroserve.broker.server.streampath import StreamPath
from zeroserve.broker.server.streams import Streams
from zeroserve.broker.server.tenancy import Grant, Refusal, Tenancy
from zeroserve.broker.server.types import Send


class Intake:
    """Implements the pipelines' :class:`~zeroserve.broker.server.pipeline.Steps`: a
    pipeline's steps come in through :meth:`submit` like any request."""

    def __init__(self, catalog: Catalog, scheduler: Scheduler, ledger: AnswerLedger,
                 stop: StopState, breakers: Breakers, admission: Admission,
                 answers: CachedAnswers, pipelines: Pipelines, streams: Streams,
                 streaming: StreamPath, answering: Answering, tenancy: Tenancy, reply: Send,
                 clock: Callable[[], float]) -> None:
        self.catalog = catalog
        self.scheduler = scheduler
        self.ledger = ledger
        self.stop = stop
        self.breakers = breakers
        self.admission = admission
        self.answers = answers
        self.pipelines = pipelines
        self.streams = streams
        self.streaming = streaming
        self.answering = answering
        self.tenancy = tenancy
        self._reply = reply
        self.clock = clock

    def on_requests(self, client: bytes, header: dict[str, Any], bufs: Sequence[Any],
                    now: float) -> None:
        """A REQUESTS message: each request admitted as if it came alone. One without an
        id to answer does not stop the others; the first such is raised afterwards (the
        loop counts it as malformed)."""
        first: p.ProtocolError | None = None
        for sub, sub_bufs in p.unbundle(header, bufs, "requests"):
            try:
                self.on_request(client, sub, sub_bufs, now, bundled=True)
            except p.ProtocolError as exc:
                first = first or exc
        if first is not None:
            raise first

    def on_request(self, client: bytes, header: dict[str, Any], bufs: Sequence[Any],
                   now: float, bundled: bool = False) -> None:
        try:
            req = p.decode_request(header, bufs)
        except p.ProtocolError as exc:
            rid = p.request_id_of(header)
            if rid is None:
                raise  # nothing to answer: the loop counts it as a malformed message
            self.answering.refuse_ids(client, [rid], p.ErrorCode.BAD_INPUT, str(exc))
            return
        self.submit(client, req, now, bundled)

    def submit(self, client: bytes, req: p.InferRequest, now: float,
               bundled: bool = False) -> None:
        """A decoded request (a client's, or a pipeline's step) admitted or answered."""
        key = (client, req.request_id)
        if self.ledger.is_open(key):
            self.refuse(client, req.request_id, p.ErrorCode.BAD_INPUT,
                        "a request with this id is already in progress", model=req.model)
            return
        model = self.catalog.get(req.model)
        if model is not None and model.config.ensemble and self.stop.admits(client):
            refused = self.admission.admit_ensemble(req, model, now)
            if refused is not None:
                self.refuse(client, req.request_id, refused.code, refused.message, req.model)
            else:
                self.pipelines.start(client, req, model, now, self)
            return
        wait_s = self.breakers.admit(req.model, now)
        if wait_s is not None:
            held = [] if model is None else [v for v in model.ready if v not in model.failed]
            version = self.breakers.route(req.model, req.version, held)
            if version is None:
                self.refuse(client, req.request_id, p.ErrorCode.UNAVAILABLE,
                            refusal(req.model, wait_s), req.model, wait_s)
                return
            req = msgspec.structs.replace(req, version=version)   # a healthy one it holds
        entry = self.admission.admit(client, req, now)
        if isinstance(entry, Refusal):
            self.refuse(client, req.request_id, entry.code, entry.message, req.model,
                        entry.retry_after_s)
            return
        if isinstance(entry, Cached):
            self._answer_hit(client, key, entry.grant, entry.hit, now)
            return
        entry.payload.bundled = bundled
        self.ledger.admit(key, req.model)
        self.answering.queue(entry)

    def refuse(self, client: bytes, request_id: str, code: p.ErrorCode, message: str,
               model: str, retry_after_s: float | None = None) -> None:
        self.answering.refuse(client, request_id, code, message, model, retry_after_s)

    def _answer_hit(self, client: bytes, key: Key, grant: Grant, hit: Hit, now: float
                    ) -> None:
        """Answered from the response cache: never queued nor open, so this is its one
        answer; the tenant's in-flight place it took at the gate is given back."""
        req, answer = grant.request, hit.answer
        trace = None if req.trace is None else \
            tracing.broker_stamps(now, now, self.clock(), None)
        part = p.reply_part(req.request_id, req.model, answer.version, answer.tensors,
                            {"queue_ms": 0.0, "compute_ms": 0.0, "cache_hit": 1,
                             **grant.notes}, trace, self.catalog.build(req.model, answer.version))
        self.tenancy.release(key)
        self._reply(client, p.encode_reply_parts([part]))
        self.answers.answered(req.model, hit, max(0.0, self.clock() - now))

    def on_cancel(self, client: bytes, request_id: str) -> None:
        self._withdraw((client, request_id), "cancelled by the client")

    def client_gone(self, client: bytes) -> int:
        """A client's connection closed: its queued requests leave the queue (what is in
        flight finishes; its answer goes nowhere). Returns how many were withdrawn."""
        return sum(self._withdraw((client, rid), "the client went away")
                   for rid in self.ledger.ids_of(client))

    def _withdraw(self, key: Key, why: str) -> bool:
        """A queued request answered cancelled, a pipeline's steps withdrawn, or a running
        stream stopped at its worker; False when it is none of these (in flight)."""
        entry = self.scheduler.cancel(key)
        if entry is not None:
            self.answering.answer_error(entry, p.ErrorCode.CANCELLED, why)
            return True
        if self.pipelines and self.pipelines.cancel(key, why):
            return True
        return bool(self.streams) and \
            self.streaming.stop_stream(key, p.ErrorCode.CANCELLED, why)
