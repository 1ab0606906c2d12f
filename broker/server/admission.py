"""Admission: what a request must satisfy before it may queue, in one place. The checks
run in this order: the tenant known, the broker admitting, the model and version known and
held, the inputs valid against the config (Triton's order and words) and their shape
class, the tenant's quota and rate, and the deadline against the work queued ahead (a
request that cannot finish in time is refused now, not after waiting). What passes becomes
the scheduler's entry; what does not, a :class:`~zeroserve.broker.server.tenancy.Refusal`
to answer at once.

An ensemble's request climbs the same ladder (:meth:`Admission.admit_ensemble`), its
steps' models standing in for the holders and its critical path for the queue ahead; what
passes is run by the broker (pipeline.py)."""

from __future__ import annotations

import math
from typing import Hashable, NamedTuple, Sequence

from zeroserve.broker import protocol as p
from zeroserve.broker import wording
from zeroserve.broker.server.cachepath import CachedAnswers, Hit
from zeroserve.broker.server.catalog import Catalog, CatalogModel, RequestError, check_inputs, \
    normalize_priority
from zeroserve.broker.server.dispatchgate import DispatchGate
from zeroserve.broker.server.forecast import Forecast
from zeroserve.broker.server.latency import LatencyBook
from zeroserve.broker.server.ondemand import OnDemand, Refused
from zeroserve.broker.server.pool import WorkerPool
from zeroserve.broker.server.scheduler import Entry, Scheduler
from zeroserve.broker.server.stopping import StopState
from zeroserve.broker.server.tenancy import Grant, Refusal, Tenancy
from zeroserve.models import ensemble as ens
from zeroserve.models.repository import ModelConfig
from zeroserve.models.shapes import ShapeError, rule as shape_rule
from zeroserve.models.text import IDS


class Payload:
    """What a queued entry carries of its request, until it is answered."""

    __slots__ = ("client", "request_id", "request", "pinned", "attempts", "notes", "bundled",
                 "digest")

    def __init__(self, client: bytes, request: p.InferRequest, pinned: bool) -> None:
        self.client = client
        self.request_id = request.request_id
        self.request: p.InferRequest | None = request
        self.pinned = pinned
        self.attempts = 0
        self.notes: dict[str, float] = {}   # the tenant's clamps, for the reply's stats
        self.bundled = False   # came in a REQUESTS: the client takes its reply in REPLIES
        self.digest: bytes | None = None   # a response cache miss: its answer is kept

    def release(self) -> None:
        """Answered: let go of the tensor frames. The entry itself may linger in the
        scheduler's lazily cleaned heaps; its frames must not."""
        self.request = None


class Cached(NamedTuple):
    """Admitted and answered from the response cache: never queued."""

    grant: Grant
    hit: Hit


