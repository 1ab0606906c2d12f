"""sha256 of version folders, off the broker's loop: a thread hashes (hashlib releases
the GIL on large buffers) and sends each result back through an inproc socket that the
broker's zmq.Poller watches, so a multi-GB model never stalls requests."""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from pathlib import Path
from typing import Any

import msgpack
import zmq

from zeroserve.models.repository import version_sha256

logger = logging.getLogger(__name__)

_STOP = None


class Hasher:
    def __init__(self, ctx: zmq.Context[Any]) -> None:
        self.ctx = ctx
        self._endpoint = f"inproc://zeroserve-hasher-{id(self)}"
        self.results = ctx.socket(zmq.PULL)
        self.results.setsockopt(zmq.LINGER, 0)
        self.results.bind(self._endpoint)
        self._jobs: queue.Queue[Any] = queue.Queue()
        self._ids = itertools.count(1)
        self._thread = threading.Thread(target=self._run, name="hasher", daemon=True)
        self._thread.start()

    def submit(self, model: str, versions: dict[int, Path]) -> int:
        """Queue a job; its result arrives on ``results`` as {job, model, shas, errors}."""
        job = next(self._ids)
        self._jobs.put((job, model, versions))
        return job

    def register(self, poller: zmq.Poller) -> None:
        """The loop wakes when a result arrives (then :meth:`receive` takes them)."""
        poller.register(self.results, zmq.POLLIN)

    def ready(self, events: dict[Any, int]) -> bool:
        return self.results in events

    def receive(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while True:
            try:
                raw = self.results.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            out.append(msgpack.unpackb(raw, strict_map_key=False))

    def _run(self) -> None:
        push = self.ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(self._endpoint)
        try:
            while (job := self._jobs.get()) is not _STOP:
                job_id, model, versions = job
                shas, errors = {}, {}
                for version, path in versions.items():
                    try:
                        shas[version] = version_sha256(path)
                    except OSError as exc:  # the folder went away while we read it
                        errors[version] = str(exc)
                push.send(msgpack.packb({"job": job_id, "model": model, "shas": shas,
                                         "errors": errors}))
        finally:
            push.close(linger=0)

    def close(self) -> None:
        self._jobs.put(_STOP)
        self._thread.join(5.0)
        self.results.close(linger=0)
