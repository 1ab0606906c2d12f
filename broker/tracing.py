"""Trace context and timestamps shared by every process (torch-free).

A traced request carries the caller's W3C trace context on the wire
(``InferRequest.trace``: ``{"traceparent": ..., "tracestate": ...}``); a request
without one carries nothing, and nothing is timed beyond the usual stats. Each process
stamps its own moments on its host's monotonic clock (CLOCK_MONOTONIC, which every
process of one boot shares, containers included):

- the broker: ``REQUEST_START`` and ``QUEUE_START`` (its arrival: admission is
  immediate), ``REQUEST_END`` (the reply leaves);
- the worker: ``COMPUTE_START``, ``COMPUTE_INPUT_END`` (inputs assembled into tensors),
  ``COMPUTE_OUTPUT_START`` (the model returned), ``COMPUTE_END`` (outputs encoded);
- the front end: ``HTTP_RECV_START/END`` and ``HTTP_SEND_START/END`` (or gRPC's).

Each hop sends its stamps back with the answer, tagged with its boot id. Where the boot
ids agree the stamps are used as they are; where they differ (another host) the inner
interval is centred in the outer one the receiver measured (the worker's first to last
stamp within the broker's send and receipt of the batch; the broker's within the
client's send and receipt of the request), which keeps the order exact and errs by at
most half the difference between the two network legs.
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping, Sequence

from zeroserve.broker.runtime import hostname
from zeroserve.broker.traceconfig import TraceConfig, TraceConfigError

_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")
MAX_TRACESTATE = 512

BROKER_STAMPS = ("REQUEST_START", "QUEUE_START", "REQUEST_END")
WORKER_STAMPS = ("COMPUTE_START", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START", "COMPUTE_END")
# the order a request lives them in (front-end stamps around these)
CORE_ORDER = ("REQUEST_START", "QUEUE_START", *WORKER_STAMPS, "REQUEST_END")


class TraceContextError(ValueError):
    """A traceparent or tracestate that W3C Trace Context does not allow."""


def parse_traceparent(value: str) -> tuple[str, str, bool]:
    """(trace id, parent span id, sampled) of a W3C ``traceparent``."""
    m = _TRACEPARENT.match(value.strip().lower())
    if m is None:
        raise TraceContextError(f"traceparent {value[:80]!r} is not "
                                "'00-<32 hex trace id>-<16 hex span id>-<2 hex flags>'")
    version, trace_id, span_id, flags, rest = m.groups()
    if version == "ff" or (version == "00" and rest):
        raise TraceContextError(f"traceparent {value[:80]!r}: version {version} with "
                                f"{'extra fields' if rest else 'an invalid version'}")
    if trace_id == "0" * 32 or span_id == "0" * 16:
        raise TraceContextError(f"traceparent {value[:80]!r}: an all-zero id is invalid")
    return trace_id, span_id, bool(int(flags, 16) & 1)


def context(traceparent: str, tracestate: str = "") -> dict[str, str]:
    """The wire's trace field for a caller's context (validated)."""
    parse_traceparent(traceparent)
    if len(tracestate) > MAX_TRACESTATE:
        raise TraceContextError(f"tracestate longer than {MAX_TRACESTATE} characters")
    out = {"traceparent": traceparent.strip().lower()}
    if tracestate:
        out["tracestate"] = tracestate.strip()
    return out


@lru_cache(maxsize=1)
def boot_id() -> str:
    """Which monotonic clock this process reads: one per boot of a kernel."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return f"host:{hostname()}"


def ns(seconds: float) -> int:
    return int(round(seconds * 1e9))


def aligned(stamps: Mapping[str, int], boot: str, outer_start_ns: int,
            outer_end_ns: int) -> dict[str, int]:
    """``stamps`` of a process whose clock is ``boot``, on this process's clock."""
    if boot == boot_id() or not stamps:
        return dict(stamps)
    first, last = min(stamps.values()), max(stamps.values())
    shift = (outer_start_ns + outer_end_ns) // 2 - (first + last) // 2
    return {k: v + shift for k, v in stamps.items()}


