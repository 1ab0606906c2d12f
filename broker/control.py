"""Control verbs (CLI, gateway metadata and metrics), answered on the control socket and,
for the gateway's convenience, on the frontend."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Callable

from zeroserve.broker import protocol as p
from zeroserve.broker.runtime import hostname

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
            "drain": lambda a: self._operate(self.broker.drain_worker, self._worker_arg(a), True),
            "undrain": lambda a: self._operate(self.broker.drain_worker, self._worker_arg(a),
                                               False),
            "restart": lambda a: self._operate(self.broker.restart_worker, self._worker_arg(a)),
            "reload": self.reload,
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

    @staticmethod
    def _worker_arg(args: dict[str, Any]) -> str:
        worker = args.get("worker")
        if not isinstance(worker, str) or not worker:
            raise ControlError("bad_input", "'worker' must name a worker id such as host/0")
        return worker

    @staticmethod
    def _operate(fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except LookupError as exc:
            raise ControlError("not_found", str(exc.args[0])) from None

    def reload(self, args: dict[str, Any]) -> Any:
        name, version = args.get("model"), args.get("version")
        if not isinstance(name, str) or not name:
            raise ControlError("bad_input", "'model' must name a model")
        if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
            raise ControlError("bad_input", "'version' must be an integer")
        return self._operate(self.broker.reload_model, name, version)

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
        return {"broker": b.metrics.render(), "instance": f"{hostname()}:{os.getpid()}",
                "workers": {w.worker_id: w.metrics_text for w in b.members.workers.values()}}
