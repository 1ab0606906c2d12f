"""Liveness: ``zeroserve probe broker|worker``, what a Kubernetes ``livenessProbe`` runs
in the broker's and the workers' containers, failing when the process is alive but its
loop no longer turns (a process that exits needs no probe: the container ends).

The broker is asked a control verb: only a turn of its loop answers one, so a broker
stopped, deadlocked or stuck in a long call fails the probe after ``--timeout``. A
worker's main loop touches ``worker-<index>.alive`` in the runtime folder at each of its
heartbeats (the broker sets their pace, under a second by default); the probe fails
when the file is older than ``--max-age-s``. The worker is not asked through the
broker, so a broker down does not make every worker's probe fail and restart it too.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

logger = logging.getLogger(__name__)


def alive_path(runtime: Path, index: int) -> Path:
    return runtime / f"worker-{index}.alive"


class AliveFile:
    """A file whose modification time says when the loop last turned."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._failed = False

    def beat(self) -> None:
        try:
            try:
                os.utime(self.path)
            except FileNotFoundError:
                self.path.touch()
        except OSError as exc:
            if not self._failed:   # once: the probe will say the rest
                logger.warning("cannot touch %s for the liveness probe: %s", self.path, exc)
            self._failed = True


def probe_worker(path: Path, max_age_s: float, now: float | None = None) -> str:
    """Why the worker fails its probe, or "" when it passes."""
    try:
        age_s = (time.time() if now is None else now) - path.stat().st_mtime
    except OSError as exc:
        return f"no heartbeat file: {exc}"
    if age_s > max_age_s:
        return f"its loop last turned {age_s:.1f} s ago (more than {max_age_s:g} s)"
    return ""


def probe_broker(control: str, timeout_s: float) -> str:
    from zeroserve.broker.admin import admin_token
    from zeroserve.broker.client import Client, InferError

    try:
        with Client(control, timeout_s=timeout_s, connect_timeout_s=timeout_s,
                    admin_token=admin_token()) as client:
            client.control("status")
    except InferError as exc:
        return f"{exc.code.value}: {exc.message}"
    return ""


def run(args: argparse.Namespace) -> int:
    from zeroserve.broker import options

    if args.role == "broker":
        why = probe_broker(options.endpoints(args).control, args.timeout)
    else:
        why = probe_worker(alive_path(options.runtime_folder(args), args.index),
                           args.max_age_s)
    if why:
        print(f"zeroserve probe {args.role}: {why}", file=sys.stderr)
        return 1
    return 0
