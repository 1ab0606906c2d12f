"""The threads that run the batches of handlers that call models (workers/bls.py).

Such a batch may wait on a model that only this worker serves, so it must not hold the
compute thread: the compute thread hands it here and goes back to the broker's socket at
once. Each batch gets a thread of its own (idle ones are reused), never a place in a
bounded queue: a batch waiting for a thread would hold its credit while the threads
wait on calls that need that credit. The first call a batch makes tells the broker that
it waits (``Waiting``), and from then on it holds none of the worker's credits, so the
calls it waits on can be sent here and run by the compute thread. How many such batches
exist at once is bounded by what the broker admitted, not here.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

from zeroserve.broker import protocol as p
from zeroserve.models.loader import LoadedModel
from zeroserve.workers import bls

logger = logging.getLogger(__name__)

# far above what a broker admits to one model's handler at once; past it batches queue
# (and keep their credit) rather than the process running out of threads
MAX_THREADS = 1024
Job = Callable[[], None]


class CallerThreads:
    """``execute(loaded, batch)`` runs a batch and ``finish(batch, result, taken_ns)``
    sends its result, both from the caller thread; ``waiting(batch_id)`` tells the
    broker that the batch waits on calls."""

    def __init__(self, execute: Callable[[LoadedModel, p.Batch], p.BatchResult],
                 finish: Callable[[p.Batch, p.BatchResult, int], None],
                 waiting: Callable[[int], None]) -> None:
        self._execute = execute
        self._finish = finish
        self._waiting = waiting
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[Job] = queue.SimpleQueue()
        self._idle = 0      # threads waiting for a job, not yet promised one
        self.threads = 0

    def run(self, loaded: LoadedModel, batch: p.Batch, start_by: float, taken_ns: int) -> None:
        # the deadline the batch left the broker with is start_by; its items' budgets
        # count from the same instant
        received_s = start_by - batch.timeout_ms / 1000.0 if batch.timeout_ms > 0 \
            else time.monotonic()
        ctx = bls.context_of(batch, received_s, self._waiting)
        self._submit(lambda: self._call(loaded, batch, ctx, taken_ns))

    def _submit(self, job: Job) -> None:
        with self._lock:
            spawn = self._idle == 0 and self.threads < MAX_THREADS
            if spawn:
                self.threads += 1
            elif self._idle:
                self._idle -= 1   # promised to one of them: it takes the job from the queue
        if spawn:
            # daemons: a worker that exits must not wait on a handler waiting on a call
            threading.Thread(target=self._serve, args=(job,), daemon=True,
                             name=f"caller-{self.threads}").start()
        else:
            self._jobs.put(job)

    def _serve(self, job: Job) -> None:
        while True:
            job()
            del job
            with self._lock:
                self._idle += 1
            job = self._jobs.get()

    def _call(self, loaded: LoadedModel, batch: p.Batch, ctx: bls.CallContext,
              taken_ns: int) -> None:
        try:
            with bls.calling(ctx):
                result = self._execute(loaded, batch)
        except Exception as exc:  # never leave a batch unanswered
            logger.exception("batch %d of %s failed outside its model", batch.batch_id,
                             batch.model)
            result = p.BatchResult(batch.batch_id, [], 0.0, error=f"{type(exc).__name__}: {exc}")
        del loaded
        self._finish(batch, result, taken_ns)
