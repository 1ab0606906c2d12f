"""The dispatch gating (broker/server/dispatchgate.py) with a fake clock: when a worker
with a free credit gets a batch, and when an idle one gets the queue in two halves."""

from __future__ import annotations

from zeroserve.broker.server.dispatchgate import CPU_PREFETCH_FRACTION, MIXED_PRIORITIES_S, \
    PREFETCH_S, DispatchGate


def linear(per_sample_s: float, fixed_s: float = 0.0):  # noqa: ANN201
    return lambda units: fixed_s + per_sample_s * units


def test_an_idle_worker_always_gets_a_batch() -> None:
    g = DispatchGate()
    assert g.may_send("m", 0.0, busy=False, on_cpu=True, work_s=lambda: 99.0, queued=1,
                      max_batch_size=64)


def test_a_busy_cpu_worker_waits_for_half_a_batch_a_gpu_one_does_not() -> None:
    g = DispatchGate()
    few = int(CPU_PREFETCH_FRACTION * 64) - 1
    assert not g.may_send("m", 0.0, True, True, lambda: 0.0, few, 64)
    assert g.may_send("m", 0.0, True, True, lambda: 0.0, few + 1, 64)
    assert g.may_send("m", 0.0, True, False, lambda: 0.0, 1, 64)


def test_mixed_priorities_hold_a_long_batch_back_for_a_while() -> None:
    g = DispatchGate()
    g.note("m", 1, 0.0)
    asked: list[bool] = []

    def work() -> float:
        asked.append(True)
        return PREFETCH_S * 4

    assert g.may_send("m", 0.0, True, False, work, 64, 64) and not asked   # one priority
    g.note("m", 2, 1.0)
    assert g.mixed("m", 1.0) and not g.may_send("m", 1.0, True, False, work, 64, 64)
    assert g.may_send("m", 1.0, True, False, lambda: PREFETCH_S / 2, 64, 64)
    later = 1.0 + MIXED_PRIORITIES_S + 0.1
    assert not g.mixed("m", later) and g.may_send("m", later, True, False, work, 64, 64)


def test_mixed_tenants_hold_a_long_batch_back_as_priorities_do() -> None:
    """Fair shares pick a tenant when a batch is taken: one queued at the worker has
    picked already, so a second tenant at the same priority holds it back too."""
    g = DispatchGate()
    g.note("m", 1, 0.0, "long")
    g.note("m", 1, 0.5, "long")
    assert not g.mixed("m", 0.5)
    g.note("m", 1, 1.0, "short")
    assert g.mixed("m", 1.0)
    assert not g.may_send("m", 1.0, True, False, lambda: PREFETCH_S * 4, 64, 64)


def test_an_idle_worker_with_two_credits_gets_half_where_batching_gains_little() -> None:
    g = DispatchGate()
    cnn_like = linear(0.004)            # time grows with the batch: halves cost the same
    mlp_like = linear(0.0001, 0.002)    # a fixed cost dominates: one batch is cheaper
    assert g.split("m", 0.0, busy=False, free=2, queued=16, scale=1.0,
                   predict=cnn_like) == 8
    assert g.split("m", 0.0, False, 2, 16, 1.0, mlp_like) is None
    assert g.split("m", 0.0, True, 2, 16, 1.0, cnn_like) is None        # busy
    assert g.split("m", 0.0, False, 1, 16, 1.0, cnn_like) is None       # one credit
    assert g.split("m", 0.0, False, 2, 1, 1.0, cnn_like) is None        # one sample
    g.note("m", 1, 0.0)
    g.note("m", 2, 0.0)
    assert g.split("m", 0.0, False, 2, 16, 1.0, cnn_like) is None       # mixed priorities


def test_the_split_prices_by_units_not_rows() -> None:
    g = DispatchGate()
    # 4 rows of short sequences: under the prefetch bound, kept whole; the same rows 64
    # tokens long cost enough to be split
    assert g.split("m", 0.0, False, 2, 4, 1.0, linear(0.001)) is None
    assert g.split("m", 0.0, False, 2, 4, 64.0, linear(0.001)) == 2
