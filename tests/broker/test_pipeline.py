"""Ensembles run by the request path, without processes or sockets: the outboxes are
lists, the clock a number. Independent steps queue at once, a step waits for every
tensor it reads, a failing step answers the pipeline once and withdraws the others, a
cancel withdraws every step, and a deadline the critical path cannot meet is refused
before any step is queued; afterwards nothing of a pipeline is left anywhere."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from zeroserve.broker import protocol as p
from zeroserve.broker.server.catalog import Catalog
from zeroserve.broker.server.latency import LatencyBook
from zeroserve.broker.server.metrics import BrokerMetrics
from zeroserve.broker.server.pool import WorkerPool
from zeroserve.broker.server.scheduler import Scheduler
from zeroserve.models.repository import RepoModel, parse_config
from tests.broker.rig import RequestPath
from tests.conftest import linear_config

T4 = {"datatype": "FP32", "shape": [4]}


def configs() -> list[dict[str, Any]]:
    pair = {**linear_config("c", 4, 4), "inputs": [{"name": "x", **T4}, {"name": "y", **T4}]}
    steps = [{"model_name": "a", "input_map": {"input": "RAW"}, "output_map": {"output": "A"}},
             {"model_name": "b", "input_map": {"input": "RAW"}, "output_map": {"output": "B"}},
             {"model_name": "c", "input_map": {"x": "A", "y": "B"},
              "output_map": {"output": "OUT"}}]
    pipe = {"name": "pipe", "platform": "ensemble", "max_batch_size": 4,
            "inputs": [{"name": "RAW", **T4}], "outputs": [{"name": "OUT", **T4}],
            "ensemble_scheduling": {"step": steps}}
    gen = {**linear_config("g", 4, 4), "platform": "python",
           "model_transaction_policy": {"decoupled": True}}
    streamed = {**pipe, "name": "spipe", "ensemble_scheduling": {"step": [
        steps[0], {"model_name": "g", "input_map": {"input": "A"},
                   "output_map": {"output": "OUT"}}]}}
    return [linear_config("a", 4, 4), linear_config("b", 4, 4), pair, pipe, gen, streamed]


class Harness:
    def __init__(self, credits: int = 4, latency: bool = False) -> None:
        self.now = 0.0
        self.to_workers: list[list[Any]] = []
        self.to_clients: list[tuple[bytes, list[Any]]] = []
        self.catalog = Catalog(Path("/nonexistent"))
        self.scheduler = Scheduler()
        for raw in configs():
            cfg = parse_config(raw, "test")
            model, _ = self.catalog.commit(RepoModel(cfg, Path("/x") / cfg.name, (1,)), {},
                                           {1})
            self.scheduler.set_policy(cfg.name, model.policy())
        self.pool = WorkerPool(self._to_worker, lambda: self.now)
        self.latency = LatencyBook(enabled=latency)
        self.path = RequestPath(self.catalog, self.scheduler, self.pool, self.latency,
                                BrokerMetrics(), self._to_client, clock=lambda: self.now)
        ready = p.WorkerReady("w0", credits=credits, models=[["a", 1], ["b", 1], ["c", 1],
                                                                ["g", 1]])
        self.worker = self.pool.register(b"w0", ready, self.now)

    def _to_worker(self, identity: bytes, frames: list[Any]) -> bool:
        self.to_workers.append(frames)
        return True

    def _to_client(self, identity: bytes, frames: list[Any]) -> bool:
        self.to_clients.append((identity, frames))
        return True

    def request(self, rid: str, timeout_ms: float = 0.0,
                trace: dict[str, str] | None = None, model: str = "pipe",
                stream: bool = False) -> None:
        x = np.arange(4, dtype=np.float32).reshape(1, 4)
        req = p.InferRequest(rid, model, [p.from_numpy("RAW", x)], timeout_ms=timeout_ms,
                             trace=trace, stream=stream)
        _, header, bufs = p.unpack([bytes(f) for f in p.encode_request(req)])
        self.path.on_request(b"client", header, bufs, self.now)

    def batches(self) -> list[p.Batch]:
        self.path.dispatch(self.now)
        out = []
        for frames in self.to_workers:
            kind, header, bufs = p.unpack([bytes(f) for f in frames])
            if kind is p.Kind.BATCH:
                out.append(p.decode_batch(header, bufs))
        self.to_workers.clear()
        return out

    def answer(self, batch: p.Batch, error: str | None = None) -> None:
        """Each model adds its inputs up, plus one: the answer says which steps ran."""
        replies = []
        for item in batch.items:
            total = sum(p.to_numpy(t) for t in item.tensors) + 1
            replies.append(p.InferReply(item.request_id, batch.model, batch.version,
                                        [p.from_numpy("output", total)]))
        result = p.BatchResult(batch.batch_id, [] if error else replies, 1.0, error=error)
        _, header, bufs = p.unpack([bytes(f) for f in p.encode_result(result)])
        self.path.on_result(self.worker, header, bufs, self.now)

    def answers(self) -> list[tuple[str, Any]]:
        out = []
        for _, frames in self.to_clients:
            kind, header, bufs = p.unpack([bytes(f) for f in frames])
            if kind is p.Kind.REPLY:
                out.append((header["id"], p.to_numpy(p.decode_reply(header, bufs).tensors[0])))
            else:
                out.append((header["id"], (header["code"], header["message"])))
        return out

    def empty(self) -> bool:
        return not any(self.path.census().values())


def test_independent_steps_queue_at_once_and_the_last_waits_for_both() -> None:
    h = Harness()
    h.request("r1")
    first = h.batches()
    assert sorted(b.model for b in first) == ["a", "b"]
    h.answer(first[0])
    assert h.batches() == []          # c reads A and B: B is not there yet
    h.answer(first[1])
    (last,) = h.batches()
    assert last.model == "c" and [t.meta.name for t in last.items[0].tensors] == ["x", "y"]
    assert h.to_clients == []
    h.answer(last)
    ((rid, out),) = h.answers()
    x = np.arange(4, dtype=np.float32)
    assert rid == "r1"
    np.testing.assert_array_equal(out[0], (x + 1) + (x + 1) + 1)
    assert h.empty(), h.path.census()


def test_steps_of_many_pipelines_batch_together() -> None:
    h = Harness()
    for i in range(3):
        h.request(f"r{i}")
    first = h.batches()
    assert Counter({b.model: len(b.items) for b in first}) == Counter({"a": 3, "b": 3})
    for b in first:   # each batch's step answers reach the pipelines in one message
        h.answer(b)
    (last,) = h.batches()
    assert len(last.items) == 3
    h.answer(last)
    assert sorted(rid for rid, _ in h.answers()) == ["r0", "r1", "r2"]
    assert h.empty(), h.path.census()


def test_a_failing_step_answers_once_naming_it_and_withdraws_the_queued_ones() -> None:
    h = Harness(credits=1)
    h.request("r1")
    (running,) = h.batches()          # one credit: the other first step stays queued
    assert h.scheduler.depth("b" if running.model == "a" else "a") == 1
    h.answer(running, error="boom")
    ((rid, (code, message)),) = h.answers()
    index = 0 if running.model == "a" else 1
    assert rid == "r1" and code == "model_error"
    assert f"step {index} (model {running.model!r}) of ensemble 'pipe' failed: boom" in message
    assert h.scheduler.depth("a") == h.scheduler.depth("b") == 0
    assert h.batches() == []
    assert h.empty(), h.path.census()


def test_a_cancel_withdraws_every_step_and_a_late_answer_finds_nothing() -> None:
    h = Harness(credits=1)
    h.request("r1")
    (running,) = h.batches()
    h.path.on_cancel(b"client", "r1")
    assert h.answers() == [("r1", ("cancelled", "cancelled by the client"))]
    h.answer(running)                 # the step that was running finishes: no answer
    assert len(h.answers()) == 1
    assert h.batches() == []
    assert h.empty(), h.path.census()


def test_a_client_gone_withdraws_its_pipelines() -> None:
    h = Harness(credits=1)
    h.request("r1")
    h.batches()
    assert h.path.client_gone(b"client") == 1
    assert [code for _, (code, _) in h.answers()] == ["cancelled"]


def test_a_deadline_the_critical_path_cannot_meet_is_refused_before_any_step() -> None:
    h = Harness(latency=True)
    for model, seconds in (("a", 0.010), ("b", 0.030), ("c", 0.020)):
        for _ in range(4):
            h.latency.observe(model, "w0", 1, seconds)
    h.request("late", timeout_ms=40.0)   # b then c: 50 ms
    ((rid, (code, message)),) = h.answers()
    assert code == "deadline" and "cannot be met" in message and "'pipe'" in message
    assert h.batches() == [] and h.empty()
    h.request("fits", timeout_ms=60.0)
    assert sorted(b.model for b in h.batches()) == ["a", "b"]


def test_an_input_the_ensemble_does_not_take_is_refused_before_any_step() -> None:
    h = Harness()
    x = np.zeros((1, 5), dtype=np.float32)
    req = p.InferRequest("bad", "pipe", [p.from_numpy("RAW", x)])
    _, header, bufs = p.unpack([bytes(f) for f in p.encode_request(req)])
    h.path.on_request(b"client", header, bufs, h.now)
    ((_, (code, _)),) = h.answers()
    assert code == "bad_input"
    assert h.batches() == [] and h.empty()


def test_a_step_refused_at_its_own_admission_fails_the_pipeline_once_naming_it() -> None:
    h = Harness()
    h.request("r1")
    first = {b.model: b for b in h.batches()}
    h.answer(first["a"])
    wrong = first["b"]   # b answers a shape its config does not declare: c refuses it
    result = p.BatchResult(wrong.batch_id, [p.InferReply(
        wrong.items[0].request_id, "b", 1, [p.from_numpy("output", np.zeros((1, 5),
                                                                          np.float32))])], 1.0)
    _, header, bufs = p.unpack([bytes(f) for f in p.encode_result(result)])
    h.path.on_result(h.worker, header, bufs, h.now)
    ((rid, (code, message)),) = h.answers()
    assert rid == "r1" and code == "bad_input"
    assert "step 2 (model 'c') of ensemble 'pipe' failed" in message
    assert h.batches() == [] and h.empty(), h.path.census()


def test_a_traced_pipeline_is_answered_with_its_own_timestamps() -> None:
    h = Harness()
    h.request("t", trace={"traceparent": "00-0af7651916cd43dd8448eb211c80319c-"
                                         "b7ad6b7169203331-01"})
    h.now = 0.5
    for b in h.batches():
        h.answer(b)
    (last,) = h.batches()
    h.now = 1.0
    h.answer(last)
    ((_, frames),) = h.to_clients
    _, header, _ = p.unpack([bytes(f) for f in frames])
    stamps = header["trace"]["ns"]
    assert stamps["REQUEST_END"] - stamps["REQUEST_START"] == 1_000_000_000


def test_a_decoupled_last_step_streams_the_pipeline() -> None:
    h = Harness()
    h.request("u", model="spipe")     # a unary call to a pipeline that streams
    assert h.answers()[0][1][0] == "unsupported"
    h.to_clients.clear()
    h.request("s", model="spipe", stream=True)
    (first,) = h.batches()
    h.answer(first)
    (gen,) = h.batches()
    assert gen.model == "g"
    item = gen.items[0].request_id
    for final, value in ((False, 1.0), (True, 2.0)):
        msg = p.Partial(gen.batch_id, [p.PartialItem(item, final, [p.from_numpy(
            "output", np.full((1, 4), value, np.float32))])])
        _, header, bufs = p.unpack([bytes(f) for f in p.encode_partial(msg)])
        h.path.streaming.on_partial(h.worker, header, bufs, h.now)
    parts = []
    for _, frames in h.to_clients:
        kind, header, bufs = p.unpack([bytes(f) for f in frames])
        assert kind is p.Kind.PARTS
        parts += p.decode_parts(header, bufs)
    assert [(q.request_id, q.model, q.index, q.final) for q in parts] == \
        [("s", "spipe", 0, False), ("s", "spipe", 1, True)]
    assert [t.meta.name for t in parts[1].tensors] == ["OUT"]
    assert float(p.to_numpy(parts[1].tensors[0])[0, 0]) == 2.0
    result = p.BatchResult(gen.batch_id, [], 1.0)
    _, header, bufs = p.unpack([bytes(f) for f in p.encode_result(result)])
    h.path.on_result(h.worker, header, bufs, h.now)
    assert len(h.to_clients) == 2
    assert h.empty(), h.path.census()


def test_a_cancelled_streaming_pipeline_stops_its_running_step() -> None:
    h = Harness()
    h.request("s", model="spipe", stream=True)
    (first,) = h.batches()
    h.answer(first)
    (gen,) = h.batches()
    h.path.on_cancel(b"client", "s")
    assert [a[1][0] for a in h.answers()] == ["cancelled"]
    stops = [p.unpack([bytes(f) for f in frames])[0] for frames in h.to_workers]
    assert p.Kind.STOP in stops
    result = p.BatchResult(gen.batch_id, [], 1.0)
    _, header, bufs = p.unpack([bytes(f) for f in p.encode_result(result)])
    h.path.on_result(h.worker, header, bufs, h.now)
    assert len(h.to_clients) == 1
    assert h.empty(), h.path.census()
