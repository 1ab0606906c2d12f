"""When a worker may be given a batch, and how large: the dispatch gating, a pure policy
beside the scheduler (time passed in, no sockets), tested like ``Scheduler.take``.

The scheduler decides *which* requests form a batch; this decides whether a worker that
has a free credit should take one now, or wait for its running batch's result, and
whether an idle worker with two credits gets the queue in two halves.
"""

from __future__ import annotations

import math
from typing import Callable

# A batch sent to a busy worker waits there, in a FIFO that neither priority nor deadline
# reorders: under 2x overload of cnn with two priorities, a second credit made
# high-priority requests wait a whole low-priority batch (about 20 ms): 56% of them were
# answered within a 50 ms deadline, 98% with this rule (measured, same run). So while a
# model's recent requests mix priorities, a busy worker gets a batch to queue only while
# what it holds is predicted to run this long at most: short batches (mlp: 2-3 ms) keep
# the pipelining that hides the hop to the worker, long ones wait in the broker's queue.
# With one priority the queue at the worker reorders nothing, and it keeps a closed loop's
# stages overlapping. Tenants count as priorities do: fair shares choose which tenant's
# rows go next, and a batch queued at the worker has chosen already (two tenants of
# 16- and 512-token texts on bert, shares by compute time: the short texts' p99 beside
# the flood was 536 ms, 53x alone, with a second long batch always waiting there).
PREFETCH_S = 0.005
MIXED_PRIORITIES_S = 10.0   # how long a model counts as seeing more than one priority
# Requests that arrive together (a client sends what one loop turn made as one message)
# would form one batch, and a closed loop then falls into step with it: the worker idles
# while the replies travel. An idle worker with two credits gets the queue in two halves
# instead, when two half batches are predicted to cost at most this much more than one
# whole (so where batching gains little, like cnn on a CPU, and never on a GPU model
# whose batch costs about the same at any size).
SPLIT_COST = 1.15
# A CPU worker with a batch running gets a second one only once at least this fraction
# of a full batch is queued. Held in the broker, a small batch grows while the worker's
# core runs the gateway and the broker of the same host; sent at once, it would wait at
# the worker just as long, as small. Measured on mlp (max batch 64) at C=64, same runs:
# HTTP 6,670 -> 6,950-7,110 req/s, the mean batch 24 -> 27, every process spending less
# a request; direct level (10,200-10,290 -> 10,360-10,400). Holding every batch until the
# result returns (a threshold of a whole batch) gained more over HTTP (7,070-7,530) but
# cost direct clients 4%, whose load turns round faster than the worker's idle moment.
# An accelerator's idle moment is lost, so a GPU worker always gets its second batch.
CPU_PREFETCH_FRACTION = 0.5


class DispatchGate:
    """Per model: whether its recent requests mix priorities or tenants (``note`` at
    admission), and the gating rules below. Holds one pair per model it has seen."""

    def __init__(self) -> None:
        # model -> (last (priority, tenant), mixed until)
        self._priorities: dict[str, tuple[tuple[int, str], float]] = {}

    def note(self, model: str, priority: int, now: float, tenant: str = "") -> None:
        seen = self._priorities.get(model)
        who = (priority, tenant)
        if seen is None:
            self._priorities[model] = (who, -math.inf)
        elif who != seen[0]:
            self._priorities[model] = (who, now + MIXED_PRIORITIES_S)

    def mixed(self, model: str, now: float) -> bool:
        return self._priorities.get(model, ((0, ""), -math.inf))[1] > now

    def may_send(self, model: str, now: float, busy: bool, on_cpu: bool,
                 work_s: Callable[[], float], queued: int, max_batch_size: int) -> bool:
        """Whether a worker with a free credit gets a batch now; ``busy``: it has a batch
        in flight, predicted to take ``work_s()`` in all (asked only when it matters: it
        sums over the worker's batches); ``queued``: samples waiting."""
        if busy and self.mixed(model, now) and work_s() > PREFETCH_S:
            return False   # its result frees it
        if busy and on_cpu and queued < CPU_PREFETCH_FRACTION * max_batch_size:
            return False   # likewise
        return True

    def split(self, model: str, now: float, busy: bool, free: int, queued: int,
              scale: float, predict: Callable[[float], float]) -> int | None:
        """Half the queue, for an idle worker that can take two batches, when batching
        gains little and a queued batch reorders nothing; else None (the model's cap).
        ``scale``: the queue's mean units a sample."""
        if busy or free < 2 or queued < 2 or self.mixed(model, now):
            return None
        half = (queued + 1) // 2
        whole = predict(queued * scale)
        if whole <= PREFETCH_S or \
                2 * predict(half * scale) > SPLIT_COST * whole:
            return None
        return half
