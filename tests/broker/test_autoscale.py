"""The replica controller (broker/server/autoscale.py): every branch of its decision
tree, its hysteresis, cool-downs and bounds, on a fake clock."""

from __future__ import annotations

from typing import Callable

import pytest

from zeroserve.broker.server.autoscale import DOWN, HOLD, UP, Controller, Decision, Sample, \
    ScalePolicy
from zeroserve.models.repository import ConfigError, parse_config

POLICY = ScalePolicy(min_replicas=1, max_replicas=4, queue_slo_s=0.1, window_s=2.0,
                     down_window_s=4.0, up_cooldown_s=3.0, down_cooldown_s=6.0,
                     low_utilization=0.3, high_utilization=0.7)


class Sim:
    """One model's controller fed at 20 Hz from a fake clock."""

    def __init__(self, policy: ScalePolicy = POLICY) -> None:
        self.now = 100.0
        self.c = Controller()
        self.c.set_policy("m", policy, self.now)

    def run(self, seconds: float, sample: Sample, rate_rps: float = 0.0) -> None:
        for _ in range(int(round(seconds / 0.05))):
            self.now += 0.05
            self.c.arrived("m", int(round(rate_rps * 0.05)))
            self.c.observe("m", self.now, sample)

    def decide(self, serving: int, loading: int = 0,
               room: Callable[[], tuple[str, str] | None] = lambda: None) -> Decision:
        return self.c.decide("m", self.now, serving, loading, room)

    def apply(self, d: Decision) -> Decision:
        self.c.applied("m", self.now, d.action)
        return d


def hot(replicas: int) -> Sample:
    return Sample(queue_s=0.3, depth=40, busy=replicas, replicas=replicas)


def idle(replicas: int) -> Sample:
    return Sample(queue_s=0.0, depth=0, busy=0, replicas=replicas)


def test_below_min_scales_up_at_once_without_a_window() -> None:
    s = Sim(ScalePolicy(min_replicas=2, max_replicas=4))
    d = s.decide(serving=0)
    assert (d.action, d.reason) == (UP, "below_min")
    assert s.decide(serving=1, loading=1).reason == "loading"  # loading counts toward min


def test_below_min_without_room_says_why() -> None:
    s = Sim(ScalePolicy(min_replicas=2))
    d = s.decide(serving=1, room=lambda: ("no_worker", "no other worker may hold it"))
    assert (d.action, d.reason, d.detail) == (HOLD, "no_worker",
                                             "no other worker may hold it")


def test_above_max_scales_down() -> None:
    s = Sim()
    d = s.decide(serving=5)
    assert (d.action, d.reason) == (DOWN, "above_max")


def test_loading_then_warming_up_hold() -> None:
    s = Sim()
    s.run(5, hot(1))
    assert s.decide(serving=1, loading=1).reason == "loading"
    fresh = Sim()
    fresh.run(1.0, hot(1))  # less than window_s of history
    assert fresh.decide(serving=1).reason == "warming_up"


def test_queue_time_over_slo_scales_up() -> None:
    s = Sim()
    s.run(2.5, hot(1))
    d = s.decide(serving=1)
    assert (d.action, d.reason) == (UP, "queue_time")
    assert d.signals.queue_s == pytest.approx(0.3)
    assert d.signals.utilization == pytest.approx(1.0)


def test_queue_under_slo_holds_steady() -> None:
    s = Sim()
    s.run(5, Sample(queue_s=0.05, depth=3, busy=1, replicas=1))
    assert s.decide(serving=1).reason == "steady"


def test_queue_depth_per_replica_scales_up_when_enabled() -> None:
    deep = Sample(queue_s=0.02, depth=50, busy=2, replicas=2)
    s = Sim(ScalePolicy(max_replicas=4, window_s=2.0, depth_per_replica=10))
    s.run(2.5, deep)
    assert (s.decide(serving=2).action, s.decide(serving=2).reason) == (UP, "queue_depth")
    off = Sim()
    off.run(2.5, deep)
    assert off.decide(serving=2).reason == "steady"


def test_at_max_holds() -> None:
    s = Sim()
    s.run(2.5, hot(4))
    assert (s.decide(serving=4).action, s.decide(serving=4).reason) == (HOLD, "at_max")


def test_queue_without_busy_replicas_is_not_a_capacity_problem() -> None:
    s = Sim()
    s.run(2.5, Sample(queue_s=0.5, depth=5, busy=0, replicas=2))  # e.g. max_queue_delay
    assert s.decide(serving=2).reason == "queue_not_busy"


def test_no_memory_holds_with_the_placement_message() -> None:
    s = Sim()
    s.run(2.5, hot(1))
    d = s.decide(serving=1, room=lambda: ("no_memory", "cuda:0 lacks 512.0 MB"))
    assert (d.action, d.reason, d.detail) == (HOLD, "no_memory", "cuda:0 lacks 512.0 MB")


