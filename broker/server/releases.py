"""Rollouts in the broker: the pure decisions of broker/server/rollout.py fed with what
the request path answers, and their verdicts applied through the catalog's verbs (the
catalog stays the one writer of model state). A rollout starts when a swap commits a
new build of a model whose config has a ``rollout`` plan (the previous version kept
loaded), or by hand (``zeroserve rollout``); ``zeroserve rollback`` and ``promote`` end
one by hand. A swap of a model without a plan, whose previous version is still loaded,
is watched: a one-step plan (all the traffic to the new build at once, its failed
requests run again on the version before) that rolls it back on errors as a canary is,
and at the end of its window simply ends, retiring nothing. See docs/rollouts.md.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from zeroserve.broker import wording
from zeroserve.broker.server.catalog import Catalog, CatalogModel
from zeroserve.broker.server.control import ControlError, ControlTable
from zeroserve.broker.server.pool import WorkerPool
from zeroserve.broker.server.rollout import Rollout, Verdict
from zeroserve.models.repository import RepoModel
from zeroserve.models.rolloutplan import Plan, PlanError, parse_plan
from zeroserve.broker.server.types import Clock, ModelVersion

logger = logging.getLogger(__name__)

# reroute(model, versions, to): unpinned queued requests for ``versions`` go to ``to``
Reroute = Callable[[str, set[int], int], None]
Found = tuple[dict[str, RepoModel], dict[str, str]]   # a repository scan


class Releases:
    """Every model's rollout in progress, and the versions rolled back."""

    def __init__(self, catalog: Catalog, pool: WorkerPool, clock: Clock,
                 registry: CollectorRegistry, reroute: Reroute, watch_s: float = 0.0) -> None:
        self.catalog = catalog
        self.pool = pool
        self.clock = clock
        self._reroute = reroute
        self.rollouts: dict[str, Rollout] = {}
        self.ended: dict[str, dict[str, Any]] = {}    # each model's last rollout, described
        # what the request path reports on: models with a rollout or a rolled-back version
        self.watched: set[str] = set()
        # versions a promotion retired: kept out of rescans until their folder goes
        self.retired: dict[str, set[int]] = {}
        self.rollbacks: dict[tuple[str, str], int] = {}   # (model, check): rollbacks
        self.promotions: dict[str, int] = {}
        self.watch_s = watch_s          # a swap without a plan: its watch (0: none)
        self.watches: set[str] = set()  # models whose rollout is such a watch
        registry.register(_RolloutMetrics(self))

    # -- the request path's reports ---------------------------------------------
    def answered(self, model: str, version: int, requests: int, compute_s: float) -> None:
        rollout = self.rollouts.get(model)
        if rollout is not None:
            rollout.observe(version, requests, 0, compute_s)

    def failed(self, model: str, version: int, requests: int) -> None:
        rollout = self.rollouts.get(model)
        if rollout is not None:
            rollout.observe(version, requests, requests)
            self.tick(self.clock())   # errors decide at once, not at the next tick

    def fallback(self, model: str, version: int) -> int | None:
        """Where a request that ``version`` failed runs again: the stable version, when
        ``version`` is the canary of a rollout whose plan retries, or has been rolled
        back (its errors after the verdict reach no one)."""
        running = self.rollouts.get(model)
        if running is not None and version == running.canary and running.plan.retry:
            return running.stable
        entry = self.catalog.get(model)
        if entry is None or version not in entry.failed:
            return None
        target = entry.default_version
        return None if target == version else target

    def unretired(self, found: Found) -> Found:
        """A repository scan as the releases need it: without the versions promotions
        retired (the version policy would bring them back; a retired version whose
        folder is gone is forgotten, so one added again under its number is served), and
        with the version serving now kept beside rolled-back ones: a version policy of
        the newest N counts a rolled-back version, so the next push would otherwise
        unload the one healthy version and go live with nothing to compare it with."""
        models, errors = found
        out = dict(models)
        for name, versions in list(self.retired.items()):
            rm = models.get(name)
            on_disk = {v for v in versions if rm is not None and
                       (rm.path / str(v)).is_dir()}
            if on_disk:
                self.retired[name] = on_disk
            else:
                del self.retired[name]
            if rm is not None and on_disk & set(rm.versions):
                out[name] = replace(rm, versions=tuple(v for v in rm.versions
                                                       if v not in on_disk))
        for name in self.watched:
            rm, entry = out.get(name), self.catalog.get(name)
            if rm is None or entry is None or not set(entry.failed) & set(rm.versions):
                continue
            serving = entry.default_version
            if serving not in rm.versions and serving not in entry.failed \
                    and (rm.path / str(serving)).is_dir():
                out[name] = replace(rm, versions=tuple(sorted((*rm.versions, serving))))
        return out, errors

    # -- time ---------------------------------------------------------------------
    def tick(self, now: float) -> None:
        if len(self.ended) + len(self.rollouts) + len(self.watched) > 0:
            self._forget_removed()
        for name, rollout in list(self.rollouts.items()):
            end_s = rollout.window_end() if name in self.watches else None
            if end_s is not None and now >= end_s and not rollout.health():
                # a watch ends with its window, however little traffic came
                self._apply(name, rollout, rollout.end("watched", Verdict("promote", {})))
                continue
            verdict = rollout.decide(now)
            if verdict is not None:
                self._apply(name, rollout, verdict)

    def _forget_removed(self) -> None:
        """What was kept of models the catalog no longer serves goes: registrations can
        come and go by the thousand, and the broker must not grow with them."""
        models = self.catalog.models
        if all(n in models for n in (*self.ended, *self.rollouts, *self.watched)):
            return
        self.ended = {n: e for n, e in self.ended.items() if n in models}
        self.rollouts = {n: r for n, r in self.rollouts.items() if n in models}
        self.watched &= set(models)
        self.rollbacks = {k: n for k, n in self.rollbacks.items() if k[0] in models}
        self.promotions = {k: n for k, n in self.promotions.items() if k in models}

    def next_due(self) -> float | None:
        return min((d for name, r in self.rollouts.items()
                    if (d := r.window_end() if name in self.watches else r.next_due())
                    is not None), default=None) if self.rollouts else None   # every turn

    def _apply(self, name: str, rollout: Rollout, verdict: Verdict) -> None:
        if self.catalog.get(name) is None:
            self._end(name, rollout)
            return
        if verdict.action == "step":
            self.catalog.set_weights(name, verdict.weights)
            logger.info("model %s: rollout of version %d to %d%% of the traffic", name,
                        rollout.canary, verdict.weights[rollout.canary])
        elif verdict.action == "rollback":
            self._roll_back(name, rollout.canary, rollout.stable, verdict.reason,
                            "errors" if verdict.reason.startswith("error") else "latency")
            self._end(name, rollout)
        elif name in self.watches:   # the window passed: nothing to retire
            self.catalog.set_weights(name, None)
            logger.info("model %s: version %d watched for %g s: healthy", name,
                        rollout.canary, rollout.plan.dwell_s)
            self._end(name, rollout)
        else:
            self._promote(name, rollout.canary, rollout.stable)
            self._end(name, rollout)

    def _roll_back(self, name: str, canary: int, stable: int, reason: str,
                   check: str) -> None:
        self.catalog.set_weights(name, None)
        self.catalog.mark_failed(name, canary, reason)
        self.watched.add(name)   # its in-flight failures still run again elsewhere
        self._reroute(name, {canary}, stable)
        self.rollbacks[name, check] = self.rollbacks.get((name, check), 0) + 1
        logger.error("model %s: version %d rolled back, version %d serves: %s", name,
                     canary, stable, reason)

    def _promote(self, name: str, canary: int, stable: int) -> None:
        self.catalog.clear_failed(name, canary)
        self.catalog.set_weights(name, None)
        if stable != canary:
            self.catalog.retire_version(name, stable)
            self.retired.setdefault(name, set()).add(stable)
            for worker in list(self.pool.workers.values()):
                if worker.holds(name, stable):
                    self.pool.retire(worker, ModelVersion(name, stable))
            self._reroute(name, {stable}, canary)
        self.promotions[name] = self.promotions.get(name, 0) + 1
        logger.info("model %s: version %d promoted; version %d retired", name, canary, stable)

    def _end(self, name: str, rollout: Rollout) -> None:
        self.rollouts.pop(name, None)
        now = self.clock()
        self.ended[name] = {**rollout.describe(now), "ended_s": now,   # the broker's clock
                            **({"watch": True} if name in self.watches else {})}
        self.watches.discard(name)
        entry = self.catalog.get(name)
        if entry is None or not entry.failed:
            self.watched.discard(name)

    # -- starting -------------------------------------------------------------------
    def committed(self, name: str, changed: set[int]) -> None:
        """A swap committed ``changed`` versions of ``name``: a new build of its newest
        version starts the config's rollout plan against the previous version, when one
        is still loaded."""
        model = self.catalog.get(name)
        if model is None:
            return
        running = self.rollouts.get(name)
        if running is not None and name in self.watches and changed:
            # a newer build (or its own, rebuilt) supersedes the one watched: its weights
            # must not keep the traffic on the old build
            self.catalog.set_weights(name, None)
            running.end("superseded", Verdict("promote", {}))
            self._end(name, running)
        elif running is not None and not {running.canary, running.stable} <= set(model.ready):
            self._end(name, running)   # a version it compares left: nothing to compare
        if not model.ready:
            return
        canary = max(model.ready)
        older = [v for v in model.ready if v < canary and v not in model.failed]
        if canary not in changed or not older:
            return
        if model.config.rollout is not None:
            self.begin(name, canary, max(older), parse_plan(model.config.rollout))
        elif self.watch_s > 0 and not model.config.traffic and canary == model.default_version:
            self.begin(name, canary, max(older), Plan(steps=(100,), dwell_s=self.watch_s))
            self.watches.add(name)

    def begin(self, name: str, canary: int, stable: int, plan: Plan) -> Rollout:
        rollout = Rollout(canary, stable, plan, self.clock())
        self.rollouts[name] = rollout
        self.watches.discard(name)   # a plan, or a rollout by hand, replaces a watch
        self.watched.add(name)
        self.catalog.clear_failed(name, canary)
        self.catalog.set_weights(name, rollout.weights)
        logger.info("model %s: rollout of version %d over version %d begins at %d%% "
                    "(steps %s, %g s each)", name, canary, stable, plan.steps[0],
                    list(plan.steps), plan.dwell_s)
        return rollout

    # -- control verbs ------------------------------------------------------------
    def add_verbs(self, control: ControlTable) -> None:
        control.add("rollout", self.rollout_verb, mutates=True)
        control.add("rollback", self.rollback_verb, mutates=True)
        control.add("promote", self.promote_verb, mutates=True)

    def rollout_verb(self, args: dict[str, Any]) -> dict[str, Any]:
        """``rollout model version [plan fields]``: a plan that cannot run changes
        nothing and answers bad_input."""
        model, canary = self._model_version(args, required=True)
        assert canary is not None
        name = model.config.name
        if canary not in model.ready:
            raise ControlError("bad_input", f"version {canary} of model {name!r} is not "
                               "loaded: add it to the repository (or the version policy) first")
        stable = args.get("stable")
        if stable is None:
            others = [v for v in model.ready if v != canary and v not in model.failed]
            if not others:
                raise ControlError("bad_input", f"model {name!r} has no other loaded version "
                                   f"to compare version {canary} with: its version_policy "
                                   f"{json.dumps(model.config.version_policy)} keeps no other; "
                                   'set "version_policy": {"latest": 2} (PATCH '
                                   f"/v1/models/{name}/config, or its config.json) so the "
                                   "version before a push stays loaded")
            stable = model.default_version if model.default_version in others else max(others)
        elif not isinstance(stable, int) or stable not in model.ready or stable == canary \
                or stable in model.failed:
            raise ControlError("bad_input", f"stable must be another loaded version of "
                               f"{name!r} not rolled back, got {stable!r}")
        raw = {k: v for k, v in args.items() if k not in ("model", "version", "stable")}
        base = model.config.rollout or {}
        try:
            plan = parse_plan({**base, **raw})
            rollout = self.begin(name, canary, stable, plan)
        except PlanError as exc:
            raise ControlError("bad_input", f"rollout plan: {exc}") from None
        return rollout.describe(self.clock())

    def rollback_verb(self, args: dict[str, Any]) -> dict[str, Any]:
        """``rollback model [version]``: the running rollout's canary, else the version
        named, else the newest, leaves the traffic at once."""
        model, version = self._model_version(args)
        name = model.config.name
        running = self.rollouts.get(name)
        if version is None:
            version = running.canary if running is not None else model.default_version
        others = [v for v in model.ready if v != version and v not in model.failed]
        if not others:
            raise ControlError("bad_input", f"model {name!r} has no other loaded version to "
                               f"serve in place of version {version}")
        stable = running.stable if running is not None and running.canary == version \
            else max(others)
        if running is not None:
            running.end("rolled back", Verdict("rollback", {}))
            self._end(name, running)
        self._roll_back(name, version, stable, "rolled back by hand", "manual")
        return {"model": name, "rolled_back": version, "serving": stable}

    def promote_verb(self, args: dict[str, Any]) -> dict[str, Any]:
        """``promote model [version]``: the running rollout's canary (or the version
        named) takes all the traffic now, and the version it replaces retires."""
        model, version = self._model_version(args)
        name = model.config.name
        running = self.rollouts.get(name)
        if version is None:
            if running is None:
                raise ControlError("bad_input", f"model {name!r} has no rollout in progress: "
                                   "name the version to promote")
            version = running.canary
        if version not in model.ready:
            raise ControlError("bad_input", f"version {version} of model {name!r} is not loaded")
        stable = running.stable if running is not None and running.canary == version \
            else model.default_version
        if running is not None:
            running.end("promoted", Verdict("promote", {}))
            self._end(name, running)
        self._promote(name, version, stable)
        return {"model": name, "promoted": version, "retired": stable if stable != version
                else None}

    def _model_version(self, args: dict[str, Any], required: bool = False
                       ) -> tuple[CatalogModel, int | None]:
        name, version = args.get("model"), args.get("version")
        if not isinstance(name, str) or not name:
            raise ControlError("bad_input", "'model' must name a model")
        if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
            raise ControlError("bad_input", "'version' must be an integer")
        model = self.catalog.get(name)
        if model is None:
            raise LookupError(wording.unknown_model(name))
        if version is None and required:
            raise ControlError("bad_input", "'version' must name the version to roll out")
        if version is not None and version not in model.versions:
            raise ControlError("bad_input", wording.unknown_version(name, version))
        return model, version

    def describe(self, name: str) -> dict[str, Any]:
        """``zeroserve models``' part: the rollout in progress, else the last one."""
        running = self.rollouts.get(name)
        if running is not None:
            return {"rollout": {**running.describe(self.clock()),
                                **({"watch": True} if name in self.watches else {})}}
        if name in self.ended:
            return {"rollout": self.ended[name]}
        return {}


