"""The replica controller applied to a pool (broker/server/replicas.py): the real
broker objects on a simulated clock with simulated workers (tests/bench/simcluster.py),
so a burst of load and its end take a fraction of a second."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.bench.simcluster import SimCluster, write_repo
from tests.broker.rig import BrokerRig
from zeroserve.broker import protocol as p
from zeroserve.broker.server.replicas import gpu_utilization

TUNING = {"queue_slo_ms": 20, "window_s": 1, "down_window_s": 3, "up_cooldown_s": 1,
          "down_cooldown_s": 2}
GB = 1 << 30


def trace(*segments: tuple[float, float, float]) -> np.ndarray:
    """Poisson arrivals at a constant rate per (start s, end s, rate) segment."""
    rng = np.random.default_rng(7)
    return np.sort(np.concatenate([rng.uniform(a, b, rng.poisson(r * (b - a)))
                                   for a, b, r in segments]))


def cluster(instances: dict[str, Any], workers: int = 4, **kw: Any
            ) -> tuple[SimCluster, Any]:
    repo = write_repo({"m": {"max_batch_size": 8, "instances": instances,
                             "autoscaling": TUNING}, **kw.pop("more", {})})
    return SimCluster(repo, workers, a_s=0.010, c_s=0.001, load_s=0.5, **kw), repo


@pytest.mark.slow   # 30 simulated seconds of load
def test_burst_scales_up_then_down_and_every_request_is_answered() -> None:
    sim, repo = cluster({"min": 1, "max": 4})
    counts: list[tuple[float, int]] = []
    try:
        sim.run(30, trace((2, 5, 20), (5, 15, 1500), (15, 30, 20)), "m", 0.0, every_s=0.25,
                probe=lambda t: counts.append((t, len(sim.broker.pool.holders("m")))))
        assert max(n for t, n in counts if t < 5) == 1
        assert max(n for t, n in counts if 5 <= t < 15) >= 3
        assert counts[-1][1] == 1                       # back to min once the load left
        answers = list(sim.outcomes.values())
        assert answers and all(o.code == "" and o.done_s == o.done_s for o in answers)
        assert sim.unloads, "a replica was unloaded"
        for t, worker, model, busy_until in sim.unloads:
            assert busy_until <= t, f"{worker} unloaded {model} with a batch running"
        history = list(sim.broker.replicas.history["m"])
        assert [d["reason"] for d in history if d["action"] == "up"][:2] == \
            ["below_min", "queue_time"]
        assert {d["reason"] for d in history if d["action"] == "down"} == {"low_utilization"}
        metrics = sim.broker.metrics.render()
        assert 'zeroserve_autoscale_decisions_total{action="down",model="m",' \
               'reason="low_utilization"}' in metrics
    finally:
        sim.close(repo)


@pytest.mark.slow   # 8 simulated seconds of load
def test_no_worker_with_memory_holds_and_says_which_lacks_how_much() -> None:
    # every worker holds "filler" (1 GB); only sim/0 has room for "m" (1 GB) beside it
    sim, repo = cluster({"min": 1, "max": 4}, more={"filler": {}},
                        budget_bytes=[int(2.5 * GB)] + [int(1.5 * GB)] * 3,
                        footprints={"m": GB, "filler": GB})
    try:
        sim.run(8, trace((1, 8, 1500)), "m", 0.0)
        assert [w.worker_id for w in sim.broker.pool.holders("m")] == ["sim/0"]
        holds = [d for d in sim.broker.replicas.history["m"] if d["reason"] == "no_memory"]
        assert holds, list(sim.broker.replicas.history["m"])
        detail = holds[0]["detail"]
        # the device, what it has free after headroom, and what the version needs
        assert "on worker sim/" in detail and "MB free after" in detail, detail
        assert "m/1 needs 1.1 GB (measured on worker sim/0)" in detail, detail
        st = sim.broker.replicas.describe()["m"]
        assert st["replicas"] == ["sim/0"] and st["last"]["reason"] == "no_memory"
    finally:
        sim.close(repo)


def test_unbounded_models_stay_on_every_worker() -> None:
    sim, repo = cluster({})
    try:
        sim.run(3, trace((1, 3, 100)), "m", 0.0)
        assert len(sim.broker.pool.holders("m")) == 4
        assert sim.broker.replicas.describe() == {}
    finally:
        sim.close(repo)


@pytest.mark.slow   # 6 simulated seconds of load
def test_fixed_count_places_exactly_that_many() -> None:
    sim, repo = cluster({"count": 2})
    try:
        sim.run(6, trace((1, 6, 1500)), "m", 0.0)   # load does not move a fixed count
        assert len(sim.broker.pool.holders("m")) == 2
    finally:
        sim.close(repo)


def test_the_controller_reads_the_gpu_utilization_the_workers_heartbeat(tmp_path: Path
                                                                        ) -> None:
    """What each worker's driver last said (its heartbeat's ``gpu``), averaged over the
    replicas that report one: a CPU worker and a MIG slice (no utilization) count none."""
    rig = BrokerRig(tmp_path)
    states = [rig.worker(w, device=d) for w, d in
              (("h/0", "cuda:0"), ("h/1", "cuda:0"), ("h/2", "cpu"), ("h/3", "cuda:0"))]
    assert gpu_utilization(states) is None
    for wid, busy in (("h/0", 0.9), ("h/1", 0.5), ("h/3", None)):
        rig.from_worker(wid, p.WorkerHeartbeat({"gpu": {
            "utilization": busy, "memory_used_bytes": 1 << 30,
            "memory_total_bytes": 80 << 30}}, ""))
    assert gpu_utilization(states) == pytest.approx(0.7)