def test_room_is_asked_only_when_a_replica_would_be_added() -> None:
    asked = []
    s = Sim()
    s.run(5, idle(1))
    s.decide(serving=1, room=lambda: asked.append(1) or None)  # type: ignore[func-returns-value]
    assert asked == []


def test_up_cooldown_after_an_up() -> None:
    s = Sim()
    s.run(2.5, hot(1))
    assert s.apply(s.decide(serving=1)).action == UP
    s.run(1.0, hot(2))
    assert s.decide(serving=2).reason == "cooldown"     # 3 s after the last up
    s.run(2.1, hot(2))
    assert s.decide(serving=2).action == UP


def capacity(sample: Sample, rps: float) -> Sample:
    return Sample(sample.queue_s, sample.depth, sample.busy, sample.replicas, rps)


def test_up_adds_the_replicas_the_latency_model_says_are_needed() -> None:
    # 500 req/s offered and a 40-deep backlog (drained over the 2 s window: 20 req/s);
    # one replica does 100 req/s at full batches: at 0.7 that is ceil(520 / 70) = 8
    s = Sim(ScalePolicy(max_replicas=16, window_s=2.0))
    s.run(2.5, capacity(hot(1), 100.0), rate_rps=500)
    d = s.decide(serving=1)
    assert (d.action, d.reason, d.count) == (UP, "queue_time", 7)
    capped = Sim(ScalePolicy(max_replicas=4, window_s=2.0))
    capped.run(2.5, capacity(hot(1), 100.0), rate_rps=500)
    assert capped.decide(serving=1).count == 3            # never above max


def test_enough_replicas_and_a_shrinking_backlog_hold() -> None:
    s = Sim()
    s.run(1.5, capacity(Sample(0.3, 80, 2, 2), 400.0), rate_rps=100)
    s.run(1.0, capacity(Sample(0.3, 20, 2, 2), 400.0), rate_rps=100)
    assert s.decide(serving=2).reason == "draining"
    growing = Sim()
    growing.run(1.5, capacity(Sample(0.3, 20, 2, 2), 400.0), rate_rps=100)
    growing.run(1.0, capacity(Sample(0.3, 80, 2, 2), 400.0), rate_rps=100)
    assert growing.decide(serving=2).action == UP          # the model is too optimistic


def test_down_by_half_the_excess_the_latency_model_sees() -> None:
    # 8 replicas, busy 40 % of the time on small batches, but 80 req/s needs only
    # ceil(80 / (100 * 0.5)) = 2 of them: half the excess (3) goes in one step
    s = Sim(ScalePolicy(max_replicas=16, window_s=2, down_window_s=4, down_cooldown_s=0))
    busy = [capacity(Sample(0.0, 0, b, 8), 100.0) for b in (3, 4, 3, 3)]
    for i in range(90):
        s.run(0.05, busy[i % 4], rate_rps=80)
    d = s.decide(serving=8)
    assert (d.action, d.reason, d.count) == (DOWN, "low_utilization", 3)


def test_low_utilization_scales_down_after_the_down_window() -> None:
    s = Sim()
    s.run(3.0, idle(2))
    assert s.decide(serving=2).reason == "steady"   # window_s full, down_window_s not yet
    s.run(1.5, idle(2))
    d = s.decide(serving=2)
    assert (d.action, d.reason) == (DOWN, "low_utilization")


def test_never_below_min() -> None:
    s = Sim(ScalePolicy(min_replicas=2, max_replicas=4, window_s=2, down_window_s=4))
    s.run(10, idle(2))
    assert s.decide(serving=2).reason == "steady"


def test_hysteresis_no_removal_that_would_overload_the_rest() -> None:
    # both cases are under low_utilization (0.3); what differs is what the rest would
    # carry: 0.25 on 4 -> 0.33 on 3 (under high 0.45: removed); 0.25 on 2 -> 0.5 on 1
    pol = ScalePolicy(max_replicas=4, window_s=2, down_window_s=4, low_utilization=0.3,
                      high_utilization=0.45, down_cooldown_s=0)
    s = Sim(pol)
    s.run(5, Sample(queue_s=0.0, depth=0, busy=1, replicas=4))  # 0.25 each
    assert s.decide(serving=4).action == DOWN
    s2 = Sim(pol)
    # 0 and 1 busy of 2 in turn: utilization 0.25
    for i in range(100):
        s2.run(0.05, Sample(0.0, 0, i % 2, 2))
    assert s2.decide(serving=2).reason == "would_overload"


def test_queue_time_hysteresis_band_blocks_removal() -> None:
    s = Sim()
    s.run(5, Sample(queue_s=0.07, depth=1, busy=0, replicas=2))  # under the SLO, over half
    assert s.decide(serving=2).reason == "steady"


def test_rising_arrivals_block_removal() -> None:
    s = Sim()
    s.run(3.5, idle(2), rate_rps=20)
    s.run(1.0, idle(2), rate_rps=200)   # the later half of the 2 s window is 10x busier
    d = s.decide(serving=2)
    assert d.reason == "arrivals_rising" and d.signals.arrival_trend > 1.5


