"""What both front ends answer besides inference (HTTP routes and the gRPC service
alike, so both follow one set of rules): readiness, server and model metadata, model
configuration, statistics, the repository index and load, and the server's log and
trace settings (the broker's, with this process's copy of each).

The :class:`Facade` owns the admin client (the broker's control socket, with the admin
token) and the read-only calls on the frontend; inference goes through
gateway/inference.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from zeroserve.broker.client import AsyncClient, InferError
from zeroserve.broker.logsettings import KEYS as LOG_KEYS, LogSettings, SettingsError, \
    validate
from zeroserve.broker.protocol import ErrorCode
from zeroserve.broker.tracesettings import TraceSettingError, TraceState
from zeroserve.gateway import readiness, tracing
from zeroserve.gateway.inference import as_caller
from zeroserve.gateway.settings import Settings

__all__ = ["Facade"]

logger = logging.getLogger(__name__)
# a control verb the broker does not know (one from before it): see _change_at_broker
_NO_VERB = object()

LOAD_TIMEOUT_S = 300.0   # a repository load answers once done, as Triton's blocks
STATUS_POLL_S = 0.05


class Facade:
    def __init__(self, settings: Settings, client: AsyncClient, tracer: tracing.Tracer
                 ) -> None:
        self.settings = settings
        self._client = client
        # verbs that change state go to the control socket, with the admin token: the
        # broker answers only read-only verbs on the frontend
        self.admin = AsyncClient(settings.control_endpoint,
                                 broker_timeout_s=settings.broker_timeout_s,
                                 admin_token=settings.admin_token, on_pong=self._on_pong)
        self._tracer = tracer
        self._draining = False
        self.logs = LogSettings()   # this process's logging: the broker's once it answers
        self._log_version = 0   # of the broker's settings self.logs holds (0: none yet)
        self._log_refresh: asyncio.Task[Any] | None = None
        self._trace_refresh: asyncio.Task[Any] | None = None

    async def start(self) -> None:
        await self.admin.start()

    async def close(self) -> None:
        for refresh in (self._trace_refresh, self._log_refresh):
            if refresh is not None:
                refresh.cancel()
        await self.admin.close()

    @property
    def draining(self) -> bool:
        return self._draining

    def start_draining(self) -> None:
        """From the shutdown signal on: not ready, so balancers send no more."""
        self._draining = True

    async def control(self, verb: str, **args: Any) -> Any:
        """A control call that cannot hang: one sent just as the broker died is lost,
        and a broker restarted at once keeps the client "connected"."""
        try:
            return await asyncio.wait_for(self._client.control(verb, **args),
                                          self.settings.broker_timeout_s)
        except asyncio.TimeoutError:
            raise InferError(ErrorCode.UNAVAILABLE,
                             f"no answer from the broker within "
                             f"{self.settings.broker_timeout_s:g} s") from None

    # -- readiness, metadata, configuration, statistics, the repository ---------
    async def not_ready(self) -> str | None:
        """Why the server is not ready (the rule of /v2/health/ready), or None."""
        if self._draining:
            return "gateway is shutting down"
        if not self._client.connected:
            return "broker is not reachable"
        try:
            return await readiness.not_ready(self.control, self.settings.readiness)
        except InferError as exc:
            return exc.message

    def server_metadata(self) -> dict[str, Any]:
        return {"name": self.settings.server_name, "version": self.settings.server_version,
                "extensions": self.settings.extensions()}

    # ``api_key``: the caller's key ("" for none), which the broker judges it by when it
    # has tenants; None only for the operator (the admin token) and the gateway itself.
    # No default: a front end that forgot its caller would show every tenant everything
    # (tenantgate.TenantGate.caller gives the key of any mapping of headers or metadata)
    async def model_metadata(self, name: str, version: int | None,
                             api_key: str | None) -> dict[str, Any]:
        meta: dict[str, Any] = await self.control("metadata", model=name, version=version,
                                                  **as_caller(api_key))
        for internal in ("ready", "max_batch_size", "labels"):
            meta.pop(internal, None)
        return meta

    async def model_config(self, name: str, version: int | None,
                           api_key: str | None) -> dict[str, Any]:
        return await self.control(  # type: ignore[no-any-return]
            "config", model=name, version=version, **as_caller(api_key))

    async def model_not_ready(self, name: str, version: int | None,
                              api_key: str | None) -> str | None:
        """Why the model is not ready, or None; InferError for an unknown one."""
        meta = await self.control("metadata", model=name, version=version,
                                  **as_caller(api_key))
        return None if meta["ready"] else f"model {meta['name']!r} is not ready"

    async def stats(self, name: str | None, version: int | None,
                    api_key: str | None) -> dict[str, Any]:
        args = {} if name is None else {"model": name, "version": version}
        got: dict[str, Any] = await self.control("stats", **args, **as_caller(api_key))
        return got

    async def repository_index(self, ready: bool, api_key: str | None) -> Any:
        return await self.control("repository_index", ready=ready, **as_caller(api_key))

    async def load_model(self, name: str, config: str | None, files: dict[str, bytes]) -> None:
        """Returns once the broker has loaded the model; InferError if it failed to."""
        job = await self.admin.control("repository_load", model=name, config=config,
                                       files=files)
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        while True:
            status = await self.admin.control("repository_load_status", token=str(job["token"]))
            if status["state"] == "ready":
                return
            if status["state"] != "loading":
                raise InferError(ErrorCode.BAD_INPUT, str(status["error"]))
            if time.monotonic() > deadline:
                raise InferError(ErrorCode.UNAVAILABLE, f"failed to load '{name}': still "
                                 f"loading after {LOAD_TIMEOUT_S:g} s", retry_after_s=5)
            await asyncio.sleep(STATUS_POLL_S)  # the broker answers at once: poll the job

    async def unload_model(self, name: str) -> None:
        await self.admin.control("repository_unload", model=name)

    # -- the server's log and trace settings: the broker's, and this process's copy --
    # Every call here goes over the one admin socket, which the broker answers in order,
    # so the copies are loaded in the order the broker made them.
    def _on_pong(self, header: dict[str, Any]) -> None:
        """A PONG names the versions of the broker's settings: one other than this
        process's copy's is fetched (one fetch at a time of each)."""
        if _other(header.get("settings"), self._tracer.settings.version) and (
                self._trace_refresh is None or self._trace_refresh.done()):
            self._trace_refresh = asyncio.get_running_loop().create_task(
                self.trace_settings(), name="zeroserve-trace-settings")
        if _other(header.get("logs"), self._log_version) and (
                self._log_refresh is None or self._log_refresh.done()):
            self._log_refresh = asyncio.get_running_loop().create_task(
                self.log_settings(), name="zeroserve-log-settings")

    async def log_settings(self) -> dict[str, Any]:
        """This process's, made the broker's first where it answers (a broker without the
        verb, or not answering, leaves them as they are)."""
        await self._read_from_broker("log_settings", "log settings", self._load_logs,
                                     SettingsError)
        return self.logs.current()

    async def change_log_settings(self, update: Any) -> dict[str, Any]:
        """Changed at the broker (SettingsError first if they do not validate here), which
        passes them to its workers; its answer becomes this process's. A broker without
        the verb leaves the change to this process alone."""
        validate(update)   # the 400 without a round trip
        doc = await self._change_at_broker("logging", "log settings", settings=update)
        if doc is _NO_VERB:
            return self.logs.apply(update)
        if isinstance(doc, dict) and "version" in doc:
            self._load_logs(doc)
        else:   # a broker from before the shared settings answers its own, unversioned
            self.logs.apply(update)
        return self.logs.current()

    async def _read_from_broker(self, verb: str, what: str, load: Callable[[Any], None],
                                bad: type[Exception]) -> None:
        """The broker's answer to a read-only verb given to ``load``; this process's own
        copy stays when the broker is not connected (at once, not after
        broker_timeout_s), does not answer, has no such verb, or answers what ``load``
        refuses with ``bad``."""
        if not self.admin.connected:
            return
        try:
            load(await asyncio.wait_for(self.admin.control(verb),
                                        self.settings.broker_timeout_s))
        except asyncio.TimeoutError:
            logger.warning("%s: no answer from the broker within %g s", what,
                           self.settings.broker_timeout_s)
        except (InferError, bad) as exc:
            logger.log(logging.DEBUG if "unknown control verb" in str(exc) else
                       logging.WARNING, "%s: this process's own (%s)", what, exc)

    async def _change_at_broker(self, verb: str, what: str, **args: Any) -> Any:
        """A state-changing verb's answer, or _NO_VERB from a broker without it (the change
        is then this process's alone); UNAVAILABLE when the broker does not answer."""
        try:
            return await asyncio.wait_for(self.admin.control(verb, **args),
                                          self.settings.broker_timeout_s)
        except asyncio.TimeoutError:
            raise InferError(ErrorCode.UNAVAILABLE, f"{what} not changed: no answer "
                             f"from the broker within {self.settings.broker_timeout_s:g} s"
                             ) from None
        except InferError as exc:
            if exc.code is not ErrorCode.BAD_INPUT or "unknown control verb" not in exc.message:
                raise
            logger.warning("the broker has no %r verb: the %s change in this gateway "
                           "process alone", verb, what)
            return _NO_VERB

    def _load_logs(self, doc: Any) -> None:
        """The broker's settings (its ``log_settings`` answer) as this process's."""
        if not isinstance(doc, dict) or not isinstance(doc.get("version"), int) \
                or not isinstance(doc.get("settings"), dict):
            raise SettingsError(f"the broker's answer is not log settings: {doc!r:.200}")
        # taken even if they do not apply, so that a PONG does not ask again every ping
        self._log_version = doc["version"]
        before = self.logs.current()
        # a newer broker's other keys are not this process's to apply
        now = self.logs.apply({k: v for k, v in doc["settings"].items() if k in LOG_KEYS})
        if now != before:
            logger.info("log settings now the broker's: %s",
                        {k: v for k, v in now.items() if before.get(k) != v})
        logger.debug("log settings: the broker's, version %x", self._log_version)

    async def trace_settings(self) -> tracing.TraceSettings:
        """This process's copy, replaced with the broker's first where it answers (a
        broker without the verb, or not answering, leaves the copy as it is)."""
        settings = self._tracer.settings
        await self._read_from_broker("trace_settings", "trace settings",
                                     lambda doc: settings.load(TraceState.from_doc(doc)),
                                     TraceSettingError)
        return settings

    async def update_trace_settings(self, model: str | None, changes: Any
                                    ) -> tracing.TraceSettings:
        """Changed at the broker (TraceSettingError first if they do not validate here),
        whose answer becomes this process's copy; a broker without the verb leaves the
        change to this process alone."""
        settings = self._tracer.settings
        settings.state.updated(model, changes)   # Triton's errors without a round trip
        doc = await self._change_at_broker("trace_settings_update", "trace settings",
                                           model=model, settings=changes)
        if doc is _NO_VERB:
            settings.update(model, changes)
            return settings
        settings.load(TraceState.from_doc(doc))
        logger.info("trace setting%s now %s", f" of {model}" if model else "",
                    settings.get(model))
        return settings


def _other(version: Any, copy: int) -> bool:
    """A PONG's version of settings (0 or absent from a broker without them) that is not
    the copy's."""
    return isinstance(version, int) and version != 0 and version != copy
