"""A batch sent to a busy worker waits there in a FIFO no priority reorders, so while a
model's requests mix priorities the broker sends one only while what the worker holds is
predicted short (requests.py, PREFETCH_S); with one priority it pipelines freely, except
that a CPU worker gets its second batch only once half a batch is queued
(CPU_PREFETCH_FRACTION). The real broker objects on a simulated clock
(tests/bench/simcluster.py)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.bench.simcluster import SimCluster, write_repo
from zeroserve.broker.server.dispatchgate import CPU_PREFETCH_FRACTION, PREFETCH_S


def held_at_worker(a_s: float, rate: float, mixed: bool = True,
                   device: str = "sim") -> list[float]:
    """How long each batch, sent once the latency model has learned, waited at the one
    worker (2 credits) before it started."""
    return [held for held, _ in held_and_size(a_s, rate, mixed, device)]


def held_and_size(a_s: float, rate: float, mixed: bool = True,
                  device: str = "sim") -> list[tuple[float, int]]:
    """Each batch's wait at the worker, and its size."""
    repo = write_repo({"m": {"max_batch_size": 8}})
    sim = SimCluster(repo, 1, a_s=a_s, c_s=0.0002, credits=2, load_s=0.01, device=device)
    if mixed:
        sim.priority = lambda n: 1 + n % 2
    try:
        rng = np.random.default_rng(3)
        sim.run(4.0, np.sort(rng.uniform(0.2, 4.0, int(rate * 3.8))), "m", 0.0)
        assert all(o.code == "" for o in sim.outcomes.values())
        (worker,) = sim.workers.values()
        return [(held, size) for (sent, held), size in zip(worker.waits, worker.sizes)
                if sent > 1.0]
    finally:
        sim.close(repo)


def test_long_batches_wait_in_the_broker_not_at_the_worker() -> None:
    held = held_at_worker(a_s=0.020, rate=300)      # 21.6 ms a batch of 8: near capacity
    assert len(held) > 50 and max(held) == 0.0


def test_with_one_priority_long_batches_are_pipelined_too() -> None:
    held = held_at_worker(a_s=0.020, rate=300, mixed=False)
    assert sum(h > 0 for h in held) > len(held) / 4


@pytest.mark.slow   # a simulated 2,500 requests/s
def test_short_batches_are_pipelined_to_hide_the_hop() -> None:
    held = held_at_worker(a_s=0.001, rate=2500)     # 2.6 ms a batch of 8
    assert 0.001 < PREFETCH_S
    assert sum(h > 0 for h in held) > len(held) / 4 and max(held) <= PREFETCH_S + 0.003


def test_a_cpu_worker_gets_a_second_batch_only_of_half_a_batch_or_more() -> None:
    # about 2 requests arrive during each 20 ms batch: most wait in the broker, and the
    # batches that did wait at the worker are the bursts of 4 or more
    cpu = held_and_size(a_s=0.020, rate=100, mixed=False, device="cpu")
    queued_there = [size for held, size in cpu if held > 0]
    assert len(cpu) > 50 and len(queued_there) < len(cpu) / 2
    assert queued_there and min(queued_there) >= CPU_PREFETCH_FRACTION * 8
    # an accelerator's worker is never left idle for them: small batches queue there too
    gpu = held_and_size(a_s=0.020, rate=100, mixed=False, device="cuda:0")
    assert sum(held > 0 and size < 4 for held, size in gpu) > len(gpu) / 4


def test_a_cpu_worker_is_pipelined_once_half_a_batch_waits() -> None:
    held = held_at_worker(a_s=0.020, rate=300, mixed=False, device="cpu")  # about 6 a batch
    assert sum(h > 0 for h in held) > len(held) / 4


def batch_sizes_of_bundles(a_s: float, c_s: float) -> list[int]:
    """Bundles of 8 requests arriving at once (what a client's loop turn sends as one
    message), one every 100 ms, to one idle worker with 2 credits."""
    repo = write_repo({"m": {"max_batch_size": 8}})
    sim = SimCluster(repo, 1, a_s=a_s, c_s=c_s, credits=2, load_s=0.01)
    try:
        sim.run(2.0, np.repeat(np.arange(0.1, 2.0, 0.1), 8), "m", 0.0)
        assert all(o.code == "" for o in sim.outcomes.values())
        (worker,) = sim.workers.values()
        return worker.sizes
    finally:
        sim.close(repo)


def test_a_bundle_is_split_over_two_credits_where_batching_gains_little() -> None:
    # 1 ms + 2 ms a sample: two batches of 4 cost 18 ms, one of 8 17 ms
    assert set(batch_sizes_of_bundles(0.001, 0.002)) == {4}
    # 20 ms + 0.2 ms a sample: two batches of 4 would cost 43 ms against 22 ms
    assert set(batch_sizes_of_bundles(0.020, 0.0002)) == {8}
