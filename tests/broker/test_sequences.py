"""The broker's side of iterative models (continuous batching), without sockets: a worker
takes as many requests as it has free sequence slots, whatever its batch credits; a final
part or a stop frees a slot at once and the queue's next request, by priority, is sent;
a lost worker's sequences end once (an error after a response, a retry before one); a
draining worker waits for its sequences."""

from __future__ import annotations

import pytest

from zeroserve.broker import protocol as p
from zeroserve.broker.server.pool import Loss
from tests.broker.test_streams import Harness, frames_of, tensor


def harness(most: int = 3) -> Harness:
    h = Harness(sequences={"max": most})
    h.worker("w")   # 2 batch credits
    return h


def ids(batch: p.Batch) -> list[str]:
    return [i.request_id for i in batch.items]


def test_a_worker_takes_requests_up_to_its_free_sequence_slots() -> None:
    h = harness(most=3)
    for rid in "abcde":
        h.request(rid)
    h.path.dispatch(h.now)
    [(w, first)] = h.batches()
    assert len(first.items) == 3   # 3 slots, though the model batches 4
    h.path.dispatch(h.now)
    assert h.batches() == []       # every slot held: d and e wait
    h.request("f")                 # a third batch would exceed its 2 credits: not a limit
    h.partial(w, first, [("0", True), ("1", False), ("2", True)])
    h.path.dispatch(h.now)
    [(_, second)] = h.batches()
    assert len(second.items) == 2  # two slots freed by two final parts
    worker = h.pool.get(w)
    assert worker is not None and worker.inflight == [] and len(worker.sequences) == 2
    assert h.pool.batches.running_sequences(worker, "s") == 3


def test_a_freed_slot_goes_to_the_highest_priority_waiting() -> None:
    h = harness(most=1)
    h.request("running", priority=2)
    h.path.dispatch(h.now)
    [(w, batch)] = h.batches()
    h.request("low", priority=2)
    h.request("high", priority=1)
    h.partial(w, batch, [("0", True)])
    h.path.dispatch(h.now)
    [(_, nxt)] = h.batches()
    assert len(nxt.items) == 1
    h.partial(w, nxt, [("0", False)])
    assert h.answers()["high"] == [("part", (0, False))]
    assert "low" not in h.answers()


def test_a_cancel_frees_its_slot_before_the_worker_stops_it() -> None:
    h = harness(most=1)
    h.request("a")
    h.request("b")
    h.path.dispatch(h.now)
    [(w, first)] = h.batches()
    h.path.on_cancel(b"client", "a")
    assert h.stops() == [p.Stop(first.batch_id, ["0"])]
    h.path.dispatch(h.now)
    [(_, second)] = h.batches()    # the worker queues it until a slot frees there
    h.end(w, first)                # the worker's RESULT once a left
    h.partial(w, second, [("0", True)])
    h.end(w, second)
    assert h.finals() == {"a": 1, "b": 1} and h.empty()


def test_a_lost_worker_ends_its_sequences_once() -> None:
    h = harness(most=4)
    h.worker("other")
    for rid in "ab":
        h.request(rid)
    h.path.dispatch(h.now)
    sent = h.batches()
    w, batch = sent[0]
    items = {i.request_id for _, b in sent for i in b.items}
    assert items == {"0", "1"}
    h.partial(w, batch, [(batch.items[0].request_id, False)])
    worker = h.pool.get(w)
    assert worker is not None
    lost = h.pool.remove(worker, Loss.CRASHED)
    assert {r.batch_id for r in lost} == {b.batch_id for i, b in sent if i == w}
    h.path.worker_lost(lost, Loss.CRASHED, "w", h.now)
    h.path.dispatch(h.now)
    responded = [rid for rid, got in h.answers().items() if got[0][0] == "part"]
    assert len(responded) == 1
    assert h.answers()[responded[0]][-1] == ("error", "worker_lost")
    for i, b in h.batches():       # what had not answered runs again on the other worker
        assert i == b"other"
        h.partial(i, b, [(it.request_id, True) for it in b.items])
        h.end(i, b)
    for i, b in sent:
        if i == b"other":
            h.partial(i, b, [(it.request_id, True) for it in b.items])
            h.end(i, b)
    assert set(h.finals().values()) == {1} and h.empty()


