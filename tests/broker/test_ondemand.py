"""Load on demand in the broker without sockets (outboxes are lists, the clock a number),
on real model files: a request for an available model loads it once however many ask,
the least wanted idle model makes room after its minimum residency and never one with
work queued, a hot model stays while colder ones take turns, a deadline shorter than the
predicted load is refused at once, the bound on the seconds spent loading in a minute
answers 503 with Retry-After, and a worker lost while loading answers each waiting request
once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from tests.broker.rig import BrokerRig
from tests.conftest import examples, linear_config
from zeroserve.broker import protocol as p
from zeroserve.broker.server.ondemand import OnDemandOptions
from zeroserve.broker.server.pool import Loss
from zeroserve.models.repository import RepoModel, parse_config

WEIGHTS = (1000 * 1000 + 1000) * 4      # nn.Linear(1000, 1000): 4.0 MB
BUDGET = 9_000_000                      # two of them


class Rig(BrokerRig):
    def __init__(self, repo: Path, **opts: Any) -> None:
        super().__init__(repo, on_demand=OnDemandOptions(enabled=True, **opts))
        self.rid = 0

    def model(self, name: str) -> None:
        # one row a batch: the first activations guess (0.1 MB) keeps two in the budget
        self.add_model(name, linear_config(name, 1000, 1000, mbs=1),
                       factory="nn.Linear(1000, 1000)")

    def ask(self, model: str, timeout_ms: float = 0.0) -> str:
        self.rid += 1
        req = p.InferRequest(f"r{self.rid}", model,
                             [p.from_numpy("input", np.ones((1, 1000), np.float32))],
                             timeout_ms=timeout_ms)
        self.b.on_frontend(b"gw", [bytes(f) for f in p.encode_request(req)])
        return req.request_id

    def load_done(self, wid: str, name: str) -> None:
        self.loaded(wid, name, 1, footprint_bytes=WEIGHTS, resident_bytes=WEIGHTS)
        self.tick()

    def errors(self) -> list[p.ErrorReply]:
        out = []
        for _, frames in self.to_clients:
            kind, header, _ = p.unpack(frames)
            if kind is p.Kind.ERROR:
                out.append(p.decode_error(header))
        return out

    def state(self, name: str) -> str:
        return str(self.b.ondemand.describe(name)["state"])

    def census_empty(self) -> bool:
        return not any(self.b.census().values())


def rig_with(tmp_path: Path, names: str, **opts: Any) -> Rig:
    rig = Rig(tmp_path, **opts)
    for name in names:
        rig.model(name)
    rig.worker("w", "cpu", budget=BUDGET, context_bytes=0)
    return rig


def test_concurrent_requests_share_one_load_and_are_served_once_it_ends(tmp_path: Path) -> None:
    rig = rig_with(tmp_path, "abc")
    assert rig.loads("w") == [], "nothing loads before it is asked for"
    assert [rig.state(n) for n in "abc"] == ["available"] * 3
    index = rig.b.repository.index({})
    assert {e["state"] for e in index} == {"AVAILABLE"}, index
    rig.ask("a")
    rig.ask("a")
    rig.tick()
    assert rig.loads("w") == ["a/1"], "one load for both"
    assert rig.state("a") == "loading"
    rig.now += 0.2
    rig.load_done("w", "a")
    assert rig.state("a") == "ready"
    rig.run_batches("w")
    assert rig.answers() == ["ok", "ok"]
    assert rig.census_empty()
    assert rig.b.ondemand.times.predict("a") == 0.2
    assert 'zeroserve_load_wait_seconds_count{model="a"} 2.0' in rig.b.metrics.render()


def test_an_idle_model_past_its_residency_makes_room_never_a_busy_one(tmp_path: Path) -> None:
    rig = rig_with(tmp_path, "abc", min_residency_s=5.0)
    for name in "ab":
        rig.ask(name)
        rig.load_done("w", name)
        rig.run_batches("w")
    rig.ask("a")   # a used last: b is the least recently used
    rig.run_batches("w")
    rig.ask("c")
    rig.tick()
    assert rig.loads("w") == ["a/1", "b/1"], "a and b are younger than their residency"
    assert list(rig.b.ondemand.wanted) == ["c"]
    rig.ask("b")   # b runs now (and is held till its result): it cannot go
    rig.live("w", 5)
    assert rig.loads("w") == ["a/1", "b/1", "c/1"]
    worker = rig.b.pool.get(b"w")
    assert {k.name for k in worker.loaded} == {"b"}, "a, idle and past residency, went"
    assert rig.state("a") == "evicted" and rig.state("c") == "loading"
    assert "least wanted idle model" in rig.b.ondemand.describe("a")["reason"]
    rig.load_done("w", "c")
    rig.run_batches("w")
    assert rig.answers().count("ok") == 5 and rig.census_empty()
    text = rig.b.metrics.render()
    assert 'zeroserve_model_evictions_total{model="a",reason="room"} 1.0' in text
    assert 'zeroserve_model_loads_on_demand_total{model="c",reason="request"} 1.0' in text


def test_the_hot_model_stays_and_the_cold_ones_take_turns(tmp_path: Path) -> None:
    """Least recently used evicts a hot model in the instant its queue is empty; the
    least wanted keeps it and turns the other slot over among the cold ones."""
    rig = rig_with(tmp_path, "hcd", min_residency_s=0.0)
    for _ in range(20):   # h is hot
        rig.ask("h")
        rig.tick(0.01)
        worker = rig.b.pool.get(b"w")
        if worker.loading:
            rig.load_done("w", "h")
        rig.run_batches("w")
    rig.ask("c")
    rig.load_done("w", "c")
    rig.run_batches("w")   # c ran last: h is now the least recently used
    assert rig.b.usage.last_used("h") < rig.b.usage.last_used("c")
    rig.ask("d")
    rig.tick()
    assert rig.loads("w") == ["h/1", "c/1", "d/1"]
    assert rig.state("c") == "evicted" and rig.state("h") == "ready", \
        "the cold model made room, not the hot one"
    rig.load_done("w", "d")
    rig.run_batches("w")
    rig.ask("c")
    rig.tick()
    assert rig.loads("w")[-1] == "c/1" and rig.state("d") == "evicted"
    rig.load_done("w", "c")
    rig.run_batches("w")
    assert rig.answers().count("ok") == 23 and rig.census_empty()
    assert rig.b.ondemand.describe("h")["demand_rps"] > rig.b.ondemand.describe("d")["demand_rps"]


def hot_a_beside_busy_b_and_d(tmp_path: Path, names: str) -> Rig:
    """Three slots: a, the most wanted, idle past its residency (0.5 s); b and d loaded
    on demand after it, each with its batch sent and left running (busy)."""
    rig = Rig(tmp_path, min_residency_s=0.5)
    for name in names:
        rig.model(name)
    rig.worker("w", "cpu", budget=13_000_000, context_bytes=0)   # three of them
    for _ in range(5):
        rig.ask("a")
    rig.load_done("w", "a")
    rig.run_batches("w")
    rig.tick(1.0)
    for name in "bd":
        rig.ask(name)
        rig.load_done("w", name)
    return rig


def test_a_hot_model_yields_its_room_only_after_the_colder_one_waited_its_residency(
        tmp_path: Path) -> None:
    """Three slots: the most wanted model keeps one, the other two are where the rest
    take turns (one loads while another runs). While both turn slots are busy, a request
    for a cold model waits rather than evict the hot model, until it has waited its
    residency (never for ever)."""
    rig = hot_a_beside_busy_b_and_d(tmp_path, "abcd")
    rig.ask("c")
    rig.tick()
    assert rig.loads("w") == ["a/1", "b/1", "d/1"], "c waits: b, d busy, a the hot one"
    assert rig.b.ondemand.next_due(rig.now) == pytest.approx(rig.now + 0.5), \
        "the broker wakes when c's patience ends"
    rig.tick(0.49)
    assert rig.loads("w") == ["a/1", "b/1", "d/1"]
    rig.tick(0.02)
    assert rig.loads("w") == ["a/1", "b/1", "d/1", "c/1"], "c waited: a made room"
    assert rig.state("a") == "evicted" and rig.state("b") == "ready"
    rig.load_done("w", "c")
    rig.run_batches("w")
    assert rig.answers().count("ok") == 8 and rig.census_empty()


def test_a_hot_model_stays_past_the_patience_while_the_turn_room_still_turns(
        tmp_path: Path) -> None:
    """c waits its patience, but a load started meanwhile (e's, with more requests
    waiting): the turn room is turning, and c's wait is its place in line there. The hot
    model yields only once no load has started for a patience."""
    rig = hot_a_beside_busy_b_and_d(tmp_path, "abcde")
    rig.tick(0.3)
    rig.ask("c")   # patience: 0.5 s from now
    rig.tick(0.25)
    rig.ask("e")
    rig.ask("e")   # more requests waiting than c: the next turn is e's
    rig.tick(0.05)   # b and d are past their residency, still busy
    [(_, _, b_batch)] = [s for s in rig.sent(p.Kind.BATCH) if s[2].model == "b"]
    rig.from_worker("w", p.BatchResult(b_batch.batch_id, [
        p.InferReply(i.request_id, "b", 1, i.tensors) for i in b_batch.items], 1.0))
    rig.tick()
    assert rig.loads("w")[-1] == "e/1" and rig.state("b") == "evicted"
    started = rig.now
    rig.load_done("w", "e")   # e's batch left running: every slot busy or hot
    rig.tick(0.25)
    assert rig.state("a") == "ready", "c waited past its patience, but e's load just started"
    assert rig.b.ondemand.next_due(rig.now) == pytest.approx(started + 0.5)
    rig.tick(0.24)
    assert rig.state("a") == "ready"
    rig.tick(0.02)
    assert rig.loads("w")[-1] == "c/1" and rig.state("a") == "evicted", \
        "no load for a patience: the room is stuck, and a makes room"
    rig.load_done("w", "c")
    rig.run_batches("w")
    assert rig.answers().count("ok") == 10 and rig.census_empty()


def test_a_deadline_shorter_than_the_predicted_load_is_refused_at_once(tmp_path: Path) -> None:
    rig = rig_with(tmp_path, "a")
    rig.ask("a", timeout_ms=50)   # the default prediction: 1 s
    [err] = rig.errors()
    assert err.code is p.ErrorCode.DEADLINE
    assert "loading model 'a' takes about 1000 ms" in err.message
    rig.tick()
    assert rig.loads("w") == [], "a refused request starts no load"
    rig.ask("a", timeout_ms=5000)
    rig.tick()
    assert rig.loads("w") == ["a/1"] and len(rig.errors()) == 1


def test_the_load_share_bound_answers_503_with_retry_after(tmp_path: Path) -> None:
    rig = rig_with(tmp_path, "abc", min_residency_s=0.0, max_load_share=2.5 / 60)
    for name in "ab":   # each takes 1 s: 2 s of the 2.5 s a minute may load
        rig.ask(name)
        rig.now += 1.0
        rig.load_done("w", name)
        rig.run_batches("w")
    rig.now = 10.0
    rig.ask("c")   # predicted 1 s: 3 s
    [err] = rig.errors()
    assert err.code is p.ErrorCode.UNAVAILABLE and err.retry_after_s is not None
    assert 49 <= err.retry_after_s <= 51, err.retry_after_s   # a's start leaves at 60
    assert "working set does not fit the memory budget" in err.message
    assert "--load-on-demand-max-load-share" in err.message
    assert rig.census_empty()
    assert rig.b.ondemand.describe("a")["residency_s"] == 5.0, "5 times its 1 s load"
    summary = rig.b.ondemand.summary(rig.now)
    assert summary["load_s_last_minute"] == 2.0 and summary["max_load_s_per_minute"] == 2.5


def test_a_model_bigger_than_the_budget_is_refused_at_once_and_the_others_serve(
        tmp_path: Path) -> None:
    rig = rig_with(tmp_path, "a")
    rig.add_model("big", linear_config("big", 1000, 3000), factory="nn.Linear(1000, 3000)")
    rig.ask("big")   # 12 MB of weights on a 9 MB budget: no eviction could make room
    rig.tick()
    [err] = rig.errors()
    assert err.code is p.ErrorCode.TOO_BIG and not err.code.retryable, err
    assert "big/1 needs" in err.message and "memory budget of" in err.message, err.message
    assert rig.loads("w") == [] and not rig.b.ondemand.wanted
    rig.ask("a")
    rig.load_done("w", "a")
    rig.run_batches("w")
    assert rig.answers() == ["error", "ok"] and rig.census_empty()


def test_a_worker_lost_while_loading_answers_each_waiting_request_once(tmp_path: Path) -> None:
    rig = rig_with(tmp_path, "a")
    ids = [rig.ask("a") for _ in range(3)]
    rig.tick()
    assert rig.loads("w") == ["a/1"]
    rig.b.membership.lose(rig.b.pool.get(b"w"), Loss.CRASHED)
    rig.tick()
    errors = rig.errors()
    assert sorted(e.request_id for e in errors) == sorted(ids), "each answered once"
    assert all(e.code is p.ErrorCode.WORKER_LOST and "lost while loading model 'a'"
               in e.message for e in errors)
    assert rig.census_empty() and not rig.b.ondemand.loads
    rig.worker("w", "cpu", budget=BUDGET, context_bytes=0)   # it comes back
    rig.ask("a")
    rig.tick()
    assert rig.loads("w") == ["a/1", "a/1"], "the next request loads it again"


def test_a_failed_load_answers_the_waiting_requests_with_its_error(tmp_path: Path) -> None:
    rig = rig_with(tmp_path, "a")
    rig.ask("a")
    rig.tick()
    rig.from_worker("w", p.ModelLoaded("a", 1, False, error="boom"))
    rig.tick()
    [err] = rig.errors()
    assert err.code is p.ErrorCode.UNAVAILABLE and "boom" in err.message
    assert rig.census_empty()


def test_a_load_measured_over_the_room_left_waits_for_room_instead_of_failing(
        tmp_path: Path) -> None:
    rig = rig_with(tmp_path, "ab", min_residency_s=0.0)
    rig.ask("a")
    rig.load_done("w", "a")   # its batch is sent and left running: a is busy
    rig.ask("b")
    rig.tick()
    assert rig.loads("w") == ["a/1", "b/1"], "4 MB predicted: it fits beside a"
    rig.loaded("w", "b", 1, footprint_bytes=6_000_000, resident_bytes=6_000_000)
    rig.tick()
    assert rig.errors() == [], "refused for memory while a ran: b's request waits"
    assert list(rig.b.ondemand.wanted) == ["b"] and "b" not in rig.b.catalog.failures
    rig.run_batches("w")   # a's batch ends: a is idle and may go
    assert rig.loads("w") == ["a/1", "b/1", "b/1"]
    assert rig.state("a") == "evicted"
    rig.loaded("w", "b", 1, footprint_bytes=6_000_000, resident_bytes=6_000_000)
    rig.tick()
    rig.run_batches("w")
    assert rig.answers() == ["ok", "ok"] and rig.census_empty()


def test_a_worker_that_outlived_the_broker_keeps_its_models_on_demand(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.model("a")
    rig.model("b")
    w = rig.worker("w", "cpu", budget=BUDGET, context_bytes=0, models=[["a", 1]])
    assert rig.b.catalog.models["a"].ready == {1} and rig.state("a") == "ready"
    assert rig.sent(p.Kind.UNLOAD) == [], "held on demand: kept, not unloaded"
    assert rig.state("b") == "available" and w.holds("a")


ACTIONS = st.lists(st.tuples(st.sampled_from(["ask", "tick", "load", "fail", "run", "lose"]),
                             st.integers(0, 3)), max_size=40)


@settings(max_examples=examples(100), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(actions=ACTIONS)
def test_whatever_happens_each_request_is_answered_once_and_nothing_stays(
        tmp_path_factory: pytest.TempPathFactory, actions: list[tuple[str, int]]) -> None:
    """Requests for four models on a worker that holds two, loads that end or fail, time,
    batches run, the worker lost and back: each request gets one answer, every model
    with work in flight stays, and once time runs out the broker holds nothing."""
    rig = rig_with(tmp_path_factory.mktemp("od"), "abcd", min_residency_s=1.0)
    w = b"w"
    asked: list[str] = []

    def beat(dt: float) -> None:
        if rig.b.pool.get(w) is not None:
            rig.from_worker("w", p.WorkerHeartbeat({}, ""))
        rig.tick(dt)

    for action, i in actions:
        worker = rig.b.pool.get(w)
        if action == "ask":
            asked.append(rig.ask("abcd"[i], timeout_ms=float(1000 * (i + 1))))
        elif action == "tick":
            beat(0.3 * i)
        elif action in ("load", "fail") and worker is not None and worker.loading:
            key = sorted(worker.loading)[0]
            if action == "load":
                rig.load_done("w", key.name)
            else:
                rig.from_worker("w", p.ModelLoaded(key.name, key.version, False, error="x"))
        elif action == "run" and worker is not None:
            rig.run_batches("w")
        elif action == "lose" and worker is not None:
            rig.b.membership.lose(worker, Loss.CRASHED)
            rig.worker("w", "cpu", budget=BUDGET, context_bytes=0)
        worker = rig.b.pool.get(w)
        if worker is not None:   # nothing evicted from under work in flight
            busy = rig.b.pool.busy_models(worker)
            assert busy <= {k.name for k in worker.loaded}, (busy, worker.loaded)
    for _ in range(80):   # time runs out: loads end, batches run, deadlines pass
        worker = rig.b.pool.get(w)
        if worker is not None:
            for key in sorted(worker.loading):
                rig.load_done("w", key.name)
            rig.run_batches("w")
        beat(0.5)
    answered: dict[str, int] = {}
    for _, frames in rig.to_clients:
        kind, header, bufs = p.unpack(frames)
        rid = p.decode_error(header).request_id if kind is p.Kind.ERROR else \
            p.decode_reply(header, bufs).request_id
        answered[rid] = answered.get(rid, 0) + 1
    assert answered == {rid: 1 for rid in asked}
    assert rig.census_empty(), rig.b.census()


def test_a_cached_answer_of_a_model_not_loaded_needs_no_load(tmp_path: Path) -> None:
    rig = Rig(tmp_path, min_residency_s=0.0, max_load_share=2.4 / 60)
    for name in "abc":
        rig.add_model(name, linear_config(name, 1000, 1000, response_cache={"enable": True}),
                      factory="nn.Linear(1000, 1000)")
    rig.worker("w", "cpu", budget=BUDGET, context_bytes=0)
    for name in "abc":   # 2 s of loading of 2.4; c's load evicts a, the least recently used
        rig.now += 10.0   # past the residency of the others (20 x 0.5 s)
        rig.ask(name)
        rig.now += 0.5
        rig.load_done("w", name)
        rig.run_batches("w")
    assert rig.state("a") == "evicted"
    rig.ask("a")   # the same input as before, with the loading of the minute spent
    rig.tick()
    assert rig.loads("w") == ["a/1", "b/1", "c/1"], "answered from the cache: no load"
    assert rig.answers() == ["ok"] * 4 and rig.errors() == [] and rig.census_empty()


def test_the_thrash_bounds_count_the_workers_load_time_not_the_wait(tmp_path: Path) -> None:
    """A load back from the worker's host memory takes it milliseconds even when the
    request waited seconds for it (batches ahead of the LOAD): the residency and the load
    share count what the worker spent, admission what a request waits."""
    rig = rig_with(tmp_path, "a", min_residency_s=0.01)
    rig.ask("a")
    rig.tick()
    rig.now += 2.0
    plan = {"footprint_bytes": WEIGHTS, "resident_bytes": WEIGHTS}
    rig.from_worker("w", p.ModelLoaded("a", 1, True, sha256=rig.b.catalog.shas["a"][1],
                                       memory_bytes=WEIGHTS, load_s=0.01, memory=plan))
    rig.tick()
    od = rig.b.ondemand
    assert od.times.predict("a") == 2.0 and od.costs.predict("a") == 0.01
    assert od.describe("a")["residency_s"] == 0.05, "5 x 10 ms"
    assert od.describe("a")["load_cost_s"] == 0.01 and od.describe("a")["predicted_load_s"] == 2.0
    assert od.guard.evictable_at("w", "a") == rig.now + 0.05


def test_a_turns_load_asks_for_its_model_alone_with_the_config_as_committed(
        tmp_path: Path) -> None:
    rig = rig_with(tmp_path, "ab", min_residency_s=0.0, residency_factor=0.0)
    rig.ask("a")
    rig.tick()
    [(_, first, _)] = rig.sent(p.Kind.LOAD)
    model = rig.b.catalog.models["a"]
    assert first["config"] == model.config.to_json()
    assert model.config_json() is model.config_json(), "made once per config"
    rig.load_done("w", "a")
    rig.run_batches("w")
    # a new config for a: the next LOAD of it carries that one, not the one made before
    rig.b.catalog.commit(RepoModel(parse_config(linear_config("a", 1000, 1000, mbs=4), "a"),
                                   model.path, (1,)), rig.b.catalog.shas["a"])
    assert model.config_json()["max_batch_size"] == 4


def test_a_turn_loads_its_model_alone_not_a_broken_one_placed_beside_it(
        tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.model("a")
    rig.add_model("c", linear_config("c", 1000, 1000, load_on_demand=False),
                  factory="nn.Linear(1000, 1000)")
    rig.worker("w", "cpu", budget=BUDGET, context_bytes=0)
    rig.tick()
    assert rig.loads("w") == ["c/1"], "c is always loaded; a on demand"
    rig.from_worker("w", p.ModelLoaded("c", 1, False, error="its files are broken"))
    rig.tick()
    for _ in range(3):
        rig.ask("a")
        rig.tick()
    assert rig.loads("w") == ["c/1", "a/1"], "asking for a retries nothing else"
