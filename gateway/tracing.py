"""Triton's trace extension on the gateway side: this process's copy of the settings
(global and per model), the sampling decision, and Triton's JSON trace records written
to the trace file.

The broker holds the server's settings (broker/tracesettings.py, its ``trace_settings``
verbs); the gateway changes them there and samples by its copy (:class:`TraceSettings`),
which it replaces with the broker's after each change it makes, on each GET, and
whenever the broker's PONG names a version other than its copy's (gateway/facade.py), so
the hot path never asks the broker. Both front ends read the same copy: HTTP's
``/v2[/models/{m}]/trace/setting`` as Triton's JSON (:meth:`TraceSettings.get`), gRPC's
``TraceSetting`` as its map of string lists (:meth:`TraceSettings.get_lists`). A model's
setting holds only what was set for it; the rest follows the global setting, and JSON
``null`` (an empty list over gRPC) clears a field back to it.

Sampling (:meth:`Tracer.begin`): nothing is traced while the level is ``OFF``. A caller's
W3C ``traceparent`` decides for itself (parent-based: its sampled flag traces the
request, an unsampled one does not); without one, every ``trace_rate``-th request is
traced (0: none). ``trace_count`` caps both (-1: no cap). A traced request carries its
context to the broker and the worker (a fresh one when the caller sent none) and comes
back with their timestamps (broker/tracing.py), which :meth:`Tracer.finish` puts in
its record with the front end's own. In opentelemetry mode the rate is a ratio instead
(1/``trace_rate`` of the requests, by chance, or ``OTEL_TRACES_SAMPLER_ARG``'s), and a
traced request is the gateway's span (gateway/spans.py), whose context goes on the wire in
place of the caller's, so the workers' queue spans are its children (workers/spans.py).

Records are written as Triton does: with ``log_frequency`` N, every N traces to
``<trace_file>.<index>`` (index from 0); with 0, to ``<trace_file>`` when the setting is
replaced or the gateway stops; when ``trace_count`` runs out, what is left goes to the
next indexed file. The sampling state (requests seen, traces left) and the records are
each process's own; the file is this process's ``--trace-config`` one and, when several
share the port (``--reuse-port``), ``<trace_file>.<pid>`` instead.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import orjson

from zeroserve.broker import protocol as p, traceconfig, tracing
from zeroserve.broker.tracesettings import Setting, TraceSettingError, TraceState, parse_config
from zeroserve.broker.tracing import TraceContextError

if TYPE_CHECKING:
    from zeroserve.gateway.spans import GatewaySpans

__all__ = ["Setting", "Trace", "TraceSettingError", "TraceSettings", "Tracer", "for_gateway",
           "from_lists",
           "parse_config"]

logger = logging.getLogger(__name__)


class _Files:
    """The trace files of a process, shared by every setting that names one (as Triton
    shares them): one index sequence per file; the plain file gathers every flush."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {}
        self.plain: dict[str, list[bytes]] = {}

    def write(self, file: str, chunks: list[bytes], indexed: bool) -> None:
        if indexed:
            n = self.index[file] = self.index.get(file, -1) + 1
            path = f"{file}.{n}"
        else:
            path = file
            chunks = self.plain.setdefault(file, []) + chunks
            self.plain[file] = chunks
        # whole or not at all: a reader never sees a file half written
        folder, name = os.path.split(path)
        tmp = os.path.join(folder, f".{name}.tmp")
        try:
            with open(tmp, "wb") as out:
                out.write(b"[" + b",".join(chunks) + b"]")
            os.replace(tmp, path)
        except OSError as exc:
            logger.error("trace file %s not written: %s", path, exc)


class _Sampler:
    """One setting's state, as Triton keeps it per setting object: requests seen, traces
    left, records not yet written."""

    def __init__(self, setting: Setting, file: str, files: _Files, by_ratio: bool) -> None:
        self.setting, self.file, self.files = setting, file, files
        # opentelemetry mode: requests without a deciding parent traced by chance (the
        # ratio of OpenTelemetry's samplers), not every rate-th one (Triton's)
        self.chance = setting.chance() if by_ratio else None
        self.seen = 0
        self.left = setting.count
        self.pending: list[bytes] = []

    def take(self, parent: bool | None) -> bool:
        s = self.setting
        if not s.level or self.left == 0:
            return False
        if parent is not None and s.parent_based:
            if not parent:
                return False
        elif self.chance is not None:
            if self.chance < 1.0 and random.random() >= self.chance:
                return False
        else:   # no caller context: the rate decides
            if s.rate == 0:
                return False
            self.seen += 1
            if self.seen % s.rate:
                return False
        if self.left > 0:
            self.left -= 1
        return True

    def add(self, records: list[dict[str, Any]]) -> None:
        self.pending.append(b",".join(orjson.dumps(r) for r in records))
        s = self.setting
        if self.left == 0 or (s.log_frequency and len(self.pending) >= s.log_frequency):
            self.flush(indexed=True)

    def flush(self, indexed: bool) -> None:
        chunks, self.pending = self.pending, []
        if chunks and self.file:
            self.files.write(self.file, chunks, indexed)