def test_a_draining_worker_waits_for_its_sequences() -> None:
    h = harness(most=2)
    h.request("a")
    h.path.dispatch(h.now)
    [(w, batch)] = h.batches()
    worker = h.pool.get(w)
    assert worker is not None
    h.pool.leave(worker)
    assert list(h.pool.drained()) == []
    h.request("b")
    h.path.dispatch(h.now)
    assert h.batches() == []       # no new sequence on a leaving worker
    h.partial(w, batch, [("0", True)])
    h.end(w, batch)
    assert list(h.pool.drained()) == [worker]


def steps(h: Harness, identity: bytes, batches: list[tuple[p.Batch, list[tuple[str, bool]]]],
          header: dict[str, object] | None = None) -> None:
    msgs = [p.Partial(b.batch_id, [p.PartialItem(item, final, []) if final else
                                   p.PartialItem(item, final, [tensor(1.0)])
                                   for item, final in parts]) for b, parts in batches]
    _, got, bufs = frames_of(p.encode_steps(msgs))
    worker = h.pool.get(identity)
    assert worker is not None
    h.path.streaming.on_steps(worker, header or got, bufs, h.now)


def test_a_step_of_several_joins_reaches_a_client_as_one_message() -> None:
    h = harness(most=4)
    h.request("a")
    h.path.dispatch(h.now)
    h.request("b")
    h.path.dispatch(h.now)
    [(w, first), (_, second)] = h.batches()   # two joins, apart
    before = len(h.to_clients)
    steps(h, w, [(first, [("0", False)]), (second, [("0", False)])])
    assert len(h.to_clients) == before + 1     # both streams' parts in one PARTS
    steps(h, w, [(first, [("0", True)]), (second, [("0", True)])])
    h.end(w, first)
    h.end(w, second)
    assert h.answers() == {rid: [("part", (0, False)), ("part", (1, True))] for rid in "ab"}
    assert h.empty()


def test_a_malformed_step_fails_the_joins_it_names() -> None:
    h = harness(most=4)
    h.request("a")
    h.path.dispatch(h.now)
    [(w, batch)] = h.batches()
    with pytest.raises(p.ProtocolError):
        steps(h, w, [], header={"v": 4, "batches": [[batch.batch_id, "not parts"]]})
    assert h.answers() == {"a": [("error", "internal")]}
    assert h.stops() == [p.Stop(batch.batch_id, ["0"])]
    h.end(w, batch)
    assert h.empty()


# -- VIP first: preemption ----------------------------------------------------------

def vip_harness(most: int = 2, versions: tuple[int, ...] = tuple(p.SUPPORTED_VERSIONS)
                ) -> Harness:
    h = Harness(sequences={"max": most},
                dynamic_batching={"priority_levels": 2, "default_priority": 2})
    h.worker("w", versions)
    return h


def pauses(h: Harness) -> list[p.Pause]:
    return [p.decode(p.Pause, header) for _, header, _ in h.sent(p.Kind.PAUSE)]


def paused(h: Harness) -> list[str]:
    """The requests whose streams the broker holds paused (told to pause, not resumed)."""
    return sorted(key[1] for key in h.path.streams.paused())


def test_a_higher_priority_request_pauses_the_lowest_and_takes_its_slot() -> None:
    h = vip_harness(most=2)
    h.request("a")              # priority 0: the default level, 2
    h.now = 1.0
    h.request("b")
    h.path.dispatch(h.now)
    [(w, low)] = h.batches()
    h.request("c")              # the same priority: waits for a slot
    h.path.dispatch(h.now)
    assert h.batches() == [] and pauses(h) == []
    h.request("vip", priority=1)
    h.path.dispatch(h.now)
    # the youngest of the lowest priority pauses; the VIP goes to the same worker at once
    assert pauses(h) == [p.Pause(low.batch_id, ["1"])]
    [(w2, vip)] = h.batches()
    assert w2 == w and ids(vip) == ["0"] and len(vip.items) == 1
    assert paused(h) == ["b"]
    assert h.metrics.preemptions.labels("s", "anonymous")._value.get() == 1
    h.partial(w, low, [("0", False), ("1", False)])   # a step made before it paused
    assert paused(h) == ["b"]
    h.path.dispatch(h.now)
    assert h.batches() == []    # c waits: the paused one resumes first
    h.partial(w, vip, [("0", False)])   # the pause took effect: the VIP runs
    h.partial(w, low, [("0", False)])
    assert paused(h) == ["b"]
    h.partial(w, vip, [("0", True)])
    h.end(w, vip)
    h.path.dispatch(h.now)
    assert h.batches() == []    # the VIP's slot is the paused one's again
    h.partial(w, low, [("1", False)])   # resumed: it answers again
    assert paused(h) == []
    h.partial(w, low, [("0", True), ("1", True)])
    h.path.dispatch(h.now)
    [(_, last)] = h.batches()
    assert len(last.items) == 1
    h.end(w, low)
    h.partial(w, last, [("0", True)])
    h.end(w, last)
    assert h.finals() == {"a": 1, "b": 1, "c": 1, "vip": 1} and h.empty()


