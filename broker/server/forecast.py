"""What the latency model predicts of the workers as they are now: when a worker is done
with what it holds, when a running batch counts as hung. Admission asks it whether a
deadline can be met, dispatch whether a worker may take more, and the results whether a
batch stalls the ones behind it; none of them owns it, so it stands alone."""

from __future__ import annotations

import math

from zeroserve.broker.server.latency import LatencyBook
from zeroserve.broker.server.pool import Batches, Inflight, WorkerPool, WorkerState

# A running batch counts as hung, and the batches queued behind it on its worker move to
# others, once it has run this many times its predicted time, and at least STALL_MIN_S
# (a model with no prediction yet, or one whose times swing, is not taken for hung).
STALL_FACTOR = 10.0
STALL_MIN_S = 1.0


class Forecast:
    def __init__(self, pool: WorkerPool, batches: Batches, latency: LatencyBook) -> None:
        self.pool = pool
        self.batches = batches
        self.latency = latency

    def soonest_free(self, workers: list[WorkerState], now: float) -> float:
        """When the first of ``workers`` is predicted to be done with what it has."""
        soonest = math.inf
        for w in workers:
            if not w.inflight:
                return now   # idle: none can be sooner
            soonest = min(soonest, self.busy_until(w, now))
        return soonest if workers else now

    def busy_until(self, worker: WorkerState, now: float) -> float:
        """When a worker is predicted to finish the batches it has (they run in order)."""
        cursor = now
        for i, batch_id in enumerate(worker.inflight):
            rec = self.batches.inflight[batch_id]
            run_s = self.latency.predictor(rec.model, worker.worker_id)(rec.units)
            cursor = max(cursor, rec.sent_s + run_s) if i == 0 else cursor + run_s
        return cursor

    def work_s(self, worker: WorkerState) -> float:
        """The predicted run time of every batch the worker holds, elapsed or not."""
        work = 0.0
        for batch_id in worker.inflight:
            rec = self.batches.inflight[batch_id]
            work += self.latency.predictor(rec.model, worker.worker_id)(rec.units)
        return work

    def stall_limit_s(self, worker: WorkerState, head: Inflight) -> float:
        predict = self.latency.predictor(head.model, worker.worker_id)
        return max(STALL_MIN_S, STALL_FACTOR * predict(head.units))

    def worker_gone(self, worker_id: str) -> None:
        """No worker of this id is registered any more: its measured times go."""
        if self.pool.by_id(worker_id) is None:
            self.latency.forget_worker(worker_id)


class Usage:
    """When each model last had a batch sent: dispatch writes it, eviction reads it."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def used(self, model: str, now: float) -> None:
        self._last[model] = now

    def last_used(self, model: str) -> float:
        return self._last.get(model, 0.0)