CHECKS = ("errors", "latency", "manual")


class _RolloutMetrics(Collector):
    """Rollbacks and promotions, each rollout's canary weight and the age of its step,
    read at each scrape. Every model has every series (0 without a rollout), so the
    alerts' measures always name one (tests/deploy/test_prometheus.py)."""

    def __init__(self, releases: Releases) -> None:
        self.releases = releases

    def collect(self) -> Iterator[Metric]:
        rel = self.releases
        now = rel.clock()
        rollbacks = CounterMetricFamily("zeroserve_rollbacks", "Canary versions rolled back, "
                                        "by the check that failed, or by hand (manual)",
                                        labels=["model", "check"])
        promotions = CounterMetricFamily("zeroserve_rollout_promotions", "Rollouts whose "
                                         "canary took all the traffic", labels=["model"])
        weight = GaugeMetricFamily("zeroserve_rollout_canary_weight", "The canary's share of "
                                   "the model's traffic in a rollout in progress, percent "
                                   "(0: none in progress)", labels=["model"])
        age = GaugeMetricFamily("zeroserve_rollout_step_age_seconds", "Time since the "
                                "current step of the model's rollout began (0: none)",
                                labels=["model"])
        dwell = GaugeMetricFamily("zeroserve_rollout_step_dwell_seconds", "The dwell time "
                                  "of the steps of the model's rollout (0: none)",
                                  labels=["model"])
        for name in sorted(rel.catalog.models):
            for check in CHECKS:
                rollbacks.add_metric([name, check], float(rel.rollbacks.get((name, check), 0)))
            promotions.add_metric([name], float(rel.promotions.get(name, 0)))
            r = rel.rollouts.get(name)
            weight.add_metric([name], float(r.weights[r.canary]) if r else 0.0)
            age.add_metric([name], now - r.step_started_s if r else 0.0)
            dwell.add_metric([name], r.plan.dwell_s if r else 0.0)
        yield from (rollbacks, promotions, weight, age, dwell)