def test_a_vip_pauses_a_running_stream_though_an_aged_request_heads_the_queue() -> None:
    """Aging lifts a request that waited over higher priorities for a free slot; it takes
    no running one's, nor the slot a VIP's pause frees: the VIP joins at once."""
    h = vip_harness(most=1)
    h.request("running")
    h.path.dispatch(h.now)
    [(w, low)] = h.batches()
    h.request("aged")      # the same priority: it waits for the slot, and ages
    h.now += 2.0           # past aging_s (1 s): the head of the dispatch order
    h.request("vip", priority=1)
    h.path.dispatch(h.now)
    assert pauses(h) == [p.Pause(low.batch_id, ["0"])]
    [(w2, vip)] = h.batches()
    assert w2 == w
    h.partial(w, vip, [("0", False)])
    assert h.answers()["vip"] == [("part", (0, False))]
    assert "aged" not in h.answers()


def test_no_preemption_of_an_equal_priority_or_on_a_worker_that_cannot_pause() -> None:
    h = vip_harness(most=1, versions=(1, 2, 3, 4))   # an older worker: no PAUSE
    h.request("a")
    h.path.dispatch(h.now)
    h.batches()
    h.request("vip", priority=1)
    h.path.dispatch(h.now)
    assert h.batches() == [] and pauses(h) == []


def test_the_victim_is_the_lowest_priority_then_the_latest_deadline_then_arrival() -> None:
    from zeroserve.broker.server.preemption import Running, victim
    from zeroserve.broker.server.scheduler import Entry

    def running(name: str, priority: int, deadline_s: float = float("inf"),
                arrival_s: float = 0.0) -> Running:
        return Running("w", 1, name, Entry(name, "s", priority, arrival_s, deadline_s))
    crowd = [running("p2-soon", 2, 5.0), running("p2-never", 2), running("p3-old", 3),
             running("p3-new", 3, arrival_s=1.0), running("p1", 1)]
    assert victim(Entry("v", "s", 1, 2.0), crowd).item == "p3-new"
    assert victim(Entry("v", "s", 3, 2.0), crowd) is None        # nothing lower
    # the same priority takes no slot, whatever its deadline
    assert victim(Entry("v", "s", 2, 2.0, 2.1), crowd[:2]) is None
    assert victim(Entry("v", "s", 1, 2.0), crowd[:2]).item == "p2-never"


def test_a_paused_join_is_not_taken_for_hung() -> None:
    h = Harness(exec_ms=100.0, sequences={"max": 1},
                dynamic_batching={"priority_levels": 2, "default_priority": 2})
    h.worker("w", tuple(p.SUPPORTED_VERSIONS))
    h.request("low")
    h.path.dispatch(h.now)
    [(w, low)] = h.batches()
    h.request("vip", priority=1)
    h.path.dispatch(h.now)
    [(_, vip)] = h.batches()
    h.partial(w, vip, [("0", False)])   # the pause took effect
    h.now = 0.09
    h.partial(w, vip, [("0", False)])
    h.now = 0.5                         # the low one sat out past max_execution_ms
    assert [r.batch_id for r in h.pool.batches.overdue(h.now)] == [vip.batch_id]
    h.partial(w, vip, [("0", True)])
    h.end(w, vip)
    assert h.pool.batches.overdue(h.now) == []
    assert h.pool.batches.next_exec_deadline() == float("inf")   # the paused one's: none
    h.partial(w, low, [("0", True)])    # resumed, and ends
    h.end(w, low)
    assert h.finals() == {"low": 1, "vip": 1} and h.empty()
