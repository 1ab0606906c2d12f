"""``--trace-config`` as every traced component reads it: the gateway its sampling
settings (gateway/tracing.py), the gateway and the workers the mode and, in
opentelemetry mode, where and how their spans are exported (broker/otel.py)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Iterable

MODES = ("triton", "opentelemetry")
# the keys the front end reads (gateway/tracing.py); a worker checks their names only
FRONT_KEYS = ("rate", "level", "count", "file", "log-frequency")
OTEL_DEFAULT_URL = "http://localhost:4318/v1/traces"   # OTLP/HTTP's, and Triton's


@dataclass(frozen=True)
class OtelConfig:
    """Triton's ``opentelemetry,KEY=VALUE`` settings; None leaves a value to the SDK's
    ``OTEL_*`` environment variables and defaults."""

    url: str | None = None
    resource: tuple[tuple[str, str], ...] = ()
    bsp_max_queue_size: int | None = None
    bsp_schedule_delay_ms: int | None = None
    bsp_max_export_batch_size: int | None = None


@dataclass(frozen=True)
class TraceConfig:
    mode: str = "triton"
    front: tuple[tuple[str, str], ...] = ()   # (key, value) of the front end's settings
    otel: OtelConfig = OtelConfig()


class TraceConfigError(ValueError):
    """A --trace-config entry that does not parse; the message quotes it."""


_BSP = {"bsp_max_queue_size": "bsp_max_queue_size",
        "bsp_schedule_delay": "bsp_schedule_delay_ms",
        "bsp_max_export_batch_size": "bsp_max_export_batch_size"}


def parse_trace_config(entries: Iterable[str]) -> TraceConfig:
    """Triton's ``--trace-config`` entries: ``[triton,]KEY=VALUE`` for the front end's
    settings, ``mode=triton|opentelemetry``, ``opentelemetry,url=HOST:PORT/PATH``,
    ``opentelemetry,resource=KEY=VALUE`` (repeatable) and the batch span processor's
    ``opentelemetry,bsp_max_queue_size|bsp_schedule_delay|bsp_max_export_batch_size=N``."""
    mode, front, otel = "triton", list[tuple[str, str]](), OtelConfig()
    for entry in entries:
        scope, sep, rest = entry.partition(",")
        if not sep or "=" in scope:   # no mode named: a value may hold a comma
            scope, rest = "", entry
        key, sep, value = rest.partition("=")
        key = key.strip()
        if not sep:
            raise TraceConfigError(f"--trace-config {entry!r}: expected [mode,]setting=value")
        if scope == "opentelemetry":
            otel = _otel_setting(entry, otel, key, value.strip())
            continue
        if scope not in ("", "triton"):
            raise TraceConfigError(f"--trace-config {entry!r}: trace mode {scope!r} is not "
                                   f"supported (one of {', '.join(MODES)})")
        key = key.replace("_", "-")
        if key == "mode":
            if value not in MODES:
                raise TraceConfigError(f"--trace-config {entry!r}: mode must be one of "
                                       f"{', '.join(MODES)}")
            mode = value
        elif key in FRONT_KEYS:
            front.append((key, value))
        else:
            raise TraceConfigError(f"--trace-config {entry!r}: unknown setting {key!r}")
    return TraceConfig(mode, tuple(front), otel)


def _otel_setting(entry: str, otel: OtelConfig, key: str, value: str) -> OtelConfig:
    if key == "url":
        return replace(otel, url=value if "://" in value else f"http://{value}")
    if key == "resource":
        name, sep, attr = value.partition("=")
        if not sep or not name.strip():
            raise TraceConfigError(f"--trace-config {entry!r}: expected "
                                   "opentelemetry,resource=KEY=VALUE")
        return replace(otel, resource=(*otel.resource, (name.strip(), attr.strip())))
    if key in _BSP:
        if not value.isdigit() or int(value) <= 0:
            raise TraceConfigError(f"--trace-config {entry!r}: {key} must be a positive "
                                   "integer")
        sizes: dict[str, Any] = {_BSP[key]: int(value)}
        return replace(otel, **sizes)
    raise TraceConfigError(f"--trace-config {entry!r}: unknown opentelemetry setting {key!r}"
                           f" (one of url, resource, {', '.join(_BSP)})")
