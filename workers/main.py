"""Entry point of ``zeroserve worker`` (also ``python -m zeroserve.workers.main``)."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
from typing import TYPE_CHECKING, Sequence

import torch

from zeroserve.broker import curve, options, traceconfig, tracing
from zeroserve.broker.liveness import AliveFile, alive_path
from zeroserve.broker.runtime import hostname
from zeroserve.workers import affinity
from zeroserve.workers.worker import Worker

if TYPE_CHECKING:
    from zeroserve.workers.spans import BatchSpans

logger = logging.getLogger(__name__)


def run(args: argparse.Namespace) -> int:
    endpoints = options.endpoints(args)
    endpoint = endpoints.backend
    worker_id = args.worker_id or f"{hostname()}/{args.index}"
    try:
        keys = curve.client_keys(args)
        curve.check_client(keys, endpoint)
        curve.check_client(keys, endpoints.frontend)   # handlers that call models use it
    except curve.CurveError as exc:  # said now, not from the socket thread later
        logger.error("%s", exc)
        return 2
    if args.cpus:
        try:   # before any thread starts: they inherit it
            affinity.pin(affinity.parse_cpus(args.cpus))
        except (ValueError, OSError) as exc:
            logger.error("--cpus %s: %s", args.cpus, exc)
            return 2
    try:
        spans = _spans(args.trace_config or (), worker_id)
    except traceconfig.TraceConfigError as exc:
        logger.error("%s", exc)
        return 2
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    worker = Worker(endpoint, worker_id, credits=args.credits, device=args.device,
                    memory_tolerance_bytes=getattr(args, "memory_tolerance_bytes", 64 << 20),
                    memory_budget_bytes=getattr(args, "memory_budget", 0),
                    memory_headroom_bytes=getattr(args, "memory_headroom", None),
                    host_cache_bytes=getattr(args, "host_cache_bytes", 1 << 30),
                    curve_keys=keys, spans=spans, frontend=endpoints.frontend,
                    alive=AliveFile(alive_path(options.runtime_folder(args), args.index)))
    worker.install_signal_handlers()
    # what lives as long as the process (torch's modules and ours, the context's first
    # operations) out of every later full collection: the gc.collect of each load and
    # unload then walks only what is new, 1 ms instead of ~90-180 ms (on the cold path)
    gc.freeze()
    # the device as the driver names it (a MIG slice's UUID, where one is pinned)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    logger.info("worker %s on %s%s, %d torch threads, cores %s, broker %s (pid %d)", worker_id,
                worker.device, f" (CUDA_VISIBLE_DEVICES={visible})" if visible else "",
                torch.get_num_threads(),
                affinity.format_cpus(list(os.sched_getaffinity(0))), endpoint, os.getpid())
    try:
        return worker.run()
    finally:
        if spans is not None:
            spans.close()   # what the exporter holds still goes out


def _spans(entries: Sequence[str], worker_id: str) -> BatchSpans | None:
    """In opentelemetry mode, what emits this worker's queue and batch spans."""
    config = traceconfig.parse_trace_config(entries)
    if config.mode != "opentelemetry":
        return None
    tracing.require_otel(config)
    from zeroserve.broker import otel
    from zeroserve.workers.spans import BatchSpans   # the optional SDK, in this mode only

    return BatchSpans(otel.Exporter(config.otel, "worker", follow_parent=True), worker_id)


def main(argv: list[str] | None = None) -> int:
    return options.run_component("worker", run, argv)


if __name__ == "__main__":
    sys.exit(main())
