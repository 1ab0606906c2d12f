"""The request path's use of the response cache (cache.py): which requests may use it,
the key of each, and the counting of hits and misses in the statistics extension and
the metrics. Admission asks :meth:`CachedAnswers.lookup` once the tenant gate has
admitted the request, and the results give a miss's answer to :meth:`CachedAnswers.keep`
when it arrives.

Identical requests that miss together are each computed (nothing waits for another's
answer); the last answer to arrive is the one kept. A request the cache cannot serve:
one to a decoupled model or a stream, one without a version whose content the catalog
has hashed, and an unpinned one to a model with a traffic split (which version answers
is drawn for each request, so no one answer is right for it).
"""

from __future__ import annotations

import time
from typing import Sequence

from zeroserve.broker import protocol as p
from zeroserve.broker.server.cache import Answer, ResponseCache, request_digest
from zeroserve.broker.server.catalog import Catalog, CatalogModel
from zeroserve.broker.server.metrics import BrokerMetrics
from zeroserve.broker.server.stats import ModelStatistics


class Hit:
    __slots__ = ("answer", "lookup_s")

    def __init__(self, answer: Answer, lookup_s: float) -> None:
        self.answer = answer
        self.lookup_s = lookup_s


class CachedAnswers:
    def __init__(self, cache: ResponseCache, catalog: Catalog, stats: ModelStatistics,
                 metrics: BrokerMetrics) -> None:
        self.cache = cache
        self.catalog = catalog
        self.stats = stats
        self.metrics = metrics

    @property
    def on(self) -> bool:
        return self.cache.bound_bytes > 0

    def lookup(self, req: p.InferRequest, model: CatalogModel) -> Hit | bytes | None:
        """A hit; else the request's digest, to keep its answer under; None when the
        cache cannot serve this request."""
        cfg = model.config
        if req.stream or cfg.decoupled:
            return None
        version = req.version
        if version is None:
            if model.split():   # a traffic split or a rollout: versions vary by caller
                return None
            version = model.default_version
        sha = self.catalog.shas.get(cfg.name, {}).get(version)
        if sha is None:
            return None
        start = time.perf_counter()
        digest = request_digest(req.tensors, req.outputs)
        found = self.cache.get((cfg.name, sha, digest))
        lookup_s = time.perf_counter() - start
        if found is not None:
            self.metrics.cache_hits.inc((cfg.name,))
            return Hit(found, lookup_s)
        self.metrics.cache_misses.inc((cfg.name,))
        self.stats.cache_miss(cfg.name, version, lookup_s)
        return digest

    def answered(self, model: str, hit: Hit, total_s: float) -> None:
        """A hit's answer went out."""
        self.stats.cache_hit(model, hit.answer.version, hit.lookup_s, total_s)
        self.metrics.requests_done(model, hit.answer.version, [total_s])

    def keep(self, model: str, version: int, digest: bytes, tensors: Sequence[p.Tensor]
             ) -> None:
        """A miss's answer, computed by ``version`` of ``model``, for the next identical
        request. Kept under the content of the version that computed it: the one the
        lookup named may have been replaced meanwhile."""
        sha = self.catalog.shas.get(model, {}).get(version)
        if sha is None:
            return   # the version left while it ran: nothing to key its answer by
        start = time.perf_counter()
        self.cache.put((model, sha, digest), version, tensors)
        self.stats.cache_miss(model, version, time.perf_counter() - start, 0)

    def retain(self, name: str) -> None:
        """After a change of ``name`` (a commit or its removal): only answers of the
        content now served, and none once it no longer caches."""
        model = self.catalog.get(name)
        keep = self.catalog.shas.get(name, {}).values() \
            if model is not None and model.config.response_cache else ()
        self.cache.retain(name, keep)