def worker_stamps(marks_s: Sequence[float]) -> dict[str, Any]:
    """A worker's batch result trace: its four marks (monotonic seconds) and its clock."""
    return {"boot": boot_id(), "ns": {k: ns(v) for k, v in zip(WORKER_STAMPS, marks_s)}}


def broker_stamps(arrival_s: float, sent_s: float, done_s: float,
                  worker: Mapping[str, Any] | None) -> dict[str, Any]:
    """A traced reply's trace: the broker's stamps and its worker's, on the broker's clock."""
    stamps = {"REQUEST_START": ns(arrival_s), "QUEUE_START": ns(arrival_s),
              "REQUEST_END": ns(done_s)}
    if worker and isinstance(worker.get("ns"), dict):
        raw = {k: int(v) for k, v in worker["ns"].items()
               if k in WORKER_STAMPS and isinstance(v, (int, float))}
        stamps.update(aligned(raw, str(worker.get("boot", "")), ns(sent_s), ns(done_s)))
    return {"boot": boot_id(), "ns": stamps}


def core_stamps(trace: Mapping[str, Any] | None, sent_ns: int, received_ns: int
                ) -> dict[str, int]:
    """The broker's and worker's stamps of a reply, on the caller's clock."""
    if not trace or not isinstance(trace.get("ns"), dict):
        return {}
    raw = {k: int(v) for k, v in trace["ns"].items()
           if k in CORE_ORDER and isinstance(v, (int, float))}
    return aligned(raw, str(trace.get("boot", "")), sent_ns, received_ns)


# -- Triton's JSON trace records ------------------------------------------------------
def records(trace_id: int, model: str, version: int, stamps: Mapping[str, int],
            request_id: str = "", traceparent: str = "",
            tensors: Sequence[tuple[str, str, str, Sequence[int], str]] = ()
            ) -> list[dict[str, Any]]:
    """One request's records as Triton writes them: its identity, then one record per
    timestamp in time order, then (TENSORS) one per tensor as ``(activity, name,
    datatype, shape, data)``. ``traceparent`` is zeroserve's addition, to find the
    request's trace in a tracing backend."""
    head: dict[str, Any] = {"id": trace_id, "model_name": model, "model_version": version}
    if request_id:
        head["request_id"] = request_id
    if traceparent:
        head["traceparent"] = traceparent
    out = [head]
    out += [{"id": trace_id, "timestamps": [{"name": name, "ns": value}]}
            for name, value in sorted(stamps.items(), key=lambda kv: kv[1])]
    out += [{"id": trace_id, "activity": activity,
             "tensor": {"name": name, "data": data, "shape": ",".join(map(str, shape)),
                        "dtype": dtype}}
            for activity, name, dtype, shape, data in tensors]
    return out


def tensor_data(values: Any) -> str:
    """A tensor's elements as Triton's TENSORS records write them: comma-separated."""
    flat = values.reshape(-1).tolist() if hasattr(values, "reshape") else list(values)
    return ",".join(repr(v) if isinstance(v, bytes) else str(v) for v in flat)


def require_otel(config: TraceConfig) -> None:
    """In opentelemetry mode, the SDK is importable; else a TraceConfigError that says
    how to install it (said at start, not at the first traced request)."""
    if config.mode != "opentelemetry":
        return
    try:
        from zeroserve.broker import otel  # noqa: F401 (the optional SDK, on demand)
    except ImportError as exc:
        if not (exc.name or "").startswith("opentelemetry"):
            raise
        raise TraceConfigError(
            "--trace-config mode=opentelemetry needs OpenTelemetry's SDK and its OTLP/HTTP "
            f"exporter: pip install 'zeroserve[otel]' ({exc.name} is missing)") from None
