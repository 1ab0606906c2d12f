"""``inference.GRPCInferenceService`` (every RPC but inference, which is in infer.py)
and ``grpc.health.v1.Health``, answered from the same
:class:`~zeroserve.gateway.facade.Facade` methods as the HTTP routes, so both follow
one set of rules: readiness, metadata, the admin rule for what changes state, the
caller's key for what a tenant may see."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator

from zeroserve.broker import wording
from zeroserve.broker.client import InferError
from zeroserve.broker.protocol import ErrorCode
from zeroserve.gateway.access import check_admin
from zeroserve.gateway.errors import BadRequest
from zeroserve.gateway.facade import Facade
from zeroserve.gateway.inference import InferencePath
from zeroserve.gateway.shm import SharedMemory
from zeroserve.gateway.tenantgate import TenantGate
from zeroserve.gateway.tracing import TraceSettingError, from_lists
from zeroserve.gateway.grpc import messages
from zeroserve.gateway.grpc.infer import Inference, metadata_of
from zeroserve.models.proto import grpc_service_pb2 as pb
from zeroserve.models.proto import health_pb2
from zeroserve.gateway.grpc.tensors import value
from zeroserve.gateway.http import parse_version
from zeroserve.gateway.routes.repository import file_path

logger = logging.getLogger(__name__)

SERVICE = "inference.GRPCInferenceService"
WATCH_POLL_S = 1.0   # a Watch sees a change within this; a probe's period is seconds


def peer_host(context: Any) -> str:
    """The client's address as the admin rule reads it: ``ipv4:127.0.0.1:5000`` ->
    127.0.0.1, ``ipv6:[::1]:5000`` -> ::1 (a unix socket is local too)."""
    peer = context.peer() or ""
    kind, _, rest = peer.partition(":")
    if kind == "ipv6":
        return rest.partition("]")[0].lstrip("[")
    if kind == "unix":
        return "localhost"
    return rest.rpartition(":")[0]


def _version(raw: str) -> int | None:
    return parse_version(raw or None)


class InferenceService(Inference):
    """The servicer: methods named as the proto's RPCs, each ``(request, context)``."""

    def __init__(self, inference: InferencePath, shm: SharedMemory, facade: Facade,
                 gate: TenantGate, admin_token: str) -> None:
        super().__init__(inference, shm)
        self.facade = facade
        self.gate = gate
        self.admin_token = admin_token

    async def _caller(self, context: Any) -> str | None:
        """The key the broker judges the caller by (None: the operator); with tenants,
        UNAUTHENTICATED at once without one, as every /v2 route but health."""
        return await self.gate.admit(metadata_of(context))

    def _admin(self, context: Any) -> None:
        check_admin(peer_host(context), metadata_of(context).get("authorization", ""),
                    self.admin_token)

    # -- health and metadata ---------------------------------------------------
    async def ServerLive(self, request: Any, context: Any) -> Any:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: Any) -> Any:
        return pb.ServerReadyResponse(ready=await self.facade.not_ready() is None)

    async def ModelReady(self, request: Any, context: Any) -> Any:
        try:
            why = await self.facade.model_not_ready(request.name, _version(request.version),
                                                await self._caller(context))
        except InferError as exc:
            if exc.code is not ErrorCode.NOT_FOUND:
                raise
            return pb.ModelReadyResponse(ready=False)   # as Triton: unknown is not ready
        return pb.ModelReadyResponse(ready=why is None)

    async def ServerMetadata(self, request: Any, context: Any) -> Any:
        await self._caller(context)
        meta = self.facade.server_metadata()
        return pb.ServerMetadataResponse(name=meta["name"], version=meta["version"],
                                         extensions=meta["extensions"])

    async def ModelMetadata(self, request: Any, context: Any) -> Any:
        return messages.model_metadata(await self.facade.model_metadata(
            request.name, _version(request.version), await self._caller(context)))

    async def ModelConfig(self, request: Any, context: Any) -> Any:
        doc = await self.facade.model_config(request.name, _version(request.version),
                                         await self._caller(context))
        return pb.ModelConfigResponse(config=messages.model_config(doc))

    async def ModelStatistics(self, request: Any, context: Any) -> Any:
        name = request.name or None
        version = _version(request.version) if name else None
        return messages.statistics(await self.facade.stats(name, version,
                                                       await self._caller(context)))

    # -- model repository ------------------------------------------------------
    async def RepositoryIndex(self, request: Any, context: Any) -> Any:
        return messages.repository_index(await self.facade.repository_index(
            bool(request.ready), await self._caller(context)))

    async def RepositoryModelLoad(self, request: Any, context: Any) -> Any:
        await self._caller(context)
        self._admin(context)
        config, files = None, {}
        for key, param in request.parameters.items():
            got = value(param)
            if key == "config":
                if not isinstance(got, str):
                    raise BadRequest("parameter 'config' must be a string of JSON")
                config = got
            elif key.startswith("file:"):
                if not isinstance(got, bytes):
                    raise BadRequest(f"parameter {key!r} must be bytes_param file contents")
                files[file_path(key)] = got
        await self.facade.load_model(request.model_name, config, files)
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request: Any, context: Any) -> Any:
        await self._caller(context)
        self._admin(context)
        await self.facade.unload_model(request.model_name)
        return pb.RepositoryModelUnloadResponse()

    # -- shared memory ---------------------------------------------------------
    async def SystemSharedMemoryStatus(self, request: Any, context: Any) -> Any:
        await self._caller(context)
        out = pb.SystemSharedMemoryStatusResponse()
        for region in self.shm.status(request.name or None):
            out.regions[region["name"]].CopyFrom(
                pb.SystemSharedMemoryStatusResponse.RegionStatus(**region))
        return out

    async def SystemSharedMemoryRegister(self, request: Any, context: Any) -> Any:
        await self._caller(context)
        self._admin(context)
        self.shm.register(request.name, request.key, request.offset, request.byte_size)
        logger.info("shared-memory region %r registered over gRPC (key %r)", request.name,
                    request.key)
        return pb.SystemSharedMemoryRegisterResponse()

    async def SystemSharedMemoryUnregister(self, request: Any, context: Any) -> Any:
        await self._caller(context)
        self._admin(context)
        self.shm.unregister(request.name or None)
        return pb.SystemSharedMemoryUnregisterResponse()

    async def CudaSharedMemoryStatus(self, request: Any, context: Any) -> Any:
        await self._caller(context)
        if request.name:   # no region is ever registered: there is no GPU in the gateway
            raise InferError(ErrorCode.NOT_FOUND,
                             f"unable to find cuda shared memory region: '{request.name}'")
        return pb.CudaSharedMemoryStatusResponse()

    async def CudaSharedMemoryRegister(self, request: Any, context: Any) -> Any:
        await self._caller(context)
        self._admin(context)
        if not request.name:
            raise BadRequest(wording.CUDA_SHM_NO_NAME)
        raise BadRequest(wording.cuda_shm_unsupported(request.name))

    async def CudaSharedMemoryUnregister(self, request: Any, context: Any) -> Any:
        await self._caller(context)
        self._admin(context)
        return pb.CudaSharedMemoryUnregisterResponse()

    # -- settings --------------------------------------------------------------
    async def LogSettings(self, request: Any, context: Any) -> Any:
        await self._caller(context)
        update = {key: value(setting) for key, setting in request.settings.items()}
        if update:
            self._admin(context)
            current = await self.facade.change_log_settings(update)
        else:
            current = await self.facade.log_settings()
        out = pb.LogSettingsResponse()
        for key, val in current.items():
            setting = out.settings[key]
            if isinstance(val, bool):
                setting.bool_param = val
            elif isinstance(val, int):
                setting.uint32_param = val
            else:
                setting.string_param = str(val)
        return out

    async def TraceSetting(self, request: Any, context: Any) -> Any:
        """The settings HTTP's /v2/trace/setting reads and changes (gateway/tracing.py)."""
        await self._caller(context)
        model = request.model_name or None
        if model is not None:
            try:
                why = await self.facade.model_not_ready(model, None, None)
            except InferError as exc:
                if exc.code is not ErrorCode.NOT_FOUND:
                    raise
                why = "unknown"
            if why is not None:   # Triton's answer, as over HTTP
                raise BadRequest(f"Request for unknown model : {model}")
        if request.settings:
            self._admin(context)
            changes = from_lists({k: list(v.value) for k, v in request.settings.items()})
            try:
                settings = await self.facade.update_trace_settings(model, changes)
            except TraceSettingError as exc:
                raise BadRequest(str(exc)) from None
        else:
            settings = await self.facade.trace_settings()
        got = settings.get_lists(model)
        out = pb.TraceSettingResponse()
        for key, values in got.items():
            out.settings[key].value.extend(values)
        return out