class Admission:
    """Turns a decoded request into a queue entry or a refusal. ``forecast`` says when
    the first of some workers is predicted to be done with what it holds; ``demand``
    (models loaded on demand) the load a request waits for."""

    def __init__(self, catalog: Catalog, scheduler: Scheduler, pool: WorkerPool,
                 latency: LatencyBook, tenancy: Tenancy, stop: StopState, gate: DispatchGate,
                 forecast: Forecast, answers: CachedAnswers,
                 demand: OnDemand | None = None) -> None:
        self.catalog = catalog
        self.scheduler = scheduler
        self.pool = pool
        self.latency = latency
        self.tenancy = tenancy
        self.stop = stop
        self.gate = gate
        self.forecast = forecast
        self.answers = answers
        self.demand = demand

    def admit(self, client: bytes, req: p.InferRequest, now: float
              ) -> Entry | Refusal | Cached:
        key = (client, req.request_id)
        who = self.tenancy.identify(req)
        if isinstance(who, Refusal):
            return who
        model = self.catalog.get(req.model)
        if model is not None and self.demand is not None:
            self.demand.asked(req.model, now)   # what eviction weighs: refused ones too
        demand = self._demand(model, req)
        err = admission_error(req, model, self.pool, self.stop.admits(client),
                              on_demand=demand is not None)
        if err is not None:
            return Refusal(err[0], err[1], "")
        assert model is not None
        try:
            samples = check_inputs(model.config, [t.meta for t in req.tensors], req.outputs)
            shape, scale, length = shape_class(model.config, req.tensors)
        except (RequestError, ShapeError) as exc:
            return Refusal(p.ErrorCode.BAD_INPUT, str(exc), "")
        grant = self.tenancy.admit(who, key, req, samples, now,
                                   samples * length or prompt_tokens(model.config, req.tensors))
        if isinstance(grant, Refusal):
            return grant
        digest = None
        if model.config.response_cache and self.answers.on:   # after the tenant's gate
            found = self.answers.lookup(grant.request, model)
            if isinstance(found, Hit):
                return Cached(grant, found)   # a model not loaded needs no load for it
            digest = found
        got = demand.admit(model, now) if demand is not None else 0.0
        entry = got if isinstance(got, Refused) else \
            self._entry(client, grant, model, samples, now, shape, scale, length, got)
        if isinstance(entry, (Refusal, Refused)):
            self.tenancy.release(key)
            self.tenancy.rejected(grant.tenant, entry.code)
            return entry if isinstance(entry, Refusal) else \
                Refusal(entry.code, entry.message, grant.tenant, entry.retry_after_s)
        if demand is not None:
            demand.want(req.model, now)
        entry.tenant, entry.weight, entry.shed_rank = grant.tenant, grant.weight, grant.shed_rank
        entry.by_time = grant.by_time
        entry.payload.notes = grant.notes
        entry.payload.digest = digest
        return entry

    def admit_ensemble(self, req: p.InferRequest, model: CatalogModel, now: float
                       ) -> Refusal | None:
        """The ladder for a request to an ensemble: None when it may start."""
        who = self.tenancy.identify(req)
        if isinstance(who, Refusal):
            return who
        if req.version is not None and req.version not in model.versions:
            return Refusal(p.ErrorCode.NOT_FOUND, wording.unknown_version(req.model,
                                                                          req.version), "")
        if self.streams(model) and not req.stream:
            return Refusal(p.ErrorCode.UNSUPPORTED, wording.decoupled_unary(req.model), "")
        try:
            samples = check_inputs(model.config, [t.meta for t in req.tensors], req.outputs)
        except RequestError as exc:
            return Refusal(p.ErrorCode.BAD_INPUT, str(exc), "")
        for i, step in enumerate(model.config.ensemble):
            if not self.pool.holders(step.model_name):
                return Refusal(p.ErrorCode.NO_WORKER, f"step {i} of ensemble {req.model!r}: "
                               f"no worker has model {step.model_name!r} loaded", "")
        timeout_ms, deadline = deadline_of(req, model.config, now)
        if deadline < math.inf:
            need_s = self.ensemble_s(model, req.priority, samples, now)
            if now + need_s > deadline:
                return Refusal(p.ErrorCode.DEADLINE, (
                    f"deadline of {timeout_ms:g} ms cannot be met: ensemble {req.model!r} "
                    f"needs about {need_s * 1000:.1f} ms along its slowest chain of steps"), "")
        return None

    def streams(self, model: CatalogModel) -> bool:
        """Whether an ensemble's last step is a decoupled model (its answer streams)."""
        return any(decoupled(self.catalog, s.model_name) for s in model.config.ensemble)

    def ensemble_s(self, model: CatalogModel, priority: int, samples: int, now: float
                   ) -> float:
        """An ensemble's critical path: the first steps wait for the queue ahead of them
        and run; a later step is counted by its run alone (its queue may drain
        meanwhile), so the refusal is for what surely cannot finish."""
        cfg = model.config
        inputs = [t.name for t in cfg.inputs]
        first = {i for i, d in enumerate(ens.depends(cfg.ensemble, inputs)) if not d}

        def cost_s(i: int) -> float:
            name = cfg.ensemble[i].model_name
            return self.predict_s(name, priority, samples, now, queue=i in first)
        return ens.critical_path_s(cfg.ensemble, inputs, cost_s)

    def predict_s(self, model: str, priority: int, samples: int, now: float,
                  queue: bool = True) -> float:
        """Seconds a request of ``samples`` to ``model`` is predicted to take from now:
        its run, and with ``queue`` the work queued ahead of it (a pipeline's admission
        sums these along its steps)."""
        cat = self.catalog.get(model)
        if cat is None:
            return 0.0
        predict = self.latency.predictor(model)
        need_s = predict(samples)
        if queue:
            holders = self.pool.holders(model)
            need_s += self.scheduler.estimate_wait(
                model, normalize_priority(priority, cat.config), predict, len(holders))
            need_s += self.forecast.soonest_free(holders, now) - now
        return need_s

    def _demand(self, model: CatalogModel | None, req: p.InferRequest) -> OnDemand | None:
        """Load on demand, for a request to a model loaded on demand that no worker holds."""
        if model is None or self.demand is None or not self.demand.on(model.config) \
                or self.pool.holders(req.model, req.version):
            return None
        return self.demand

    def _entry(self, client: bytes, grant: Grant, model: CatalogModel, samples: int,
               now: float, shape: Hashable, scale: float, length: int, load_s: float = 0.0
               ) -> Entry | Refusal:
        """The queue entry, or a refusal when the deadline cannot be met (``load_s``: the
        model is not loaded, and its load is predicted to take this long)."""
        req, cfg = grant.request, model.config
        priority = normalize_priority(req.priority, cfg)
        timeout_ms, deadline = deadline_of(req, cfg, now)
        if deadline < math.inf:   # without a deadline there is nothing to refuse it for
            predict = self.latency.predictor(req.model)
            holders = self.pool.holders(req.model)
            wait_s = self.scheduler.estimate_wait(req.model, priority, predict, len(holders),
                                                  grant.tenant, grant.weight, samples)
            wait_s += self.forecast.soonest_free(holders, now) - now
            if now + load_s + wait_s + predict(samples * scale) > deadline:
                loading = f"loading model {req.model!r} takes about {load_s * 1000:.0f} ms " \
                    "and " if load_s else ""
                return Refusal(p.ErrorCode.DEADLINE,
                               f"deadline of {timeout_ms:g} ms cannot be met: {loading}the "
                               f"queue ahead needs about {wait_s * 1000:.1f} ms", grant.tenant)
        self.gate.note(req.model, priority, now, grant.tenant)
        version = req.version
        if version is None and model.routed:
            version = model.route(req.routing_key or req.api_key or client.hex())
        return Entry(key=(client, req.request_id), model=req.model, priority=priority,
                     arrival_s=now, deadline_s=deadline, samples=samples, version=version,
                     payload=Payload(client, req, req.version is not None), shape=shape,
                     scale=scale, length=length)