class TraceSettings:
    """This process's copy of the trace settings (a :class:`TraceState`: the broker's,
    once it has answered, else its own from ``--trace-config``) and, per entry, the
    sampling state and records, which are this process's own."""

    def __init__(self, setting: Setting | None = None, mode: str = "triton",
                 file_suffix: str = "") -> None:
        self.mode = mode
        self.file_suffix = file_suffix
        self.file = (setting or Setting()).file   # this process's, whatever the broker's
        self._files = _Files()
        self._samplers: dict[str, _Sampler] = {}
        self._keys: dict[str, tuple[int, int]] = {}
        self.state = TraceState.start(setting or Setting())
        self.active = False
        self.load(self.state)

    @property
    def version(self) -> int:
        return self.state.version

    def load(self, state: TraceState) -> None:
        """Sample by ``state`` from now on: an entry it replaced starts afresh (what its
        old sampler holds goes to the file), the others keep counting."""
        state = state.with_file(self.file)
        keys = {name: state.key(name) for name in ("", *state.models)}
        for name in list(self._samplers):
            if keys.get(name) != self._keys.get(name):
                self._retire(name)
        self.state = state
        for name in keys:
            if name not in self._samplers:
                self._samplers[name] = self._sampler(state.effective(name))
        self._keys = keys
        self.active = state.active

    def _sampler(self, setting: Setting) -> _Sampler:
        return _Sampler(setting, setting.file + self.file_suffix if setting.file else "",
                        self._files, self.mode == "opentelemetry")

    def effective(self, model: str | None) -> Setting:
        return self.state.effective(model)

    def sampler(self, model: str) -> _Sampler:
        return self._samplers.get(model) or self._samplers[""]

    def get(self, model: str | None = None) -> dict[str, Any]:
        s = self.effective(model)
        return {"trace_level": list(s.level) or ["OFF"], "trace_rate": str(s.rate),
                "trace_count": str(self.sampler(model or "").left),
                "log_frequency": str(s.log_frequency), "trace_file": s.file,
                "trace_mode": self.mode}

    def update(self, model: str | None, changes: Mapping[str, Any]) -> dict[str, Any]:
        """Triton's POST body applied to this copy alone (TraceState.updated)."""
        self.load(self.state.updated(model, changes))
        logger.info("trace setting%s now %s", f" of {model}" if model else "",
                    self.get(model))
        return self.get(model)

    def get_lists(self, model: str | None = None) -> dict[str, list[str]]:
        """The setting as gRPC's TraceSettingResponse holds it: a list of strings each."""
        return {k: v if isinstance(v, list) else [v] for k, v in self.get(model).items()}

    def update_lists(self, model: str | None, changes: Mapping[str, Sequence[str]]
                     ) -> dict[str, list[str]]:
        """gRPC's TraceSettingRequest applied to this copy alone."""
        self.update(model, from_lists(changes))
        return self.get_lists(model)

    def _retire(self, key: str) -> None:
        old = self._samplers.pop(key, None)
        if old is not None:
            old.flush(indexed=old.setting.log_frequency != 0)

    def close(self) -> None:
        for key in list(self._samplers):
            self._retire(key)


def from_lists(changes: Mapping[str, Sequence[str]]) -> dict[str, Any]:
    """gRPC's TraceSettingRequest as Triton's JSON body: an empty list clears the field."""
    return {k: None if not v else list(v) if k == "trace_level" else v[0]
            for k, v in changes.items()}


@dataclass
class Trace:
    """One traced request on its way through the front end."""

    trace_id: int
    model: str
    context: dict[str, str]
    sampler: _Sampler
    stamps: dict[str, int]
    caller: bool               # the caller sent the traceparent
    span: Any = None           # opentelemetry mode: the gateway's span (gateway/spans.py)

    def stamp(self, name: str) -> None:
        self.stamps[name] = time.monotonic_ns()

    @property
    def tensors(self) -> bool:
        return "TENSORS" in self.sampler.setting.level


