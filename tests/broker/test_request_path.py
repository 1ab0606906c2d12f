"""The request path, the scheduler and the worker pool together, without sockets: the
outboxes are lists and the clock is a number. Exactly one answer per request, never
in two places, never dispatched after its deadline, whatever happens to workers."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from zeroserve.broker import protocol as p
from zeroserve.broker.server.catalog import Catalog
from zeroserve.broker.server.latency import LatencyBook
from zeroserve.broker.server.metrics import BrokerMetrics
from zeroserve.broker.server.pool import Loss, WorkerPool
from zeroserve.broker.server.scheduler import Scheduler
from zeroserve.broker.server.types import ModelVersion
from zeroserve.models.repository import RepoModel, parse_config
from tests.broker.rig import RequestPath
from tests.conftest import examples, linear_config


class Harness:
    def __init__(self, max_batch_size: int = 4, delay_ms: float = 0.0) -> None:
        self.now = 0.0
        self.to_workers: list[tuple[bytes, list[Any]]] = []
        self.to_clients: list[tuple[bytes, list[Any]]] = []
        self.catalog = Catalog(Path("/nonexistent"))
        batching = {"dynamic_batching": {"max_queue_delay_ms": delay_ms}} if delay_ms else {}
        cfg = parse_config(linear_config("m", mbs=max_batch_size, **batching), "test")
        model, _ = self.catalog.commit(RepoModel(cfg, Path("/nonexistent/m"), (1,)), {}, {1})
        self.scheduler = Scheduler()
        self.scheduler.set_policy("m", model.policy())
        self.pool = WorkerPool(self._to_worker, lambda: self.now)
        self.path = RequestPath(self.catalog, self.scheduler, self.pool,
                                LatencyBook(enabled=False), BrokerMetrics(), self._to_client)

    def _to_worker(self, identity: bytes, frames: list[Any]) -> bool:
        self.to_workers.append((identity, frames))
        return True

    def _to_client(self, identity: bytes, frames: list[Any]) -> bool:
        self.to_clients.append((identity, frames))
        return True

    def worker(self, name: str) -> None:
        ready = p.WorkerReady(name, credits=2, models=[["m", 1]])
        self.pool.register(name.encode(), ready, self.now)

    def request(self, rid: str, timeout_ms: float = 0.0) -> None:
        req = p.InferRequest(rid, "m", [p.from_numpy("input", np.ones((1, 4), np.float32))],
                             timeout_ms=timeout_ms)
        kind, header, bufs = p.unpack([bytes(f) for f in p.encode_request(req)])
        self.path.on_request(b"client", header, bufs, self.now)

    def batches(self) -> list[tuple[bytes, p.Batch]]:
        out = []
        for identity, frames in self.to_workers:
            kind, header, bufs = p.unpack([bytes(f) for f in frames])
            if kind is p.Kind.BATCH:
                out.append((identity, p.decode_batch(header, bufs)))
        self.to_workers.clear()
        return out

    def answer(self, identity: bytes, batch: p.Batch) -> None:
        result = p.BatchResult(batch.batch_id, [
            p.InferReply(item.request_id, batch.model, batch.version, item.tensors)
            for item in batch.items], 1.0)
        kind, header, bufs = p.unpack([bytes(f) for f in p.encode_result(result)])
        worker = self.pool.get(identity)
        assert worker is not None
        self.path.on_result(worker, header, bufs, self.now)

    def lose(self, name: str, loss: Loss) -> None:
        worker = self.pool.get(name.encode())
        assert worker is not None
        self.path.worker_lost(self.pool.remove(worker, loss), loss, name, self.now)

    def answers(self) -> Counter[str]:
        got: Counter[str] = Counter()
        for _, frames in self.to_clients:
            _, header, _ = p.unpack([bytes(f) for f in frames])
            got[header["id"]] += 1
        return got

    def codes(self) -> dict[str, str]:
        out = {}
        for _, frames in self.to_clients:
            kind, header, _ = p.unpack([bytes(f) for f in frames])
            out[header["id"]] = "ok" if kind is p.Kind.REPLY else header["code"]
        return out


def test_a_retried_request_is_taken_once_not_twice() -> None:
    """The broker crashed here: a retry put a request back while its old heap entry was
    still queued, so the next take met it twice (KeyError in Scheduler.take)."""
    h = Harness()
    h.worker("w0")
    h.worker("w1")
    for rid in "abc":
        h.request(rid)
    h.path.dispatch(h.now)
    sent = h.batches()
    assert sum(len(b.items) for _, b in sent) == 3
    for identity, _ in sent:
        h.lose(identity.decode(), Loss.CRASHED)
        break
    h.path.dispatch(h.now)
    h.path.dispatch(h.now)
    for identity, batch in sent[1:] + h.batches():
        if h.pool.get(identity) is not None:
            h.answer(identity, batch)
    assert h.answers() == Counter({"a": 1, "b": 1, "c": 1})
    assert set(h.codes().values()) == {"ok"}


def test_the_running_batch_of_a_silent_worker_is_not_retried_elsewhere() -> None:
    h = Harness(max_batch_size=1)
    h.worker("w0")
    h.request("poison")
    h.request("innocent")
    h.path.dispatch(h.now)
    assert [len(b.items) for _, b in h.batches()] == [1, 1]
    h.worker("w1")
    h.lose("w0", Loss.SILENT)
    h.path.dispatch(h.now)
    retried = h.batches()
    assert [b.items[0].request_id for _, b in retried] == ["0"]  # one batch moved to w1
    h.answer(*retried[0])
    assert h.codes() == {"poison": "worker_lost", "innocent": "ok"}


def test_a_late_result_from_a_worker_presumed_dead_is_dropped() -> None:
    h = Harness()
    h.worker("w0")
    h.request("r")
    h.path.dispatch(h.now)
    ((identity, batch),) = h.batches()
    h.lose("w0", Loss.CRASHED)            # no holder left: answered worker_lost
    h.worker("w0")                        # it comes back under the same identity
    h.answer(identity, batch)             # and sends the old result
    assert h.answers() == Counter({"r": 1})


class RequestsAndWorkers(RuleBasedStateMachine):
    """Random interleavings of arrivals, dispatch, results, cancels, expiry and worker
    losses, checked after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.h = Harness()
        self.sent: list[str] = []
        self.batches: dict[int, tuple[bytes, p.Batch, float]] = {}
        self.deadlines: dict[str, float] = {}
        self.next_worker = 0

    @rule()
    def add_worker(self) -> None:
        self.h.worker(f"w{self.next_worker}")
        self.next_worker += 1

    @rule(timeout_ms=st.sampled_from([0.0, 5.0, 50.0, 500.0]))
    def add_request(self, timeout_ms: float) -> None:
        rid = f"r{len(self.sent)}"
        self.sent.append(rid)
        self.deadlines[rid] = self.h.now + timeout_ms / 1000.0 if timeout_ms else math.inf
        self.h.request(rid, timeout_ms)

    @rule()
    def dispatch(self) -> None:
        self.h.path.dispatch(self.h.now)
        for identity, batch in self.h.batches():
            self.batches[batch.batch_id] = (identity, batch, self.h.now)
            rec = self.h.pool.inflight[batch.batch_id]
            for entry in rec.entries.values():   # never dispatched after its deadline
                assert self.h.now < self.deadlines[str(entry.key[1])]

    @rule(data=st.data())
    def result(self, data: st.DataObject) -> None:
        if not self.batches:
            return
        batch_id = data.draw(st.sampled_from(sorted(self.batches)))
        identity, batch, _ = self.batches.pop(batch_id)
        worker = self.h.pool.get(identity)
        if worker is not None:   # a result from a removed worker never reaches the path
            self.h.answer(identity, batch)

    @rule(data=st.data(), loss=st.sampled_from(list(Loss)))
    def lose_worker(self, data: st.DataObject, loss: Loss) -> None:
        names = sorted(w.worker_id for w in self.h.pool.workers.values())
        if names:
            self.h.lose(data.draw(st.sampled_from(names)), loss)

    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        if self.sent:
            self.h.path.on_cancel(b"client", data.draw(st.sampled_from(self.sent)))

    @rule(dt=st.sampled_from([0.001, 0.01, 0.1]))
    def advance(self, dt: float) -> None:
        self.h.now += dt
        self.h.path.expire(self.h.now)

    @invariant()
    def one_answer_each(self) -> None:
        assert all(n == 1 for n in self.h.answers().values()), self.h.answers()

    @invariant()
    def in_one_place(self) -> None:
        queued = {e.key for name in self.h.scheduler.models_waiting()
                  for e in self.h.scheduler.queued(name)}
        running = [e.key for rec in self.h.pool.inflight.values() for e in rec.entries.values()]
        assert len(running) == len(set(running)), "a request on two workers"
        assert not queued & set(running), "a request queued and running at once"
        answered = {(b"client", rid) for rid in self.h.answers()}
        assert not answered & (queued | set(running)), "answered yet still held"
        assert self.h.path.open_count() == len(queued) + len(running)

    @invariant()
    def bounded_by_the_live(self) -> None:
        """Lazily cleaned structures hold at most twice the live requests, and a margin."""
        census, live = self.h.path.census(), self.h.path.open_count()
        for name in ("scheduler.fifo", "scheduler.arrivals", "scheduler.fair_heaps",
                     "scheduler.deadlines"):
            assert census[name] <= 2 * live + 130, (name, census, live)

    def teardown(self) -> None:
        self.h.path.fail_everything(p.ErrorCode.UNAVAILABLE, "end of the run")
        got = self.h.answers()
        assert set(got) == set(self.sent), set(self.sent) - set(got)
        assert all(n == 1 for n in got.values())
        census = self.h.path.census()
        assert not any(census.values()), census