def shape_class(cfg: ModelConfig, tensors: Sequence[p.Tensor]
                ) -> tuple[Hashable, float, int]:
    """A request's shape key, scale and tokens a row (models/shapes.py); one test for a
    model of fixed shapes, the common case."""
    rule = shape_rule(cfg)
    if rule.fixed:
        return None, 1.0, 0
    return rule.measure({t.meta.name: t.meta.shape for t in tensors})


def prompt_tokens(cfg: ModelConfig, tensors: Sequence[p.Tensor]) -> int:
    """A generating text model's prompt: its ``input_ids`` (a padded model's tokens are
    its rows' lengths, :func:`shape_class`); 0 for any other model."""
    if cfg.text is None or cfg.text.task != "generate":
        return 0
    return sum(math.prod(t.meta.shape) for t in tensors if t.meta.name == IDS)


def decoupled(catalog: Catalog, name: str) -> bool:
    model = catalog.get(name)
    return model is not None and model.config.decoupled


def warmup_scale(model: CatalogModel | None) -> float:
    """The units a row of a model's warm-up inputs counts for."""
    return shape_rule(model.config).warmup_scale() if model is not None else 1.0


def admission_error(req: p.InferRequest, model: CatalogModel | None, pool: WorkerPool,
                    admitting: bool, on_demand: bool = False
                    ) -> tuple[p.ErrorCode, str] | None:
    if not admitting:
        return p.ErrorCode.UNAVAILABLE, "broker is shutting down"
    if model is None:
        return p.ErrorCode.NOT_FOUND, wording.unknown_model(req.model)
    if req.version is not None and req.version not in model.versions:
        return p.ErrorCode.NOT_FOUND, wording.unknown_version(req.model, req.version)
    if model.config.decoupled and not req.stream:
        return p.ErrorCode.UNSUPPORTED, wording.decoupled_unary(req.model)
    if not on_demand and not pool.holders(req.model, req.version):
        return p.ErrorCode.NO_WORKER, f"no worker has model {req.model!r} loaded"
    return None


def deadline_of(req: p.InferRequest, cfg: ModelConfig, now: float) -> tuple[float, float]:
    """(timeout in ms, monotonic deadline); the model's default timeout when the request
    names none, no deadline when neither does. The protocol refuses NaN, infinite and
    negative budgets before this."""
    timeout_ms = req.timeout_ms or cfg.dynamic_batching.default_timeout_ms
    return timeout_ms, now + timeout_ms / 1000.0 if timeout_ms > 0 else math.inf
