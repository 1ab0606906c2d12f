"""Entry point of ``zeroserve broker`` (also ``python -m zeroserve.broker.server.main``)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

import zmq

from zeroserve.broker import curve, options
from zeroserve.broker.runtime import BrokerLock, Endpoints, RuntimeDirError, ServerLock, \
    ensure_runtime_dir, exposed_endpoints
from zeroserve.broker.server.broker import Broker
from zeroserve.broker.server import memtrace, tenants
from zeroserve.broker.server.loop import BrokerLoop
from zeroserve.broker.server.lifecycle import LifecycleOptions
from zeroserve.broker.server.breaker import BreakerOptions
from zeroserve.broker.server.loadretry import RetryPolicy
from zeroserve.broker.server.ondemand import OnDemandOptions
from zeroserve.broker.tracesettings import TraceSettingError, TraceState, parse_config

logger = logging.getLogger(__name__)


def check_timing(heartbeat_s: float, worker_expiry_s: float) -> str | None:
    """Heartbeats must be able to keep a worker alive: several fit in one expiry."""
    if heartbeat_s <= 0:
        return f"--heartbeat-s must be > 0, got {heartbeat_s:g}"
    if worker_expiry_s < 2 * heartbeat_s:
        return (f"--worker-expiry-s ({worker_expiry_s:g}) must be at least twice "
                f"--heartbeat-s ({heartbeat_s:g}), or live workers would be dropped")
    return None


def check_exposure(endpoints: Endpoints, security: curve.ServerSecurity | None) -> str | None:
    """tcp:// beyond loopback only with Curve, and never for the control socket (its
    verbs are guarded by the admin token and the host, not by keys)."""
    exposed = exposed_endpoints(endpoints)
    if endpoints.control in exposed:
        return (f"refusing to bind the control socket on {endpoints.control}: it stays on "
                "ipc:// or a loopback address (run zeroserve status and the like on the "
                "broker's host)")
    if exposed and security is None:
        return (f"refusing to bind {', '.join(exposed)}: tcp:// beyond loopback needs "
                "CurveZMQ keys (--curve-secret-key, the broker's key pair, and "
                "--curve-authorized-keys, the folder of the keys let in; see `zeroserve "
                "keys generate`); or use ipc:// or a loopback address")
    return None


def build(endpoints: Endpoints, model_dir: Path, args: Any, ctx: zmq.Context[Any],
          security: curve.ServerSecurity | None = None) -> tuple[BrokerLoop, Broker]:
    loop = BrokerLoop(endpoints, ctx, security)
    broker = Broker(model_dir, to_client=loop.to_client, to_worker=loop.to_worker,
                    to_controller=loop.to_controller, heartbeat_s=args.heartbeat_s,
                    worker_expiry_s=args.worker_expiry_s, drain_timeout_s=args.drain_timeout_s,
                    max_message_bytes=args.max_message_bytes,
                    response_cache_bytes=args.response_cache_bytes,
                    breaker=BreakerOptions(
                        error_rate=args.breaker_error_rate,
                        min_failures=max(1, args.breaker_min_failures),
                        window_s=args.breaker_window_s, open_s=args.breaker_open_s,
                        probes=max(1, args.breaker_probes), watch_s=args.swap_watch_s),
                    on_demand=OnDemandOptions(
                        enabled=args.load_on_demand,
                        min_residency_s=args.load_on_demand_min_residency_s,
                        max_load_share=args.load_on_demand_max_load_share,
                        residency_factor=args.load_on_demand_residency_factor,
                        pending_s=args.load_on_demand_wait_s),
                    latency_model=args.latency_model == "on", ctx=ctx,
                    admin_token=os.environ.get("ZEROSERVE_ADMIN_TOKEN", ""),
                    tenants_path=Path(args.tenants) if args.tenants else None,
                    # the sampling settings every gateway follows (their file and mode
                    # are each gateway's own)
                    trace=TraceState.start(parse_config(args.trace_config or ())[0]),
                    lifecycle=LifecycleOptions(
                        watch=args.watch, debounce_s=args.watch_debounce_ms / 1000.0,
                        poll_s=args.watch_interval_s,
                        import_roots=tuple(Path(r) for r in args.import_root or ()),
                        control_mode=args.model_control_mode,
                        load_models=tuple(args.load_model or ()),
                        load_retry=RetryPolicy(max(1, args.load_retries),
                                               args.load_retry_base_s,
                                               args.load_retry_max_s)))
    if security is not None:
        security.register(broker.metrics.registry)
    return loop, broker


def run(args: argparse.Namespace) -> int:
    endpoints = options.endpoints(args)
    try:
        security = curve.server_security(args)
    except curve.CurveError as exc:
        logger.error("%s", exc)
        return 2
    if (why := check_exposure(endpoints, security)) is not None:
        logger.error("%s", why)
        return 2
    if args.load_model and args.model_control_mode != "explicit":
        logger.error("--load-model needs --model-control-mode explicit (the other modes "
                     "load every model folder)")
        return 2
    if (why := check_timing(args.heartbeat_s, args.worker_expiry_s)) is not None:
        logger.error("%s", why)
        return 2
    if min(args.load_on_demand_min_residency_s, args.load_on_demand_max_load_share,
           args.load_on_demand_residency_factor,
           args.load_on_demand_wait_s) < 0:
        logger.error("--load-on-demand-* options must be >= 0")
        return 2
    if args.response_cache_bytes < 0:
        logger.error("--response-cache-bytes must be >= 0 (0: no cache), got %d",
                     args.response_cache_bytes)
        return 2
    try:
        parse_config(args.trace_config or ())
    except TraceSettingError as exc:
        logger.error("%s", exc)
        return 2
    if args.tenants:
        try:
            tenants.load(Path(args.tenants))
        except tenants.TenantsError as exc:
            logger.error("%s", exc)
            return 2
    try:   # before the broker is built, so its own allocations are traced
        memtrace.start(os.environ)
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    folder = options.runtime_folder(args)
    lock = BrokerLock(folder)
    try:
        ensure_runtime_dir(folder)
        lock.acquire()
        owner = ServerLock(folder).holder()
        if owner is not None and owner != os.getppid():
            lock.release()
            raise RuntimeDirError(f"runtime folder {folder} belongs to the server of pid "
                                  f"{owner}; stop it or use another --runtime-dir")
    except (RuntimeDirError, OSError) as exc:
        logger.error("%s", exc)
        return 2
    try:
        return _serve(endpoints, Path(args.model_dir), args, security)
    finally:
        lock.release()


def _serve(endpoints: Endpoints, model_dir: Path, args: Any,
           security: curve.ServerSecurity | None = None) -> int:
    ctx: zmq.Context[Any] = zmq.Context()
    loop, broker = build(endpoints, model_dir, args, ctx, security)
    try:
        broker.load_catalog()
    except ValueError as exc:  # ConfigError: the repository folder is missing
        logger.error("%s", exc)
        loop.close(0)
        if security is not None:
            security.close()
        ctx.term()
        return 2
    # handlers only set a flag; the wakeup fd makes the poller return at once
    signal.set_wakeup_fd(loop.wakeup_fd)
    signal.signal(signal.SIGTERM, lambda *_: broker.request_stop())
    signal.signal(signal.SIGINT, lambda *_: broker.request_stop())
    signal.signal(signal.SIGHUP, lambda *_: broker.request_reload())
    broker.start(loop.poller)
    logger.info("broker listening: frontend %s, backend %s, control %s%s",
                endpoints.frontend, endpoints.backend, endpoints.control,
                " (CurveZMQ on tcp://)" if security is not None else "")
    try:
        loop.run(broker, broker.clock)
    finally:
        signal.set_wakeup_fd(-1)
        broker.close()
        loop.close()
        if security is not None:
            security.close()  # the authenticator's sockets, before the context ends
        ctx.term()  # blocks until the last answers have left (bounded by linger)
    logger.info("broker stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    return options.run_component("broker", run, argv)


if __name__ == "__main__":
    sys.exit(main())
