"""Control verbs (CLI, gateway metadata and metrics), answered on the control socket and,
for the gateway's convenience, on the frontend."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

from zeroserve.broker import protocol as p

if TYPE_CHECKING:
    from zeroserve.broker.server import Broker

logger = logging.getLogger(__name__)


class ControlError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class ControlHandler:
    def __init__(self, broker: "Broker") -> None:
        self.broker = broker
        self.verbs: dict[str, Callable[[dict[str, Any]], Any]] = {
            "ping": lambda _: {"ok": True},
            "status": self.status,
            "models": self.models,
            "metadata": self.metadata,
            "config": self.config,
            "metrics": self.metrics,
        }

    def handle(self, header: dict[str, Any]) -> list[Any]:
        verb = header.get("verb")
        call_id = header.get("id", "")
        fn = self.verbs.get(verb) if isinstance(verb, str) else None
        try:
            if fn is None:
                raise ControlError("bad_input", f"unknown control verb {verb!r} "
                                   f"(known: {', '.join(sorted(self.verbs))})")
            args = header.get("args") or {}
            if not isinstance(args, dict):
                raise ControlError("bad_input", "'args' must be a map")
            result = fn(args)
        except ControlError as exc:
            return p.encode_simple(p.Kind.CONTROL_REPLY, id=call_id, ok=False,
                                   code=exc.code, error=str(exc))
        return p.encode_simple(p.Kind.CONTROL_REPLY, id=call_id, ok=True, result=result)

    def _model(self, args: dict[str, Any]) -> Any:
        name = args.get("model")
        model = self.broker.catalog.get(name) if isinstance(name, str) else None
        if model is None:
            raise ControlError("not_found", f"unknown model {name!r}")
        version = args.get("version")
        if version is not None and version not in model.versions:
            raise ControlError("not_found", f"version {version} of model {name!r} is not served")
        return model

    def status(self, _: dict[str, Any]) -> dict[str, Any]:
        b = self.broker
        now = b.clock()
        return {
            "workers": [w.describe(now) for w in b.members.workers.values()],
            "queues": {m: b.scheduler.depth(m) for m in b.catalog.models},
            "inflight_batches": len(b.inflight),
            "stopping": b.stopping,
        }

    def models(self, _: dict[str, Any]) -> dict[str, Any]:
        b = self.broker
        out = {}
        for name, m in sorted(b.catalog.models.items()):
            out[name] = {"versions": list(m.versions), "ready": sorted(m.ready),
                         "default_version": m.default_version if m.ready else None,
                         "platform": m.config.platform,
                         "workers": sorted(w.worker_id for w in b.members.holders(name)),
                         **b.lifecycle.describe(name)}
        errors = dict(b.catalog.errors)
        for name, failure in b.lifecycle.failures.items():
            errors.setdefault(name, failure["error"])
        return {"models": out, "errors": errors}

    def metadata(self, args: dict[str, Any]) -> dict[str, Any]:
        model = self._model(args)
        meta = model.metadata()
        meta["ready"] = bool(model.ready if args.get("version") is None
                             else args["version"] in model.ready)
        meta["max_batch_size"] = model.config.max_batch_size
        return meta

    def config(self, args: dict[str, Any]) -> dict[str, Any]:
        return self._model(args).config.to_json()

    def metrics(self, _: dict[str, Any]) -> dict[str, Any]:
        b = self.broker
        for name in b.catalog.models:
            b.metrics.queue_depth.labels(name).set(b.scheduler.depth(name))
        return {"broker": b.metrics.render(),
                "workers": {w.worker_id: w.metrics_text for w in b.members.workers.values()}}