TestRequestsAndWorkers = RequestsAndWorkers.TestCase
TestRequestsAndWorkers.settings = settings(max_examples=examples(400), stateful_step_count=50)


def test_requests_for_unknown_models_count_under_one_series() -> None:
    """Refusals were counted under the name the client sent: naming models at random grew
    a metric series, and the broker's memory, per name."""
    h = Harness()
    h.worker("w0")
    for i in range(50):
        req = p.InferRequest(f"r{i}", f"nosuch-{i}",
                             [p.from_numpy("input", np.ones((1, 4), np.float32))])
        _, header, bufs = p.unpack([bytes(f) for f in p.encode_request(req)])
        h.path.on_request(b"client", header, bufs, h.now)
    assert set(h.codes().values()) == {"not_found"}
    text = h.path.metrics.render()
    assert "nosuch" not in text
    assert 'zeroserve_inference_requests_total{model="",status="not_found"} 50.0' in text


def test_holds_follows_what_a_worker_loads_and_unloads() -> None:
    h = Harness()
    h.worker("w0")
    w = h.pool.get(b"w0")
    assert w is not None and w.holds("m") and w.holds("m", 1) and not w.holds("m", 2)
    h.pool.loaded(w, ModelVersion("m", 2))
    assert w.versions_of("m") == {1, 2} and ("m", 2) in w.loaded
    h.pool.unload(w, "m", 1)
    assert w.versions_of("m") == {2} and w.holds("m") and not w.holds("m", 1)
    h.pool.retire(w, ModelVersion("m", 2))
    assert not w.holds("m") and not w.loaded and h.pool.holders("m") == []
    h.request("a")
    assert h.codes() == {"a": "no_worker"}


