"""A rollout's decisions, pure: a canary version takes a growing share of a model's
traffic, step by step, while the broker compares it with the stable version on the same
traffic; past a threshold it is rolled back at once, healthy through the last step it is
promoted. Nothing here reads a clock, a socket or the catalog: the counts and the time
come in (:meth:`Rollout.observe`, :meth:`Rollout.decide`), weights and verdicts go out,
and broker/server/releases.py applies them through the catalog's verbs.

The checks, on what the canary answered since the rollout began against what the stable
version answered over the same time:

- errors: the canary's error rate above the stable's by more than ``max_error_rate``,
  with at least ``min_errors`` errors (one unlucky request is not a verdict);
- latency: the canary's median compute time above ``max_latency_ratio`` times the
  stable's and above it by ``latency_floor_ms`` at least (both over their most recent
  samples; the p99s are reported beside). The median, not the p99: on a loaded host one
  stalled batch sets a small sample's p99, and must neither roll back a healthy canary
  nor hide a slow one behind a stalled stable version.

Neither check runs before the canary has answered ``min_requests`` requests, and a step
ends only after its dwell time *and* ``min_requests`` answers of the canary in it: a
canary that gets no traffic is not promoted for lack of evidence (the rollout is stuck,
which an alert reports).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

from zeroserve.models.rolloutplan import Plan, PlanError

SAMPLES = 1000   # latency samples kept per version: the p99 of the most recent


class Counts:
    """What one version answered: requests, errors, recent compute times."""

    __slots__ = ("requests", "errors", "samples")

    def __init__(self) -> None:
        self.requests = 0
        self.errors = 0
        self.samples: deque[float] = deque(maxlen=SAMPLES)

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    def quantiles_s(self) -> tuple[float, float] | None:
        """The median and p99 of the recent compute times (None without any)."""
        if not self.samples:
            return None
        ordered = sorted(self.samples)
        at = [min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))
              for q in (0.5, 0.99)]
        return ordered[at[0]], ordered[at[1]]

    def describe(self) -> dict[str, Any]:
        q = self.quantiles_s()
        return {"requests": self.requests, "errors": self.errors,
                "p50_ms": None if q is None else round(q[0] * 1000.0, 3),
                "p99_ms": None if q is None else round(q[1] * 1000.0, 3)}


@dataclass(frozen=True)
class Verdict:
    """What :meth:`Rollout.decide` asks: ``step`` (new weights), ``promote`` (the canary
    takes everything, the stable retires) or ``rollback`` (the canary to 0 at once, with
    ``reason``)."""

    action: str
    weights: dict[int, int]
    reason: str = ""


class Rollout:
    """One model's rollout of ``canary`` over ``stable``; time only comes in."""

    def __init__(self, canary: int, stable: int, plan: Plan, now: float) -> None:
        if canary == stable:
            raise PlanError("the canary and the stable version must differ")
        self.canary, self.stable, self.plan = canary, stable, plan
        self.step = 0
        self.started_s = self.step_started_s = now
        self.counts = {canary: Counts(), stable: Counts()}
        self.step_requests = 0    # the canary's answers in the current step
        self.outcome = ""        # "", promoted or rolled back

    @property
    def weights(self) -> dict[int, int]:
        share = self.plan.steps[self.step]
        return {self.canary: share, self.stable: 100 - share}

    def observe(self, version: int, requests: int, errors: int = 0,
                compute_s: float | None = None) -> None:
        """``requests`` answered by ``version``, ``errors`` of them failed; a batch's
        compute time counts once for each request it answered."""
        counts = self.counts.get(version)
        if counts is None or self.outcome:
            return
        counts.requests += requests
        counts.errors += errors
        if compute_s is not None:
            counts.samples.extend([compute_s] * min(requests - errors, SAMPLES))
        if version == self.canary:
            self.step_requests += requests

    def health(self) -> str:
        """Why the canary is worse than the stable version, or "" while it is not (or
        the evidence is too thin to say)."""
        t, new, old = self.plan.thresholds, self.counts[self.canary], \
            self.counts[self.stable]
        if new.requests < t.min_requests:
            return ""
        if new.errors >= t.min_errors and new.error_rate - old.error_rate > t.max_error_rate:
            return (f"error rate {new.error_rate:.1%} over {new.requests} requests against "
                    f"{old.error_rate:.1%} for version {self.stable}")
        if len(new.samples) < t.min_requests or len(old.samples) < t.min_requests:
            return ""
        new_q, old_q = new.quantiles_s(), old.quantiles_s()
        if new_q is None or old_q is None:
            return ""
        (new_p50, new_p99), (old_p50, old_p99) = new_q, old_q
        if new_p50 > old_p50 * t.max_latency_ratio \
                and new_p50 - old_p50 > t.latency_floor_ms / 1000.0:
            return (f"compute time p50 {new_p50 * 1000:.1f} ms and p99 {new_p99 * 1000:.1f} "
                    f"ms against {old_p50 * 1000:.1f} and {old_p99 * 1000:.1f} ms for "
                    f"version {self.stable}")
        return ""

    def decide(self, now: float) -> Verdict | None:
        """The next change, or None to hold. Once it answered promote or rollback the
        rollout is over and answers None."""
        if self.outcome:
            return None
        why = self.health()
        if why:
            return self.end("rolled back", Verdict("rollback", {self.stable: 100,
                                                               self.canary: 0}, why))
        if now < self.step_started_s + self.plan.dwell_s \
                or self.step_requests < self.plan.thresholds.min_requests:
            return None
        if self.step + 1 >= len(self.plan.steps):
            return self.end("promoted", Verdict("promote", {self.canary: 100}))
        self.step += 1
        self.step_started_s = now
        self.step_requests = 0
        return Verdict("step", self.weights)

    def end(self, outcome: str, verdict: Verdict) -> Verdict:
        self.outcome = outcome
        return verdict

    def next_due(self) -> float | None:
        """When the current step's dwell ends; None once over, and while the step still
        lacks the canary's answers it needs: then the answer that completes them decides
        it (every answer ticks), and the dwell's end, once past, would stay due, a poll
        timeout of 0 that spun the broker's loop until enough traffic came."""
        if self.outcome or self.step_requests < self.plan.thresholds.min_requests:
            return None
        return self.step_started_s + self.plan.dwell_s

    def window_end(self) -> float | None:
        """When a watch's window ends, however little traffic came (None once over)."""
        return None if self.outcome else self.started_s + self.plan.dwell_s

    def describe(self, now: float) -> dict[str, Any]:
        # once over, the traffic as it ended, not the last step's split
        weights = {self.stable: 100, self.canary: 0} if self.outcome == "rolled back" \
            else {self.canary: 100} if self.outcome == "promoted" else self.weights
        return {"canary": self.canary, "stable": self.stable, "step": self.step,
                "weights": {str(v): w for v, w in weights.items()},
                "step_age_s": round(now - self.step_started_s, 3),
                "plan": self.plan.to_json(), "outcome": self.outcome,
                "counts": {str(v): c.describe() for v, c in self.counts.items()}}