class HealthService:
    """``grpc.health.v1.Health`` for Kubernetes' gRPC probes: service "" or
    ``inference.GRPCInferenceService`` is SERVING when the server is ready (HTTP's
    rule), ``live`` whenever this process answers. Check answers an unknown name
    NOT_FOUND; Watch (grpc's health protocol, which Triton's ``health.proto`` leaves
    out) streams the status now and then each change, SERVICE_UNKNOWN for an unknown
    name, until the client ends the call."""

    def __init__(self, facade: Facade, watch_poll_s: float = WATCH_POLL_S) -> None:
        self.facade = facade
        self.watch_poll_s = watch_poll_s

    async def _status(self, service: str) -> int:
        status = health_pb2.HealthCheckResponse
        if service == "live":
            return int(status.SERVING)
        if service not in ("", SERVICE, "ready"):
            return int(status.SERVICE_UNKNOWN)
        ready = await self.facade.not_ready() is None
        return int(status.SERVING if ready else status.NOT_SERVING)

    async def Check(self, request: Any, context: Any) -> Any:
        got = await self._status(request.service)
        if got == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN:
            raise InferError(ErrorCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=got)

    async def Watch(self, request: Any, context: Any) -> AsyncIterator[Any]:
        # readiness has no change event to wait on: it is asked again every
        # watch_poll_s, and only a change is sent
        last = None
        while True:
            got = await self._status(request.service)
            if got != last:
                yield health_pb2.HealthCheckResponse(status=got)
                last = got
            if self.facade.draining:   # said NOT_SERVING; ending lets the gRPC drain finish
                return
            await asyncio.sleep(self.watch_poll_s)
