"""Control verbs of the v2 extensions the broker answers for the gateway: ``stats``
(statistics, read-only), ``logging`` (log settings, mutating: the broker applies
them and passes them to every worker, now and when one joins later), and
``trace_settings`` (read-only) and ``trace_settings_update`` (mutating): the server's
one copy of the trace settings, which every gateway samples by (broker/tracesettings.py;
the PONG carries its version, so each gateway sees a change within a ping)."""

from __future__ import annotations

import logging
from typing import Any

from zeroserve.broker.logsettings import LogSettings, SettingsError
from zeroserve.broker.tracesettings import Setting, TraceSettingError, TraceState
from zeroserve.broker import wording
from zeroserve.broker.server.catalog import Catalog
from zeroserve.broker.server.control import ControlError, ControlTable, model_arg
from zeroserve.broker.server.pool import WorkerPool
from zeroserve.broker.server.stats import ModelStatistics, memory_usage

logger = logging.getLogger(__name__)


class ExtensionVerbs:
    def __init__(self, catalog: Catalog, pool: WorkerPool, stats: ModelStatistics,
                 trace: TraceState | None = None) -> None:
        self.catalog = catalog
        self.pool = pool
        self.stats = stats
        self.logs = LogSettings()
        self.trace = trace or TraceState.start(Setting())

    @property
    def settings_version(self) -> int:
        """What the PONG carries: a gateway whose copy has another version asks again."""
        return self.trace.version

    def add_verbs(self, control: ControlTable) -> None:
        control.add("stats", self.statistics)
        control.add("logging", self.logging, mutates=True)
        control.add("trace_settings", self.trace_settings)
        control.add("trace_settings_update", self.update_trace_settings, mutates=True)

    def statistics(self, args: dict[str, Any]) -> dict[str, Any]:
        """Triton's ``model_stats``: every served version, or one model (one version)."""
        if args.get("model") is None:
            names = sorted(self.catalog.models)
            version = None
        else:
            name, version = model_arg(args)
            model = self.catalog.get(name)
            if model is None:
                raise LookupError(wording.unknown_model(name))
            if version is not None and version not in model.versions:
                raise LookupError(wording.unknown_version(name, version))
            names = [name]
        out = []
        for name in names:
            model = self.catalog.models[name]
            versions = [version] if version is not None else list(model.versions)
            default = model.default_version
            out += self.stats.render(name, versions, default,
                                     memory_usage(self.pool.workers.values(), name))
        return {"model_stats": out}

    def logging(self, args: dict[str, Any]) -> dict[str, Any]:
        update = args.get("settings") or {}
        try:
            current = self.logs.apply(update)
        except SettingsError as exc:
            raise ControlError("bad_input", str(exc)) from None
        self.pool.set_log_settings(dict(update))
        logger.info("log settings changed: %s", update)
        return current

    def trace_settings(self, args: dict[str, Any]) -> dict[str, Any]:
        return self.trace.to_doc()

    def update_trace_settings(self, args: dict[str, Any]) -> dict[str, Any]:
        """``model`` (none: the global setting) and ``settings``, Triton's POST body."""
        model = args.get("model")
        if model is not None and not isinstance(model, str):
            raise ControlError("bad_input", "'model' must be a model's name or absent")
        try:
            self.trace = self.trace.updated(model, args.get("settings") or {})
        except TraceSettingError as exc:
            raise ControlError("bad_input", str(exc)) from None
        logger.info("trace setting%s now %s", f" of {model}" if model else "",
                    self.trace.effective(model))
        return self.trace.to_doc()