@pytest.mark.slow   # a soak: 20,000 requests
def test_twenty_thousand_requests_leave_nothing_behind() -> None:
    """The broker kept every request it ever queued: the shed order's arrival lists were
    compacted only when the queue was full, so under ordinary load they grew by one entry
    a request (650 bytes; 811 MB after a 15-minute soak). Whatever the load, the lazily
    cleaned structures stay within a bound of the live queue, and hold nothing at all
    once every request has been answered."""
    h = Harness(max_batch_size=8)
    h.worker("w0")
    h.worker("w1")
    peak: Counter[str] = Counter()
    sent = 0
    for turn in range(2_000):
        for _ in range(10):
            h.request(f"r{sent}", timeout_ms=50.0 if sent % 3 else 0.0)
            sent += 1
        h.path.dispatch(h.now)
        for identity, batch in h.batches():
            h.answer(identity, batch)
        h.now += 0.001
        if turn % 100 == 0:
            h.path.expire(h.now)
        for name, n in h.path.census().items():
            peak[name] = max(peak[name], n)
    while h.path.open_count():
        h.path.dispatch(h.now)
        for identity, batch in h.batches():
            h.answer(identity, batch)
    assert sum(h.answers().values()) == sent == 20_000
    census = h.path.census()
    assert not any(census.values()), census
    assert max(peak.values()) < 300, peak
    h.to_clients.clear()


def test_work_queued_behind_a_hung_batch_moves_at_once() -> None:
    """It waited the hung batch's whole max_execution_ms (30 s by default), though the
    worker had never started it."""
    h = Harness(max_batch_size=1)
    h.worker("w0")
    h.request("hung")
    h.request("behind")
    h.path.dispatch(h.now)
    assert [b.items[0].request_id for _, b in h.batches()] == ["0", "0"]   # both on w0
    h.worker("w1")
    h.now += 0.5
    h.path.move_stalled(h.now)
    h.path.dispatch(h.now)
    assert h.batches() == [], "moved before the running batch overran"
    due = h.path.next_due(h.now)
    assert due is not None and due <= 1.0 + 1e-9   # a timer, not the next arrival
    h.now = due + 0.001
    h.path.move_stalled(h.now)
    h.path.dispatch(h.now)
    ((identity, batch),) = h.batches()
    assert identity == b"w1"
    h.answer(identity, batch)
    assert h.codes() == {"behind": "ok"}
    h.request("next")                     # the stalled worker takes nothing new
    h.path.dispatch(h.now)
    ((identity, batch),) = h.batches()
    assert identity == b"w1"
    h.answer(identity, batch)
    h.now += 30.0
    assert h.path.overdue(h.now) == [b"w0"]
    assert h.codes()["hung"] == "deadline"


def test_a_batch_past_its_delay_that_every_busy_worker_holds_up_asks_no_wake_up() -> None:
    """Its delay passed while no worker had a credit: only a result frees one, and every
    message ticks. Asked as a due time, the delay's end (in the past) was a poll timeout
    of 0, and the broker's loop spun a core for as long as every worker was busy."""
    h = Harness(max_batch_size=2, delay_ms=5.0)
    h.worker("w0")                        # two credits
    for rid in "abcde":
        h.request(rid)
    h.path.dispatch(h.now)
    running = h.batches()
    assert len(running) == 2              # a+b, c+d: e waits for its delay
    assert h.path.next_due(h.now) == pytest.approx(0.005)   # a timer while it may fire
    h.now = 0.005
    h.path.dispatch(h.now)
    assert h.batches() == []              # due, but no credit is free
    h.now = 0.006
    due = h.path.next_due(h.now)
    assert due is None or due > h.now, due
    h.answer(*running[0])                 # the result's turn sends it
    h.path.dispatch(h.now)
    ((_, batch),) = h.batches()
    assert [i.request_id for i in batch.items] == ["0"]