class Tracer:
    """The gateway process's tracing: settings, sampling, and Triton's records or (in
    opentelemetry mode, ``spans``) the gateway's spans."""

    def __init__(self, settings: TraceSettings, spans: GatewaySpans | None = None) -> None:
        self.settings = settings
        self.spans = spans
        self._ids = itertools.count(1)

    @property
    def active(self) -> bool:
        return self.settings.active

    def begin(self, model: str, traceparent: str | None, tracestate: str | None = None,
              first_stamp: str = "HTTP_RECV_START") -> Trace | None:
        """A Trace if this request is to be traced (stamped ``first_stamp`` now), else None."""
        sampler = self.settings.sampler(model)
        parent: bool | None = None
        ctx: dict[str, str] | None = None
        if traceparent:
            try:
                ctx = tracing.context(traceparent, tracestate or "")
                parent = tracing.parse_traceparent(traceparent)[2]
            except TraceContextError as exc:   # W3C: an invalid parent starts a new trace
                logger.debug("ignoring the caller's trace context: %s", exc)
        if not sampler.take(parent):
            return None
        now_ns = time.monotonic_ns()
        span = None
        if self.spans is not None:   # the gateway's span, child of the caller's
            span, ctx = self.spans.start(
                model, ctx, now_ns, "http" if first_stamp.startswith("HTTP") else "grpc")
        elif ctx is None:
            ctx = {"traceparent": f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"}
        return Trace(next(self._ids), model, ctx, sampler, {first_stamp: now_ns},
                     parent is not None, span)

    def begin_stream(self, model: str, traceparent: str | None, tracestate: str | None,
                     first_stamp: str) -> Trace | None:
        """As :meth:`begin`, for a stream's request: traced in opentelemetry mode only
        (a Triton record needs the stamps of one reply; a stream's parts carry none)."""
        if self.spans is None or not self.active:
            return None
        return self.begin(model, traceparent, tracestate, first_stamp)

    def finish_stream(self, trace: Trace, error: str = "") -> None:
        """The end of a traced stream (its last part sent, or its error)."""
        self.finish(trace, None, 0, 0, error=error)

    def finish(self, trace: Trace, reply: p.InferReply | None, sent_ns: int,
               received_ns: int, request_id: str = "",
               inputs: Sequence[p.Tensor] = (), outputs: Sequence[p.Tensor] = (),
               error: str = "") -> None:
        """Write the request's records, or end its span (with the broker's and worker's
        stamps of ``reply``, when it succeeded)."""
        stamps = dict(trace.stamps)
        version = 0
        if reply is not None:
            stamps.update(tracing.core_stamps(reply.trace, sent_ns, received_ns))
            version = reply.version
        steps = reply.trace.get("steps") if reply is not None and reply.trace else None
        steps = steps if isinstance(steps, list) else []
        if self.spans is not None and trace.span is not None:
            self.spans.end(trace.span, stamps, version, request_id, error, [
                (str(s.get("model", "")), int(s.get("version", 0)),
                 tracing.core_stamps(s, sent_ns, received_ns)) for s in steps])
            return
        tensors = []
        if trace.tensors:
            tensors = [("TENSOR_QUEUE_INPUT", *_tensor(t)) for t in inputs] + \
                [("TENSOR_BACKEND_OUTPUT", *_tensor(t)) for t in outputs]
        trace.sampler.add(tracing.records(trace.trace_id, trace.model, version, stamps,
                                          request_id, trace.context["traceparent"], tensors))
        for step in steps:
            # an ensemble's step, as Triton writes a composing model's: its own id and
            # its ensemble's as parent_id
            step_id = next(self._ids)
            found = tracing.records(step_id, str(step.get("model", "")),
                                    int(step.get("version", 0)),
                                    tracing.core_stamps(step, sent_ns, received_ns))
            found[0]["parent_id"] = trace.trace_id
            trace.sampler.add(found)

    def close(self) -> None:
        self.settings.close()
        if self.spans is not None:
            self.spans.close()


def _tensor(t: p.Tensor) -> tuple[str, str, list[int], str]:
    meta = t.meta
    if meta.datatype in ("FP16", "BF16"):   # as Triton: left out of the text
        return meta.name, meta.datatype, list(meta.shape), ""
    return meta.name, meta.datatype, list(meta.shape), tracing.tensor_data(p.to_numpy(t))


def for_gateway(entries: Iterable[str] | None, reuse_port: bool) -> Tracer:
    setting, mode = parse_config(entries or ())
    settings = TraceSettings(setting, mode, f".{os.getpid()}" if reuse_port else "")
    if mode != "opentelemetry":
        return Tracer(settings)
    config = traceconfig.parse_trace_config(entries or ())
    tracing.require_otel(config)
    from zeroserve.gateway.spans import GatewaySpans   # the optional SDK, in this mode only

    return Tracer(settings, GatewaySpans(config.otel))
