"""Triton's trace extension on the gateway side: the settings (global and per model),
the sampling decision, and Triton's JSON trace records written to the trace file.

The settings object is the one both front ends use: HTTP's ``/v2[/models/{m}]/trace/
setting`` calls :meth:`TraceSettings.get` and :meth:`TraceSettings.update` with Triton's
JSON; gRPC's ``TraceSetting`` calls :meth:`TraceSettings.get_lists` and
:meth:`TraceSettings.update_lists` with its map of string lists. A model's setting
holds only what was set for it; the rest follows the global setting, and JSON ``null``
(an empty list over gRPC) clears a field back to it.

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
next indexed file. Each gateway process keeps its own settings and, when several share
the port (``--reuse-port``), writes ``<trace_file>.<pid>`` instead.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import secrets
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import orjson

from zeroserve.broker import protocol as p, traceconfig, tracing
from zeroserve.broker.tracing import TraceContextError

if TYPE_CHECKING:
    from zeroserve.gateway.spans import GatewaySpans

logger = logging.getLogger(__name__)

LEVELS = ("TIMESTAMPS", "TENSORS")
FIELDS = {"trace_level": "level", "trace_rate": "rate", "trace_count": "count",
          "log_frequency": "log_frequency", "trace_file": "file"}
U32 = (1 << 32) - 1


class TraceSettingError(ValueError):
    """A trace setting that does not validate; the message says which and why."""


@dataclass(frozen=True)
class Setting:
    level: tuple[str, ...] = ()      # () is OFF
    rate: int = 1000
    count: int = -1
    log_frequency: int = 0
    file: str = ""
    # opentelemetry mode: a ratio from OTEL_TRACES_SAMPLER_ARG (None: 1/rate), and
    # whether the caller's sampled flag decides (OTEL_TRACES_SAMPLER's parentbased_*)
    ratio: float | None = None
    parent_based: bool = True

    def chance(self) -> float:
        """The ratio of requests without a deciding parent traced in opentelemetry mode."""
        if self.ratio is not None:
            return self.ratio
        return 1.0 / self.rate if self.rate else 0.0


def _number(name: str, value: Any, low: int, high: int) -> int:
    text = str(value).strip() if isinstance(value, (str, int)) and \
        not isinstance(value, bool) else None
    try:
        number = int(text) if text is not None else None
    except ValueError:
        number = None
    if number is None:
        raise TraceSettingError(f"Unable to parse '{name}', got: {value}")
    if not low <= number <= high:
        raise TraceSettingError(f"Unable to parse '{name}', value is out of range "
                                f"[ {low}, {high} ], got: {value}")
    return number


def _levels(value: Any) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(v, str) for v in items):
        raise TraceSettingError("'trace_level' must be an array of strings")
    upper = [v.strip().upper() for v in items]
    if "OFF" in upper:
        if len(upper) != 1:
            raise TraceSettingError("Expect only one trace level 'OFF' is specified")
        return ()
    wrong = [v for v in upper if v not in LEVELS]
    if wrong:
        raise TraceSettingError(f"unknown trace level {wrong[0]!r}: one of OFF, TIMESTAMPS, "
                                "TENSORS")
    return tuple(lv for lv in LEVELS if lv in upper)


def parse_field(name: str, value: Any) -> Any:
    if name == "trace_level":
        return _levels(value)
    if name == "trace_rate":
        return _number(name, value, 0, U32)
    if name == "trace_count":
        return _number(name, value, -1, (1 << 31) - 1)
    if name == "log_frequency":
        return _number(name, value, 0, U32)
    raise TraceSettingError(f"unknown trace setting {name!r}: one of {', '.join(FIELDS)}")


def parse_config(entries: Iterable[str]) -> tuple[Setting, str]:
    """Triton's ``--trace-config`` entries as the front end reads them (broker/traceconfig.py
    parses them): ``rate=N``, ``level=L`` (repeatable), ``count=N``, ``mode=M``,
    ``triton,file=PATH``, ``triton,log-frequency=N``; in opentelemetry mode the
    ``OTEL_TRACES_SAMPLER`` and ``OTEL_TRACES_SAMPLER_ARG`` environment variables start
    the sampler where ``rate`` is not given."""
    try:
        config = traceconfig.parse_trace_config(entries)
    except traceconfig.TraceConfigError as exc:
        raise TraceSettingError(str(exc)) from None
    setting, levels = Setting(), list[str]()
    for key, value in config.front:
        if key == "level":
            levels.append(value)
        elif key == "file":
            setting = replace(setting, file=value)
        else:
            field = {"rate": "trace_rate", "count": "trace_count"}.get(key, "log_frequency")
            setting = replace(setting, **{FIELDS[field]: parse_field(field, value)})
    if levels:
        setting = replace(setting, level=_levels(levels))
    if config.mode == "opentelemetry":
        setting = _env_sampler(setting, any(k == "rate" for k, _ in config.front),
                               os.environ)
    return setting, config.mode


# OTEL_TRACES_SAMPLER's values: (the caller's sampled flag decides, ratio or None: the arg)
_SAMPLERS = {"parentbased_traceidratio": (True, None), "traceidratio": (False, None),
             "parentbased_always_on": (True, 1.0), "always_on": (False, 1.0),
             "parentbased_always_off": (True, 0.0), "always_off": (False, 0.0)}


def _env_sampler(setting: Setting, rate_given: bool, environ: Mapping[str, str]) -> Setting:
    name = environ.get("OTEL_TRACES_SAMPLER", "").strip().lower()
    arg = environ.get("OTEL_TRACES_SAMPLER_ARG", "").strip()
    if name and name not in _SAMPLERS:
        raise TraceSettingError(f"OTEL_TRACES_SAMPLER={name!r}: one of {', '.join(_SAMPLERS)}")
    parent_based, ratio = _SAMPLERS.get(name, (True, None))
    if ratio is None and arg:
        try:
            ratio = float(arg)
        except ValueError:
            ratio = -1.0
        if not 0.0 <= ratio <= 1.0:
            raise TraceSettingError(f"OTEL_TRACES_SAMPLER_ARG={arg!r}: a ratio in [0, 1]")
    if ratio is None and name:
        ratio = 1.0   # the SDK's default arg for a ratio sampler
    setting = replace(setting, parent_based=parent_based)
    if ratio is None or rate_given:   # the flag wins over the environment
        return setting
    return replace(setting, ratio=ratio, rate=round(1 / ratio) if ratio else 0)


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
    """The global trace setting and each model's, in Triton's JSON."""

    def __init__(self, setting: Setting | None = None, mode: str = "triton",
                 file_suffix: str = "") -> None:
        self.mode = mode
        self.file_suffix = file_suffix
        self._global = setting or Setting()
        self._models: dict[str, dict[str, Any]] = {}
        self._files = _Files()
        self._samplers: dict[str, _Sampler] = {"": self._sampler(self._global)}
        self.active = bool(self._global.level)

    def _sampler(self, setting: Setting) -> _Sampler:
        return _Sampler(setting, setting.file + self.file_suffix if setting.file else "",
                        self._files, self.mode == "opentelemetry")

    def effective(self, model: str | None) -> Setting:
        own = self._models.get(model or "")
        return replace(self._global, **own) if own else self._global

    def sampler(self, model: str) -> _Sampler:
        return self._samplers.get(model) or self._samplers[""]

    def get(self, model: str | None = None) -> dict[str, Any]:
        s = self.effective(model)
        return {"trace_level": list(s.level) or ["OFF"], "trace_rate": str(s.rate),
                "trace_count": str(self.sampler(model or "").left),
                "log_frequency": str(s.log_frequency), "trace_file": s.file,
                "trace_mode": self.mode}

    def update(self, model: str | None, changes: Mapping[str, Any]) -> dict[str, Any]:
        """Triton's POST body: each named field set, JSON null clearing a model's field
        back to the global one (on the global setting, back to the default)."""
        if not isinstance(changes, Mapping):
            raise TraceSettingError("the body must be a JSON object of trace settings")
        if "trace_file" in changes:
            raise TraceSettingError("trace file location can not be updated through "
                                    "network protocol")
        unknown = [k for k in changes if k not in FIELDS]
        if unknown:
            raise TraceSettingError(f"unknown trace setting {unknown[0]!r}: one of "
                                    f"{', '.join(FIELDS)}")
        parsed = {FIELDS[k]: None if v is None else parse_field(k, v)
                  for k, v in changes.items()}
        if "rate" in parsed:   # a rate set or cleared replaces OTEL_TRACES_SAMPLER_ARG's
            parsed["ratio"] = None
        if model:
            own = dict(self._models.get(model, {}))
            for key, value in parsed.items():
                if value is None:
                    own.pop(key, None)
                else:
                    own[key] = value
            if "rate" in own:   # its own rate, not the global OTEL_TRACES_SAMPLER_ARG
                own["ratio"] = None
            self._retire(model)
            if own:
                self._models[model] = own
                self._samplers[model] = self._sampler(self.effective(model))
            else:
                self._models.pop(model, None)
        else:
            default = Setting()
            self._global = replace(self._global, **{
                k: getattr(default, k) if v is None else v for k, v in parsed.items()})
            self._retire("")
            self._samplers[""] = self._sampler(self._global)
            for name in self._models:   # their unset fields follow the global ones
                self._retire(name)
                self._samplers[name] = self._sampler(self.effective(name))
        self.active = bool(self._global.level) or any(
            self.effective(m).level for m in self._models)
        logger.info("trace setting%s now %s", f" of {model}" if model else "",
                    self.get(model))
        return self.get(model)

    def get_lists(self, model: str | None = None) -> dict[str, list[str]]:
        """The setting as gRPC's TraceSettingResponse holds it: a list of strings each."""
        return {k: v if isinstance(v, list) else [v] for k, v in self.get(model).items()}

    def update_lists(self, model: str | None, changes: Mapping[str, Sequence[str]]
                     ) -> dict[str, list[str]]:
        """gRPC's TraceSettingRequest: an empty list clears the field."""
        doc = {k: None if not v else list(v) if k == "trace_level" else v[0]
               for k, v in changes.items()}
        self.update(model, doc)
        return self.get_lists(model)

    def _retire(self, key: str) -> None:
        old = self._samplers.pop(key, None)
        if old is not None:
            old.flush(indexed=old.setting.log_frequency != 0)

    def close(self) -> None:
        for key in list(self._samplers):
            self._retire(key)


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
        if self.spans is not None and trace.span is not None:
            self.spans.end(trace.span, stamps, version, request_id, error)
            return
        tensors = []
        if trace.tensors:
            tensors = [("TENSOR_QUEUE_INPUT", *_tensor(t)) for t in inputs] + \
                [("TENSOR_BACKEND_OUTPUT", *_tensor(t)) for t in outputs]
        trace.sampler.add(tracing.records(trace.trace_id, trace.model, version, stamps,
                                          request_id, trace.context["traceparent"], tensors))

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
