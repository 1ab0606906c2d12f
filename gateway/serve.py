"""Entry point of ``zeroserve gateway`` (also ``python -m zeroserve.gateway.serve``): the
Starlette app under uvicorn, and Triton's gRPC service on the same event loop
(``--grpc-port``, 0 for none; see gateway/grpc/server.py).

Shutdown (SIGTERM): readiness turns false at once, systemd hears STOPPING=1, the
broker hears that this gateway drains (so a stopping broker still takes what it
forwards), the listener closes, and connections opened before keep being served
while any request is in flight (a keep-alive client may send its next request on
one); once none is, or ``shutdown_timeout_s`` passed, uvicorn closes them, runs the
lifespan shutdown and exits. The gRPC server refuses new calls at the same moment and
gives those in flight the same bound.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
import time
from dataclasses import dataclass
from types import FrameType
from typing import Any

import uvicorn

from zeroserve.broker import __version__, curve, options, traceconfig, tracing as btracing
from zeroserve.broker.process import Notifier, notify
from zeroserve.gateway import tracing
from zeroserve.gateway.app import Gateway, Settings, create_app
from zeroserve.gateway.fastpath import InferFastPath, forwarded_allow_ips
from zeroserve.gateway.http1 import InferHttpProtocol
from zeroserve.gateway.tenantgate import networks

logger = logging.getLogger(__name__)

READY_POLL_S = 0.2
DRAIN_POLL_S = 0.05   # how often the drain looks whether requests are still in flight


@dataclass(frozen=True)
class GrpcListen:
    host: str
    port: int
    max_message_bytes: int
    reuse_port: bool
    response_compression: str = "none"


class GatewayServer(uvicorn.Server):
    """uvicorn.Server that speaks systemd's notify protocol and drains on SIGTERM."""

    def __init__(self, config: uvicorn.Config, gateway: Gateway,
                 grpc_listen: GrpcListen | None = None) -> None:
        super().__init__(config)
        self.gateway = gateway          # its parts, for the gRPC server
        self.facade = gateway.facade    # readiness, the drain
        self.grpc_listen = grpc_listen
        self.grpc: Any = None          # the GrpcServer once started
        self.failed = False            # a listener could not start: exit 2
        self.notifier = Notifier()
        self.announcer: asyncio.Task[None] | None = None
        self.drain_notice: asyncio.Task[None] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and self.grpc_listen is not None:
            if not await self.start_grpc(self.grpc_listen):
                self.failed = self.should_exit = True
                return
        if self.started:  # HTTP answers from now on; READY=1 waits for the models
            self.announcer = asyncio.ensure_future(self.announce_ready())

    async def start_grpc(self, listen: GrpcListen) -> bool:
        """Triton's gRPC service on this loop, once the lifespan has started the broker
        client (gRPC is imported only here: nothing of it exists before)."""
        from zeroserve.gateway.grpc.server import GrpcBindError, GrpcServer
        server = GrpcServer(self.gateway, listen.host, listen.port, listen.max_message_bytes,
                            listen.reuse_port, listen.response_compression)
        try:
            port = await server.start()
        except GrpcBindError as exc:
            logger.error("%s", exc)
            return False
        self.grpc = server
        logger.info("gRPC (Triton's GRPCInferenceService) on %s:%d", listen.host, port)
        return True

    async def announce_ready(self) -> None:
        """READY=1 once /v2/health/ready would say 200 (the same rule), so systemd
        units ordered after the gateway start when its models serve."""
        said = None
        while not self.should_exit:
            why = await self.facade.not_ready()
            if why is None:
                self.notifier.ready(f"serving ({self.gateway.settings.readiness} readiness)")
                logger.info("ready (%s readiness)", self.gateway.settings.readiness)
                return
            if why != said:
                logger.info("not ready yet: %s", why)
                notify(f"STATUS={why[:200]}")
                said = why
            await asyncio.sleep(READY_POLL_S)  # the broker's view changes without telling us

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.announcer is not None:
            self.announcer.cancel()   # stopping before ready: nothing left to announce
        for server in self.servers:   # new connections are refused from now on
            server.close()
        for sock in sockets or []:
            sock.close()
        grpc_drained = None
        if self.grpc is not None:   # refuses new calls now, lets those in flight finish
            bound = self.config.timeout_graceful_shutdown
            grpc_drained = asyncio.ensure_future(
                self.grpc.stop(bound if bound is not None else 30.0))
        await self.drain_open_connections()
        if grpc_drained is not None:
            await grpc_drained
        await super().shutdown(sockets)

    async def drain_open_connections(self) -> None:
        """uvicorn closes idle keep-alive connections as soon as it shuts down; this keeps
        them (and takes their requests) while any request is still in flight, which is
        how long the server as a whole drains."""
        bound = self.config.timeout_graceful_shutdown
        deadline = time.monotonic() + (bound if bound is not None else 30.0)
        while self.server_state.tasks and not self.force_exit \
                and time.monotonic() < deadline:
            self.notifier.watchdog()   # the drain may outlast WatchdogSec
            await asyncio.sleep(DRAIN_POLL_S)
        if bound is not None:  # what is left of the bound, for uvicorn's own wait
            self.config.timeout_graceful_shutdown = max(1, int(deadline - time.monotonic()))
        logger.info("open connections drained (%d request(s) still in flight)",
                    len(self.server_state.tasks))

    async def tell_broker_draining(self) -> None:
        """On the same socket as the requests, so the broker hears it before any request
        sent after it; a broker that is down has nothing to hear."""
        try:
            await self.facade.control("draining")
        except Exception as exc:  # noqa: BLE001 - best effort: an old broker, or none
            logger.info("the broker did not take the drain notice: %s", exc)

    async def on_tick(self, counter: int) -> bool:
        self.notifier.watchdog()
        return await super().on_tick(counter)

    async def _serve(self, sockets: list[socket.socket] | None = None) -> None:
        await super()._serve(sockets)
        # uvicorn re-raises the captured SIGTERM after a clean shutdown; a drained exit is 0
        self._captured_signals.clear()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            logger.info("signal %d: draining in-flight requests", sig)
            self.facade.start_draining()
            self.notifier.stopping()
            if self.started:
                self.drain_notice = asyncio.ensure_future(self.tell_broker_draining())
        super().handle_exit(sig, frame)


