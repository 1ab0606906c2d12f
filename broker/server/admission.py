"""What a request must satisfy before it may queue: pure functions of the request,
the catalog entry and the pool, so they are tested without sockets."""

from __future__ import annotations

import math

from zeroserve.broker import protocol as p
from zeroserve.broker import wording
from zeroserve.broker.server.catalog import CatalogModel
from zeroserve.broker.server.pool import WorkerPool
from zeroserve.models.repository import ModelConfig


def admission_error(req: p.InferRequest, model: CatalogModel | None, pool: WorkerPool,
                    admitting: bool) -> tuple[p.ErrorCode, str] | None:
    if not admitting:
        return p.ErrorCode.UNAVAILABLE, "broker is shutting down"
    if model is None:
        return p.ErrorCode.NOT_FOUND, wording.unknown_model(req.model)
    if req.version is not None and req.version not in model.versions:
        return p.ErrorCode.NOT_FOUND, wording.unknown_version(req.model, req.version)
    if model.config.decoupled and not req.stream:
        return p.ErrorCode.UNSUPPORTED, wording.decoupled_unary(req.model)
    if not pool.holders(req.model, req.version):
        return p.ErrorCode.NO_WORKER, f"no worker has model {req.model!r} loaded"
    return None


def deadline_of(req: p.InferRequest, cfg: ModelConfig, now: float) -> tuple[float, float]:
    """(timeout in ms, monotonic deadline); the model's default timeout when the request
    names none, no deadline when neither does. The protocol refuses NaN, infinite and
    negative budgets before this."""
    timeout_ms = req.timeout_ms or cfg.dynamic_batching.default_timeout_ms
    return timeout_ms, now + timeout_ms / 1000.0 if timeout_ms > 0 else math.inf