def test_down_cooldown_after_any_change() -> None:
    pol = ScalePolicy(max_replicas=4, window_s=1, down_window_s=2, down_cooldown_s=5,
                      up_cooldown_s=0)
    s = Sim(pol)
    s.run(1.5, hot(1))
    assert s.apply(s.decide(serving=1)).action == UP
    s.run(3, idle(2))                     # windows full again, but within 5 s of the up
    assert s.decide(serving=2).reason == "cooldown"
    s.run(2.1, idle(2))
    assert s.apply(s.decide(serving=2)).action == DOWN


def test_no_flapping_under_steady_moderate_load() -> None:
    """Load that one replica runs at 60 % and two at 30 %: from two it goes down to one
    (0.6 < high 0.7) and then stays there; nothing oscillates over a minute."""
    s = Sim(ScalePolicy(max_replicas=4, window_s=2, down_window_s=4, up_cooldown_s=2,
                        down_cooldown_s=4))
    replicas, actions = 2, []
    for i in range(240):   # 60 s in 0.25 s steps
        busy_frac = min(1.0, 0.6 / replicas)
        for k in range(5):
            busy = 1 if ((i * 5 + k) % 10) < busy_frac * 10 * replicas / max(replicas, 1) \
                else 0
            s.run(0.05, Sample(0.01, 0, min(busy * replicas, replicas), replicas))
        d = s.apply(s.decide(serving=replicas))
        if d.action != HOLD:
            actions.append(d.action)
            replicas += 1 if d.action == UP else -1
    assert actions == [DOWN] and replicas == 1


def test_window_mean_is_time_weighted() -> None:
    s = Sim()
    s.run(1.0, Sample(0.4, 1, 1, 1))
    s.run(1.0, Sample(0.0, 0, 0, 1))
    sig = s.c.signals("m", s.now)
    assert sig.queue_s == pytest.approx(0.2, abs=0.01)
    assert sig.utilization == pytest.approx(0.5, abs=0.03)


def test_policy_from_config() -> None:
    base = {"name": "m", "platform": "pytorch_torchscript",
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [4]}],
            "outputs": [{"name": "y", "datatype": "FP32", "shape": [3]}]}
    cfg = parse_config(base, "t")
    assert ScalePolicy.of(cfg.instances, cfg.autoscaling) is None   # every worker, as before
    cfg = parse_config({**base, "instances": {"min": 1, "max": 2},
                        "autoscaling": {"queue_slo_ms": 20, "window_s": 1}}, "t")
    pol = ScalePolicy.of(cfg.instances, cfg.autoscaling)
    assert pol is not None and (pol.min_replicas, pol.max_replicas) == (1, 2)
    assert pol.queue_slo_s == pytest.approx(0.02) and pol.window_s == 1
    assert parse_config(cfg.to_json(), "t") == cfg
    fixed = parse_config({**base, "instances": {"count": 3}}, "t")
    pol = ScalePolicy.of(fixed.instances, fixed.autoscaling)
    assert pol is not None and pol.fixed and pol.min_replicas == 3
    only_max = parse_config({**base, "instances": {"max": 3}}, "t")
    pol = ScalePolicy.of(only_max.instances, only_max.autoscaling)
    assert pol is not None and pol.min_replicas == 1
    for bad in ({"instances": {"min": 3, "max": 2}}, {"instances": {"count": 2, "max": 3}},
                {"instances": {"replicas": 2}}, {"autoscaling": {"low_utilization": 0.9}},
                {"autoscaling": {"nope": 1}}):
        with pytest.raises(ConfigError):
            parse_config({**base, **bad}, "t")


def test_gpu_utilization_is_a_time_weighted_input_over_the_samples_that_carry_it() -> None:
    s = Sim()
    s.run(1.0, Sample(0.0, 0, 1, 1))   # CPU workers, or no nvidia-ml-py: no figure
    assert s.c.signals("m", s.now).gpu_utilization is None
    s.run(0.5, Sample(0.0, 0, 1, 1, gpu_utilization=0.9))
    s.run(0.5, Sample(0.0, 0, 1, 1, gpu_utilization=0.3))
    assert s.c.signals("m", s.now).gpu_utilization == pytest.approx(0.6, abs=0.04)


@pytest.mark.parametrize("gpu", [0.0, 0.5, 1.0])
def test_gpu_utilization_changes_no_decision_yet(gpu: float) -> None:
    """An input the controller reads and reports; its decisions stay those of the tree."""
    def decisions(with_gpu: bool) -> list[tuple[str, str]]:
        s = Sim()
        got = []
        for load in [hot(1), hot(1), idle(2), idle(2), idle(2), hot(2)] * 2:
            sample = Sample(load.queue_s, load.depth, load.busy, load.replicas,
                            gpu_utilization=gpu if with_gpu else None)
            s.run(1.5, sample, rate_rps=50)
            d = s.apply(s.decide(serving=load.replicas))
            got.append((d.action, d.reason))
        return got
    assert decisions(True) == decisions(False)
