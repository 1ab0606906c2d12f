"""Triton's trace settings (the global one and each model's) in their validated form,
torch-free and stdlib-only so that the broker, which holds the server's one copy (its
``trace_settings`` verbs, broker/server/extverbs.py), and each gateway, which samples
by a copy of it (gateway/tracing.py), read and change them with the same code.

A :class:`TraceState` is immutable: a change makes a new one with a new ``version``,
which the broker's PONG carries so that a gateway sees, within a ping, that its copy is
old. Versions start at random, so a restarted broker's never match a copy of the last
one's. Each entry (``""`` for the global setting, else a model's) also carries the
version that last replaced it, so a gateway restarts the sampling state (requests seen,
traces left) of exactly the entries a change replaced, as Triton does.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Iterable, Mapping

from zeroserve.broker import traceconfig

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
            name = {"rate": "trace_rate", "count": "trace_count"}.get(key, "log_frequency")
            setting = replace(setting, **{FIELDS[name]: parse_field(name, value)})
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


def parse_changes(changes: Any) -> dict[str, Any]:
    """Triton's POST body, checked: each named field parsed, None (JSON null) kept."""
    if not isinstance(changes, Mapping):
        raise TraceSettingError("the body must be a JSON object of trace settings")
    if "trace_file" in changes:
        raise TraceSettingError("trace file location can not be updated through "
                                "network protocol")
    unknown = [k for k in changes if k not in FIELDS]
    if unknown:
        raise TraceSettingError(f"unknown trace setting {unknown[0]!r}: one of "
                                f"{', '.join(FIELDS)}")
    parsed = {FIELDS[k]: None if v is None else parse_field(k, v) for k, v in changes.items()}
    if "rate" in parsed:   # a rate set or cleared replaces OTEL_TRACES_SAMPLER_ARG's
        parsed["ratio"] = None
    return parsed


def new_version() -> int:
    return secrets.randbits(52)


@dataclass(frozen=True)
class TraceState:
    """The global setting, each model's own fields (the rest follow the global), and the
    versions: of the whole, and of each entry's last change (``revisions``)."""

    base: Setting = Setting()
    models: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    version: int = 0
    revisions: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def start(cls, setting: Setting) -> TraceState:
        version = new_version()
        return cls(setting, {}, version, {"": version})

    def effective(self, model: str | None) -> Setting:
        own = self.models.get(model or "")
        return replace(self.base, **own) if own else self.base

    def key(self, model: str) -> tuple[int, int]:
        """Changes when the entry's effective setting was last replaced (a model's
        follows the global one's too)."""
        return self.revisions.get("", 0), self.revisions.get(model, 0) if model else 0

    @property
    def active(self) -> bool:
        return bool(self.base.level) or any(self.effective(m).level for m in self.models)

    def updated(self, model: str | None, changes: Any) -> TraceState:
        """Triton's POST body applied: each named field set, JSON null clearing a model's
        field back to the global one (on the global setting, back to the default)."""
        parsed = parse_changes(changes)
        version = self.version + 1
        models, revisions = dict(self.models), dict(self.revisions)
        if model:
            own = dict(self.models.get(model, {}))
            for name, value in parsed.items():
                if value is None:
                    own.pop(name, None)
                else:
                    own[name] = value
            if "rate" in own:   # its own rate, not the global OTEL_TRACES_SAMPLER_ARG
                own["ratio"] = None
            if own:
                models[model] = own
                revisions[model] = version
            else:
                models.pop(model, None)
                revisions.pop(model, None)
            return TraceState(self.base, models, version, revisions)
        default = Setting()
        base = replace(self.base, **{
            k: getattr(default, k) if v is None else v for k, v in parsed.items()})
        revisions[""] = version
        return TraceState(base, models, version, revisions)

    def with_file(self, file: str) -> TraceState:
        return self if self.base.file == file else replace(self, base=replace(self.base,
                                                                               file=file))

    def to_doc(self) -> dict[str, Any]:
        """As the ``trace_settings`` verbs answer it (msgpack: lists for tuples)."""
        def plain(fields: Mapping[str, Any]) -> dict[str, Any]:
            return {k: list(v) if k == "level" else v for k, v in fields.items()}
        return {"version": self.version, "global": plain(asdict(self.base)),
                "models": {m: plain(own) for m, own in self.models.items()},
                "revisions": dict(self.revisions)}

    @classmethod
    def from_doc(cls, doc: Any) -> TraceState:
        """The broker's answer back; TraceSettingError if it is not one."""
        known = set(asdict(Setting()))

        def fields(raw: Any) -> dict[str, Any]:
            if not isinstance(raw, dict) or not set(raw) <= known:
                raise TraceSettingError(f"not a trace setting: {raw!r}"[:200])
            return {k: tuple(v) if k == "level" else v for k, v in raw.items()}
        try:
            models = {str(m): fields(own) for m, own in doc["models"].items()}
            return cls(Setting(**fields(doc["global"])), models, int(doc["version"]),
                       {str(k): int(v) for k, v in doc["revisions"].items()})
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise TraceSettingError(f"not the broker's trace settings: {exc}") from None