def run(args: argparse.Namespace) -> int:
    frontend = options.endpoints(args).frontend
    try:
        keys = curve.client_keys(args)
        curve.check_client(keys, frontend)
        networks(args.metrics_allow)
    except (curve.CurveError, ValueError) as exc:   # ValueError: --metrics-allow
        logger.error("%s", exc)
        return 2
    try:
        tracing.parse_config(args.trace_config or ())
        btracing.require_otel(traceconfig.parse_trace_config(args.trace_config or ()))
    except (tracing.TraceSettingError, traceconfig.TraceConfigError) as exc:
        logger.error("%s", exc)
        return 2
    app = create_app(Settings(frontend=frontend, control=options.endpoints(args).control,
                              max_body_bytes=args.max_body_bytes,
                              admin_token=os.environ.get("ZEROSERVE_ADMIN_TOKEN", ""),
                              readiness=args.readiness, server_name=args.server_name,
                              server_version=args.server_version or __version__,
                              allow_shared_memory=args.allow_shared_memory,
                              shed_lag_ms=args.shed_lag_ms, max_in_flight=args.max_in_flight,
                              metrics_allow=args.metrics_allow,
                              curve_keys=keys, trace_config=tuple(args.trace_config or ()),
                              shared_port=args.reuse_port))
    # the fast path applies uvicorn's proxy headers itself (fastpath.py)
    config = uvicorn.Config(InferFastPath(app, forwarded_allow_ips()), host=args.http_host,
                            port=args.http_port, proxy_headers=False,
                            loop="uvloop", http=InferHttpProtocol, access_log=False,
                            log_level=args.log_level, log_config=None,
                            timeout_graceful_shutdown=int(args.shutdown_timeout_s))
    logger.info("gateway on http://%s:%d, broker %s", args.http_host, args.http_port, frontend)
    sockets = [shared_socket(args.http_host, args.http_port)] if args.reuse_port else None
    listen = None
    if args.grpc_port:
        listen = GrpcListen(args.grpc_host or args.http_host, args.grpc_port,
                            args.grpc_max_message_bytes, args.reuse_port,
                            args.grpc_response_compression)
    server = GatewayServer(config, app.state.gateway, listen)
    server.run(sockets=sockets)
    return 2 if server.failed else 0


def shared_socket(host: str, port: int) -> socket.socket:
    """A listening socket that other gateway processes bind too (SO_REUSEPORT): the
    kernel spreads new connections over them, each process with its own DEALER."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def main(argv: list[str] | None = None) -> int:
    return options.run_component("gateway", run, argv)


if __name__ == "__main__":
    sys.exit(main())
