"""A batch that waits on models its handler called (BLS) gives its worker's credit back
until its result, stays the broker's to answer, and goes with its worker when lost."""

from __future__ import annotations

from collections import Counter

from zeroserve.broker.server.pool import Loss
from tests.broker.test_request_path import Harness


def test_a_waiting_batch_frees_its_credit_and_is_still_answered() -> None:
    h = Harness(max_batch_size=1)
    h.worker("w0")
    for rid in "abc":
        h.request(rid)
    h.path.dispatch(h.now)
    first = h.batches()
    assert len(first) == 2            # two credits
    w0 = h.pool.get(b"w0")
    assert w0 is not None and w0.free == 0
    h.pool.batches.waits(w0, first[0][1].batch_id)
    assert w0.free == 1 and w0.waiting == {first[0][1].batch_id}
    h.path.dispatch(h.now)
    third = h.batches()
    assert len(third) == 1            # the freed credit took the third request
    for identity, batch in first + third:
        h.answer(identity, batch)
    assert h.answers() == Counter({"a": 1, "b": 1, "c": 1})
    assert set(h.codes().values()) == {"ok"}
    assert w0.free == 2 and not w0.waiting and not w0.inflight


def test_waits_for_a_batch_not_on_that_worker_changes_nothing() -> None:
    h = Harness(max_batch_size=1)
    h.worker("w0")
    h.worker("w1")
    h.request("a")
    h.path.dispatch(h.now)
    (identity, batch), = h.batches()
    other = h.pool.get(b"w1" if identity == b"w0" else b"w0")
    assert other is not None
    h.pool.batches.waits(other, batch.batch_id)
    h.pool.batches.waits(other, 12345)
    assert not other.waiting and other.free == 2
    h.answer(identity, batch)
    owner = h.pool.get(identity)
    assert owner is not None
    h.pool.batches.waits(owner, batch.batch_id)   # answered already
    assert not owner.waiting and owner.free == 2


def test_a_lost_workers_waiting_batch_is_answered_once() -> None:
    h = Harness(max_batch_size=1)
    h.worker("w0")
    h.request("a")
    h.path.dispatch(h.now)
    (_, batch), = h.batches()
    w0 = h.pool.get(b"w0")
    assert w0 is not None
    h.pool.batches.waits(w0, batch.batch_id)
    h.lose("w0", Loss.CRASHED)
    h.worker("w1")
    h.path.dispatch(h.now)
    for identity, retried in h.batches():
        h.answer(identity, retried)
    assert h.answers() == Counter({"a": 1})
    assert not h.pool.inflight


def test_a_leaving_worker_is_not_drained_while_a_batch_waits() -> None:
    h = Harness(max_batch_size=1)
    h.worker("w0")
    h.request("a")
    h.path.dispatch(h.now)
    (identity, batch), = h.batches()
    w0 = h.pool.get(identity)
    assert w0 is not None
    h.pool.batches.waits(w0, batch.batch_id)
    h.pool.leave(w0)
    assert list(h.pool.drained()) == []
    h.answer(identity, batch)
    assert list(h.pool.drained()) == [w0]


def test_a_waiting_batch_past_max_execution_fails_alone() -> None:
    """Off the compute thread, a batch waiting on its calls past max_execution_ms says
    nothing of the worker: its requests fail, the worker stays."""
    h = Harness(max_batch_size=1)
    h.worker("w0")
    h.request("a")
    h.request("b")
    h.path.dispatch(h.now)
    (ia, waiting), (ib, running) = h.batches()
    w0 = h.pool.get(ia)
    assert w0 is not None
    h.pool.batches.waits(w0, waiting.batch_id)
    h.now += 31.0   # past the default max_execution_ms (30 s)
    assert h.path.overdue(h.now) == [ib]     # only the one on the compute thread hangs it
    assert h.codes() == {"a": "deadline", "b": "deadline"}
    h.answer(ia, waiting)                    # its late result is dropped
    assert h.answers() == Counter({"a": 1, "b": 1})
