"""The broker's Prometheus metrics, in a registry of its own; the gateway asks for
them over the control socket and merges them into its one scrape."""

from __future__ import annotations

import bisect
import math
from typing import Any, Callable, Iterable, Iterator, Mapping, Protocol, Sequence, cast

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily, Metric)
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client import utils as prometheus_utils

from zeroserve.broker.protocol import ErrorCode
from zeroserve.broker.server.pool import Loss
from zeroserve.broker.server.tenants import ANONYMOUS

_REJECT_REASONS = {ErrorCode.DEADLINE: "deadline", ErrorCode.OVERLOADED: "shed",
                   ErrorCode.CANCELLED: "cancelled", ErrorCode.QUOTA: "quota",
                   ErrorCode.BAD_INPUT: "bad_input", ErrorCode.NO_WORKER: "no_worker",
                   ErrorCode.TOO_LARGE: "bad_input", ErrorCode.TOO_BIG: "no_worker"}
LATENCY_BUCKETS = (.0005, .001, .002, .005, .01, .02, .05, .1, .2, .5, 1, 2, 5, 10, 30)
GAP_BUCKETS = (.001, .002, .005, .01, .02, .05, .1, .2, .5, 1, 2, 5)
LOAD_WAIT_BUCKETS = (.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PADDING_BUCKETS = (0.0, .02, .05, .1, .2, .3, .5, .75, 1)
TOKEN_BUCKETS = (16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 65536)


class Children:
    """Labelled series looked up once each: ``labels()`` takes a lock and builds a key on
    every call, several times a request. Only for series that are never removed and whose
    label values are bounded (catalog models, statuses, versions, priorities, tenants)."""

    def __init__(self) -> None:
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}

    def __call__(self, metric: MetricWrapperBase, *labels: str) -> Any:
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child


# worker ids whose restarts, losses and recycles keep their series (the oldest go)
WORKER_SERIES = 256
LOSS_REASONS = tuple(loss.name.lower() for loss in Loss)   # worker_lost's reasons

# how prometheus_client writes a bucket's bound (untyped there)
_go_float = cast(Callable[[float], str], prometheus_utils.floatToGoString)


class LoopCounter:
    """A labelled counter written by the broker's loop alone (one thread): an increment
    is a dict lookup and an addition, where prometheus_client's takes a lock. Its series
    are read at scrape time, under the same name and type. Label values must be bounded,
    as for :class:`Children`."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str],
                 registry: CollectorRegistry) -> None:
        self.name, self.documentation = f"zeroserve_{name}", documentation
        self.labelnames = list(labelnames)
        self.values: dict[tuple[str, ...], float] = {}
        registry.register(self)

    def inc(self, labels: tuple[str, ...], amount: float = 1.0) -> None:
        self.values[labels] = self.values.get(labels, 0.0) + amount

    def describe(self) -> Iterator[Metric]:
        yield CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for labels, value in self.values.items():
            family.add_metric(list(labels), value)
        yield family


class HistogramSeries:
    """One labelled series of a :class:`LoopHistogram`: counts per bucket (not cumulative;
    the last is +Inf) and the sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1   # le: the bound counts
        self.sum += value


