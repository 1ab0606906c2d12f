"""Entry point of ``zeroserve worker``."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from zeroserve.workers.worker import Worker

logger = logging.getLogger(__name__)


def run_worker(endpoint: str, worker_id: str, args: Any) -> int:
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    worker = Worker(endpoint, worker_id, credits=args.credits, device=args.device,
                    memory_tolerance_bytes=getattr(args, "memory_tolerance_bytes", 64 << 20),
                    memory_budget_bytes=getattr(args, "memory_budget", 0))
    worker.install_signal_handlers()
    logger.info("worker %s on %s, %d torch threads, broker %s (pid %d)", worker_id,
                worker.device, torch.get_num_threads(), endpoint, os.getpid())
    return worker.run()
