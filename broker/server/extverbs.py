"""Control verbs of the v2 extensions the broker answers for the gateway: ``stats``
(statistics, read-only); ``log_settings`` (read-only) and ``logging`` (mutating): the
server's log settings, which the broker applies to itself, passes to every worker (now
and when one joins later) and every gateway follows; ``trace_settings`` (read-only) and
``trace_settings_update`` (mutating): the server's one copy of the trace settings, which
every gateway samples by (broker/tracesettings.py). The PONG carries both versions, so
each gateway sees a change within a ping."""

from __future__ import annotations

import logging
from typing import Any

from zeroserve.broker.logsettings import LogSettings, SettingsError
from zeroserve.broker.tracesettings import Setting, TraceSettingError, TraceState, new_version
from zeroserve.broker import protocol as p, wording
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
        self.logs = LogSettings()   # this process's start-up ones (its --log-level) at first
        # random, as the trace settings' version: a restarted broker's never matches a
        # gateway's copy of the last one's, so every gateway takes the new one's
        self.log_version = new_version()
        self.trace = trace or TraceState.start(Setting())

    def pong(self) -> p.Pong:
        """A gateway whose copy has another version than the PONG's asks again."""
        return p.Pong(settings=self.trace.version, logs=self.log_version)

    def add_verbs(self, control: ControlTable) -> None:
        control.add("stats", self.statistics)
        control.add("log_settings", self.log_settings)
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

    def log_settings(self, args: dict[str, Any]) -> dict[str, Any]:
        return {"version": self.log_version, "settings": self.logs.current()}

    def logging(self, args: dict[str, Any]) -> dict[str, Any]:
        """``settings``, Triton's POST body; answers as ``log_settings``."""
        update = args.get("settings") or {}
        try:
            self.logs.apply(update)
        except SettingsError as exc:
            raise ControlError("bad_input", str(exc)) from None
        self.log_version += 1
        self.pool.set_log_settings(dict(update))
        logger.info("log settings changed: %s", update)
        return self.log_settings(args)

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