class LoopHistogram:
    """A labelled histogram written by the broker's loop alone: an observation is a bisect
    and two additions, where prometheus_client's takes a lock for its sum and another for
    its bucket, three times a request (about 3 us each). Exposed at scrape time under the
    same name and samples (``_bucket``, ``_count``, ``_sum``)."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str],
                 registry: CollectorRegistry, buckets: Sequence[float]) -> None:
        self.name, self.documentation = f"zeroserve_{name}", documentation
        self.labelnames = list(labelnames)
        self.bounds = tuple(float(b) for b in buckets if b != math.inf)
        self.series: dict[tuple[str, ...], HistogramSeries] = {}
        registry.register(self)

    def remove_where(self, keep: Callable[[tuple[str, ...]], bool]) -> None:
        """Series whose label values ``keep`` refuses go (a retired version's)."""
        for values in [v for v in self.series if not keep(v)]:
            del self.series[values]

    def labels(self, *values: str) -> HistogramSeries:
        series = self.series.get(values)
        if series is None:
            series = self.series[values] = HistogramSeries(self.bounds)
        return series

    def describe(self) -> Iterator[Metric]:
        yield HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        les = [_go_float(b) for b in self.bounds] + ["+Inf"]
        for labels, series in self.series.items():
            cumulative, buckets = 0, []
            for le, n in zip(les, series.counts):
                cumulative += n
                buckets.append((le, float(cumulative)))
            family.add_metric(list(labels), buckets, series.sum)
        yield family


class BrokerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        ns = "zeroserve"
        # written for every request or batch: the loop's own (see LoopCounter)
        self.requests = LoopCounter("inference_requests", "Requests answered by the broker",
                                    ["model", "status"], r)
        self.latency = LoopHistogram("inference_latency_seconds",
                                     "Broker arrival to reply, answered requests",
                                     ["model", "version", "status"], r, LATENCY_BUCKETS)
        self.queue = LoopHistogram("inference_queue_seconds", "Time queued before dispatch",
                                   ["model", "priority"], r, LATENCY_BUCKETS)
        self.compute = LoopHistogram("inference_compute_seconds", "Worker time per batch",
                                     ["model"], r, LATENCY_BUCKETS)
        self.batch_size = LoopHistogram("inference_batch_size", "Samples per batch",
                                        ["model"], r, BATCH_BUCKETS)
        self.padding = LoopHistogram("batch_padding_ratio", "Share of a batch's computed "
                                     "tokens that is padding (models with a padded input)",
                                     ["model"], r, PADDING_BUCKETS)
        self.batch_tokens = LoopHistogram("batch_tokens", "Tokens a batch computes, padding "
                                          "included (models with a padded input)", ["model"],
                                          r, TOKEN_BUCKETS)
        self.batches = LoopCounter("batches", "Batches sent, by why they were sent",
                                   ["model", "reason"], r)
        self.cache_hits = LoopCounter("cache_hits", "Requests answered from the response "
                                      "cache, without a worker", ["model"], r)
        self.cache_misses = LoopCounter("cache_misses", "Requests of a model with the "
                                        "response cache that it could not answer", ["model"], r)
        self.loads = LoopCounter("model_loads_on_demand", "Loads on demand started, by "
                                 "why (request: a request asked; retry: the first worker "
                                 "failed)", ["model", "reason"], r)
        self.loads_failed = LoopCounter("model_loads_on_demand_failed", "Loads on demand "
                                        "that failed or lost their worker", ["model"], r)
        self.evictions = LoopCounter("model_evictions", "Models evicted from a worker to "
                                     "make room, by why (room: for a load; measured: a "
                                     "warm-up measured more than predicted)",
                                     ["model", "reason"], r)
        self.load_wait = LoopHistogram("load_wait_seconds", "Time requests waited in the "
                                       "queue for their model's load on demand", ["model"],
                                       r, LOAD_WAIT_BUCKETS)
        self.rejected_total = Counter("requests_rejected", "Requests dropped or refused",
                                      ["model", "reason"], namespace=ns, registry=r)
        self.deadline = Counter("deadline_exceeded", "Requests failed for their deadline",
                                ["model"], namespace=ns, registry=r)
        self.load_ok = Counter("model_load_success", "Model versions loaded by a worker",
                               ["model"], namespace=ns, registry=r)
        self.load_fail = Counter("model_load_failure", "Model version loads that failed",
                                 ["model"], namespace=ns, registry=r)
        self.load_seconds = Histogram("model_load_seconds", "Time to load and warm a version",
                                      ["model"], namespace=ns, registry=r,
                                      buckets=(.05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60))
        self.swaps = Counter("model_swaps", "Routing flips to a new version", ["model"],
                             namespace=ns, registry=r)
        # a model's series exists from its first commit, so an alert's measure is 0, not
        # absent, until a swap fails
        self.swap_failures = Counter("model_swap_failures", "Swaps to new versions that "
                                     "failed (the old versions kept serving, if any)",
                                     ["model"], namespace=ns, registry=r)
        self.queue_depth = Gauge("queue_depth", "Requests queued", ["model"], namespace=ns,
                                 registry=r)
        self.alive = Gauge("workers_alive", "Workers registered with the broker",
                           namespace=ns, registry=r)
        self.shutdown_cut = Counter("shutdown_unfinished", "Accepted requests answered 503 "
                                    "because the drain bound passed while stopping",
                                    namespace=ns, registry=r)
        self.scale = Counter("autoscale_decisions", "Replica controller decisions (each "
                             "change, and each hold when it starts), by action and reason",
                             ["model", "action", "reason"], namespace=ns, registry=r)
        self.replicas = Gauge("model_replicas", "Workers serving an autoscaled model",
                              ["model"], namespace=ns, registry=r)
        self.scale_queue = Gauge("autoscale_queue_seconds", "Queue time the replica "
                                 "controller sees (oldest queued request, window mean)",
                                 ["model"], namespace=ns, registry=r)
        self.scale_utilization = Gauge("autoscale_utilization", "Fraction of an autoscaled "
                                       "model's replicas busy (window mean)", ["model"],
                                       namespace=ns, registry=r)
        self.bad = Counter("bad_messages", "Malformed messages counted and dropped",
                           ["socket", "reason"], namespace=ns, registry=r)
        self.streams = Counter("streams", "Streams (requests to decoupled models) ended, by "
                               "how: ok at a final response, else the error code",
                               ["model", "status"], namespace=ns, registry=r)
        self.stream_responses = Counter("stream_responses", "Responses sent on streams "
                                        "(empty final responses included)", ["model"],
                                        namespace=ns, registry=r)
        self.first_response = Histogram("stream_first_response_seconds",
                                        "Broker arrival to a stream's first response (a "
                                        "generating model's first token)",
                                        ["model", "tenant"], namespace=ns, registry=r,
                                        buckets=LATENCY_BUCKETS)
        self.response_gap = Histogram("stream_response_gap_seconds",
                                      "Between a stream's consecutive responses (a "
                                      "generating model's inter-token gap)",
                                      ["model", "tenant"], namespace=ns, registry=r,
                                      buckets=GAP_BUCKETS)
        self.preemptions = Counter("preemptions", "Running sequences of iterative models "
                                   "paused for a request of a higher priority, by the "
                                   "paused one's tenant", ["model", "tenant"], namespace=ns,
                                   registry=r)
        self.restarts = Counter("worker_restarts", "Times a worker id registered again "
                                "with this broker (each start after its first)", ["worker"],
                                namespace=ns, registry=r)
        self.losses = Counter("worker_losses", "Workers removed, by how they were lost",
                              ["worker", "reason"], namespace=ns, registry=r)
        self.recycles = Counter("worker_recycles", "Workers that left to be restarted "
                                "because memory was not returned after an unload",
                                ["worker"], namespace=ns, registry=r)
        self.breaker_trips = Counter("circuit_breaker_trips", "Times a model's circuit "
                                     "breaker opened (its own errors past the threshold, or "
                                     "a probe failed)", ["model"], namespace=ns, registry=r)
        # worker ids with series, oldest first: pods name workers, so ids churn, and a
        # series per id ever seen grew for good (three a worker killed every minute);
        # the oldest go past this many, which outnumbers any pool's live workers
        self._seen_workers: dict[str, None] = {}
        self._child = Children()
        # the queue-time series by (model, priority) as ints: its labels are strings, made
        # and looked up again for every batch otherwise
        self._queue_of: dict[tuple[str, int], Callable[[float], None]] = {}

    def breaker_tripped(self, model: str) -> None:
        self.breaker_trips.labels(model).inc()

    def retain_versions(self, model: str, versions: Iterable[int]) -> None:
        """Only ``versions`` of the model are served now: the latency series of the
        others go (a label value a version, unbounded under a version every 30 s)."""
        keep = {str(v) for v in versions}
        self.latency.remove_where(lambda lv: lv[0] != model or lv[1] in keep)

    def requests_done(self, model: str, version: int, totals_s: Sequence[float]) -> None:
        """A batch's requests answered ok, each with its arrival-to-reply time."""
        self.requests.inc((model, "ok"), len(totals_s))
        observe = self.latency.labels(model, str(version), "ok").observe
        for total_s in totals_s:
            observe(total_s)

    def error(self, model: str, code: ErrorCode) -> None:
        """Every error answer; those that drop or refuse a request count by reason."""
        self.requests.inc((model, code.value))
        reason = _REJECT_REASONS.get(code)
        if reason is not None:
            self._child(self.rejected_total, model, reason).inc()
        if code is ErrorCode.DEADLINE:
            self._child(self.deadline, model).inc()

    def stream_responses_sent(self, model: str, n: int) -> None:
        self._child(self.stream_responses, model).inc(n)

    def stream_response(self, model: str, tenant: str, index: int, gap_s: float) -> None:
        """A stream's response went out, ``gap_s`` after its arrival (the first) or its
        last response."""
        metric = self.first_response if index == 0 else self.response_gap
        self._child(metric, model, tenant or ANONYMOUS).observe(gap_s)

    def preempted(self, model: str, tenant: str) -> None:
        self._child(self.preemptions, model, tenant or ANONYMOUS).inc()

    def stream_ended(self, model: str, status: str) -> None:
        self._child(self.streams, model, status).inc()

    def queued(self, model: str, waits: Sequence[tuple[int, float]]) -> None:
        """A batch's requests left the queue: (priority, seconds queued) of each."""
        last, observe = None, None
        for priority, queue_s in waits:
            if priority != last or observe is None:
                last, observe = priority, self._queue_of.get((model, priority))
                if observe is None:
                    observe = self._queue_of[(model, priority)] = \
                        self.queue.labels(model, str(priority)).observe
            observe(queue_s)

    def batch_sent(self, model: str, reason: str, samples: int, tokens: int = 0,
                   padded_tokens: int = 0) -> None:
        self.batches.inc((model, reason))
        self.batch_size.labels(model).observe(samples)
        if padded_tokens:
            self.padding.labels(model).observe(1.0 - tokens / padded_tokens)
            self.batch_tokens.labels(model).observe(padded_tokens)

    def batch_done(self, model: str, samples: int, compute_s: float,
                   phases_ms: dict[str, float] | None = None) -> None:
        self.compute.labels(model).observe(compute_s)

    def model_loaded(self, model: str, ok: bool, seconds: float) -> None:
        if ok:
            self.load_ok.labels(model).inc()
            self.load_seconds.labels(model).observe(seconds)
        else:
            self.load_fail.labels(model).inc()

    def workers_alive(self, n: int) -> None:
        self.alive.set(n)

    def worker_registered(self, worker_id: str) -> None:
        # the first registration creates the series at 0, so increase() sees the first
        # restart; the series are not cached in Children: their ids are not bounded
        child = self.restarts.labels(worker_id)
        self.recycles.labels(worker_id)
        if worker_id in self._seen_workers:
            child.inc()
            del self._seen_workers[worker_id]   # to the newest end
        self._seen_workers[worker_id] = None
        while len(self._seen_workers) > WORKER_SERIES:
            self._drop_worker(next(iter(self._seen_workers)))

    def _drop_worker(self, worker_id: str) -> None:
        del self._seen_workers[worker_id]
        self.restarts.remove(worker_id)
        self.recycles.remove(worker_id)
        for loss in LOSS_REASONS:
            self.losses.remove(worker_id, loss)

    def worker_lost(self, worker_id: str, reason: str) -> None:
        self.losses.labels(worker_id, reason).inc()

    def worker_recycled(self, worker_id: str) -> None:
        self.recycles.labels(worker_id).inc()

    def shutdown_failed(self, n: int) -> None:
        self.shutdown_cut.inc(n)

    def autoscale_decision(self, model: str, action: str, reason: str) -> None:
        self.scale.labels(model, action, reason).inc()

    def bad_message(self, where: str, reason: str) -> None:
        self.bad.labels(where, reason).inc()

    def render(self) -> str:
        return generate_latest(self.registry).decode()


class Served(Protocol):
    """What a scrape reads of the catalog: its models by name."""

    @property
    def models(self) -> Mapping[str, Any]: ...


class ModelStates:
    """prometheus_client's collector protocol: each catalog model's readiness (what
    ``/v2/models/{m}/ready`` answers) and its queue-time SLO (``autoscaling.queue_slo_ms``,
    the alert rules' threshold), read at each scrape so the request path pays nothing."""

    def __init__(self, served: Served,
                 on_demand: Callable[[Any], bool] = lambda config: False) -> None:
        self.served = served
        self.on_demand = on_demand

    def collect(self) -> Iterator[Metric]:
        ready = GaugeMetricFamily("zeroserve_model_ready", "1 while a version of the model "
                                  "is loaded and routable, else 0", labels=["model"])
        slo = GaugeMetricFamily("zeroserve_model_queue_slo_seconds", "The model's queue-time "
                                "objective (autoscaling.queue_slo_ms)", labels=["model"])
        demand = GaugeMetricFamily("zeroserve_model_on_demand", "1 for a model loaded on "
                                   "demand (not ready until asked for), else 0",
                                   labels=["model"])
        for name, model in sorted(self.served.models.items()):
            ready.add_metric([name], 1.0 if model.ready else 0.0)
            slo.add_metric([name], float(model.config.autoscaling.get("queue_slo_ms", 100.0))
                           / 1000.0)
            demand.add_metric([name], 1.0 if self.on_demand(model.config) else 0.0)
        yield from (ready, slo, demand)


class BreakerStates:
    """prometheus_client's collector protocol: each catalog model's circuit breaker,
    0 closed, 1 half-open (probing), 2 open, read at each scrape on the broker's clock
    (one past its open time is half-open, before any request comes). Every model has
    the series, so the alert's measure is 0, not absent, while nothing fails."""

    LEVELS = {"closed": 0.0, "half_open": 1.0, "open": 2.0}

    def __init__(self, served: Served, state: Callable[[str, float], str],
                 clock: Callable[[], float]) -> None:
        self.served = served
        self.state = state
        self.clock = clock

    def collect(self) -> Iterator[Metric]:
        gauge = GaugeMetricFamily("zeroserve_circuit_breaker_state", "A model's circuit "
                                  "breaker: 0 closed, 1 half-open (probing), 2 open (its "
                                  "requests answered 503 at once)", labels=["model"])
        now = self.clock()
        for name in sorted(self.served.models):
            gauge.add_metric([name], self.LEVELS[self.state(name, now)])
        yield gauge


class CacheSize:
    """The response cache's bytes and entries, read at each scrape (``sizes``: what
    ``ResponseCache.describe`` answers)."""

    def __init__(self, sizes: Callable[[], Mapping[str, int]]) -> None:
        self.sizes = sizes   # not ``describe``: prometheus_client calls that for names

    def collect(self) -> Iterator[Metric]:
        now = self.sizes()
        for name, key, text in (
                ("zeroserve_cache_bytes", "bytes", "Bytes the response cache holds "
                 "(tensor bytes and a fixed overhead per entry), never above its bound"),
                ("zeroserve_cache_bound_bytes", "bound_bytes", "The response cache's bound "
                 "(--response-cache-bytes; 0: off)"),
                ("zeroserve_cache_entries", "entries", "Answers the response cache holds")):
            family = GaugeMetricFamily(name, text)
            family.add_metric([], float(now[key]))
            yield family
