"""A rollout plan (config.json's ``rollout``, or ``zeroserve rollout``'s options): the
canary's weight at each step, each step's dwell time, and the thresholds past which the
canary is rolled back; parsed and checked here, run by broker/server/rollout.py. Pure
and torch-free, so the repository's validation and the broker share one reading."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any


class PlanError(ValueError):
    """A plan that cannot run; the message says which field and why."""


@dataclass(frozen=True)
class Thresholds:
    min_requests: int = 50
    max_error_rate: float = 0.05
    min_errors: int = 5
    max_latency_ratio: float = 2.0
    latency_floor_ms: float = 5.0


@dataclass(frozen=True)
class Plan:
    """The canary's weight at each step (ascending, the last 100) and each step's
    dwell; the stable version gets the rest."""

    steps: tuple[int, ...] = (5, 25, 50, 100)
    dwell_s: float = 60.0
    thresholds: Thresholds = field(default_factory=Thresholds)
    # a request the canary fails runs again on the stable version (its one retry): the
    # error still counts against the canary, and the caller does not see it
    retry: bool = True

    def to_json(self) -> dict[str, Any]:
        return {"steps": list(self.steps), "dwell_s": self.dwell_s, "retry": self.retry,
                **{f.name: getattr(self.thresholds, f.name) for f in fields(Thresholds)}}


_INTS = {"min_requests", "min_errors"}
PLAN_FIELDS = ("steps", "dwell_s", "retry", *(f.name for f in fields(Thresholds)))


def parse_plan(raw: Any) -> Plan:
    """A plan from its JSON form (config.json's ``rollout``, the control verb's args);
    PlanError naming the field when it is wrong."""
    if not isinstance(raw, dict):
        raise PlanError('must be an object such as {"steps": [5, 25, 50, 100], "dwell_s": 60}')
    unknown = sorted(set(raw) - set(PLAN_FIELDS))
    if unknown:
        raise PlanError(f"unknown field {unknown[0]!r} (known: {', '.join(PLAN_FIELDS)})")
    steps = raw.get("steps", list(Plan.steps))
    if not isinstance(steps, list) or not steps or not all(
            isinstance(s, int) and not isinstance(s, bool) and 0 < s <= 100 for s in steps):
        raise PlanError(f"steps must be a list of weights in 1..100, got {steps!r}")
    if any(b <= a for a, b in zip(steps, steps[1:])):
        raise PlanError(f"steps must ascend, got {steps}")
    if steps[-1] != 100:
        raise PlanError(f"steps must end at 100 (the canary takes all the traffic), "
                        f"got {steps}")
    dwell_s = _number(raw, "dwell_s", Plan.dwell_s)
    retry = raw.get("retry", Plan.retry)
    if not isinstance(retry, bool):
        raise PlanError(f"retry must be true or false, got {retry!r}")
    kw: dict[str, Any] = {}
    for f in fields(Thresholds):
        if f.name in raw:
            value = _number(raw, f.name, 0.0)
            if f.name in _INTS:
                if value != int(value) or value < 1:
                    raise PlanError(f"{f.name} must be a positive integer, got {raw[f.name]!r}")
                value = int(value)
            kw[f.name] = value
    return Plan(tuple(steps), dwell_s, Thresholds(**kw), retry)


def _number(raw: dict[str, Any], name: str, default: float) -> float:
    value = raw.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value < 0:
        raise PlanError(f"{name} must be a number >= 0, got {value!r}")
    return float(value)
