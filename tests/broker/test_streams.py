"""Streams (decoupled models) on the wire and through the request path, without sockets:
the outboxes are lists and the clock is a number. Every part in order, exactly one final
answer per request whatever happens (cancel, deadline, a lost worker, a malformed part),
and nothing of a request left in any structure once it is answered."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import given, strategies as st

from zeroserve.broker import protocol as p
from zeroserve.broker.server.catalog import Catalog, CatalogModel
from zeroserve.broker.server.latency import LatencyBook
from zeroserve.broker.server.metrics import BrokerMetrics
from zeroserve.broker.server.pool import Loss, WorkerPool
from zeroserve.broker.server.scheduler import Scheduler
from zeroserve.models.repository import ConfigError, parse_config
from tests.broker.rig import RequestPath
from tests.conftest import linear_config


def frames_of(frames: list[Any]) -> tuple[p.Kind, dict[str, Any], list[bytes]]:
    kind, header, bufs = p.unpack([bytes(f) for f in frames])
    return kind, header, list(bufs)


def tensor(value: float, rows: int = 1) -> p.Tensor:
    return p.from_numpy("output", np.full((rows, 3), value, np.float32))


# -- the wire ---------------------------------------------------------------------

def test_parts_round_trip_in_order_with_index_final_and_empty_final() -> None:
    parts = [p.StreamPart("a", "m", 1, 0, False, [tensor(1.0)]),
             p.StreamPart("b", "m", 1, 4, False, [tensor(2.0)]),
             p.StreamPart("a", "m", 1, 1, True, [], {"queue_ms": 1.5})]
    kind, header, bufs = frames_of(p.encode_parts(parts))
    assert kind is p.Kind.PARTS
    back = p.decode_parts(header, bufs)
    assert [(x.request_id, x.index, x.final, len(x.tensors)) for x in back] == \
        [("a", 0, False, 1), ("b", 4, False, 1), ("a", 1, True, 0)]
    assert back[2].stats == {"queue_ms": 1.5}
    np.testing.assert_array_equal(p.to_numpy(back[1].tensors[0]), np.full((1, 3), 2.0))


def test_partial_and_stop_round_trip() -> None:
    msg = p.Partial(9, [p.PartialItem("0", False, [tensor(1.0, 2)]),
                        p.PartialItem("1", True, [])])
    kind, header, bufs = frames_of(p.encode_partial(msg))
    back = p.decode_partial(header, bufs)
    assert kind is p.Kind.PARTIAL and back.batch_id == 9
    assert [(x.item, x.final, len(x.tensors)) for x in back.parts] == [("0", False, 1),
                                                                      ("1", True, 0)]
    kind, header, _ = frames_of(p.encode(p.Stop(9, ["1", "3"])))
    assert kind is p.Kind.STOP and p.decode(p.Stop, header) == p.Stop(9, ["1", "3"])


def test_the_stream_flag_travels_only_when_set() -> None:
    x = [p.from_numpy("input", np.ones((1, 4), np.float32))]
    _, header, bufs = frames_of(p.encode_request(p.InferRequest("r", "m", x)))
    assert "stream" not in header and p.decode_request(header, bufs).stream is False
    _, header, bufs = frames_of(p.encode_request(p.InferRequest("r", "m", x, stream=True)))
    assert p.decode_request(header, bufs).stream is True
    with pytest.raises(p.ProtocolError, match="'stream'"):
        p.decode_request({**header, "stream": 1}, bufs)


@pytest.mark.parametrize("header, frames, match", [
    ({"id": 1, "parts": "x"}, [], "'parts': expected `array`, got `str`"),
    ({"id": 1, "parts": [["0", 1, []]]}, [], r"'parts\[0\]\.final': expected `bool`"),
    ({"id": 1, "parts": [["0", True, [["output", "FP32", [1, 3]]]]]}, [], "1 tensors declared"),
    ({"id": 1, "parts": [["0", True, []]]}, [b"x"], "carries 1 frames"),
    ({"id": 1, "parts": [["0", False, []]] * (p.MAX_BUNDLE + 1)}, [], "length <= 256"),
    ({"parts": []}, [], "missing required field `id`"),
])
def test_malformed_partials_are_protocol_errors(header: dict[str, Any], frames: list[bytes],
                                               match: str) -> None:
    with pytest.raises(p.ProtocolError, match=match):
        p.decode_partial(header, frames)


@given(st.dictionaries(st.sampled_from(["id", "model", "version", "index", "final", "tensors",
                                        "stats"]),
                       st.one_of(st.none(), st.booleans(), st.integers(), st.floats(),
                                 st.text(max_size=3), st.lists(st.integers(), max_size=2),
                                 st.dictionaries(st.text(max_size=2), st.integers(),
                                                 max_size=1))),
       st.lists(st.binary(max_size=8), max_size=2))
def test_any_part_decodes_or_is_a_protocol_error(part: dict[str, Any],
                                                 frames: list[bytes]) -> None:
    for decode, header in ((p.decode_parts, {"parts": [part]}),
                           (p.decode_partial, {"id": 1, "parts": [list(part.values())]})):
        try:
            decode(header, frames)
        except p.ProtocolError:
            pass


# -- the config -------------------------------------------------------------------

def decoupled_config(**extra: Any) -> dict[str, Any]:
    return {**linear_config("s", mbs=4), "platform": "python",
            "model_transaction_policy": {"decoupled": True}, **extra}


def test_the_transaction_policy_is_parsed_validated_and_written_back() -> None:
    cfg = parse_config(decoupled_config(), "test")
    assert cfg.decoupled and cfg.to_json()["model_transaction_policy"] == {"decoupled": True}
    assert parse_config(cfg.to_json(), "again").decoupled
    assert not parse_config(linear_config("m"), "test").decoupled
    with pytest.raises(ConfigError, match="needs platform 'python'"):
        parse_config({**linear_config("m"), "model_transaction_policy": {"decoupled": True}},
                     "test")
    for bad in ({"decoupled": "yes"}, {"other": True}, [True]):
        with pytest.raises(ConfigError, match="model_transaction_policy"):
            parse_config(decoupled_config(model_transaction_policy=bad), "test")


# -- the request path -------------------------------------------------------------

class Harness:
    def __init__(self, exec_ms: float = 30000.0, **config: Any) -> None:
        self.now = 0.0
        self.to_workers: list[tuple[bytes, list[Any]]] = []
        self.to_clients: list[tuple[bytes, list[Any]]] = []
        self.catalog = Catalog(Path("/nonexistent"))
        batching = {"max_execution_ms": exec_ms, **config.pop("dynamic_batching", {})}
        cfg = parse_config(decoupled_config(dynamic_batching=batching, **config), "test")
        model = CatalogModel(cfg, Path("/nonexistent/s"), (1,), {1})
        self.catalog.models["s"] = model
        self.scheduler = Scheduler()
        self.scheduler.set_policy("s", model.policy())
        self.pool = WorkerPool(self._to_worker, lambda: self.now)
        self.metrics = BrokerMetrics()
        self.path = RequestPath(self.catalog, self.scheduler, self.pool,
                                LatencyBook(enabled=False), self.metrics, self._to_client)

    def _to_worker(self, identity: bytes, frames: list[Any]) -> bool:
        self.to_workers.append((identity, frames))
        return True

    def _to_client(self, identity: bytes, frames: list[Any]) -> bool:
        self.to_clients.append((identity, frames))
        return True

    def worker(self, name: str, versions: tuple[int, ...] = (1,)) -> None:
        self.pool.register(name.encode(), p.WorkerReady(name, credits=2, models=[["s", 1]],
                                                        versions=list(versions)), self.now)

    def request(self, rid: str, stream: bool = True, timeout_ms: float = 0.0,
                priority: int = 0) -> None:
        req = p.InferRequest(rid, "s", [p.from_numpy("input", np.ones((1, 4), np.float32))],
                             priority=priority, timeout_ms=timeout_ms, stream=stream)
        _, header, bufs = frames_of(p.encode_request(req))
        self.path.on_request(b"client", header, bufs, self.now)

    def sent(self, kind: p.Kind) -> list[tuple[bytes, dict[str, Any], list[bytes]]]:
        out = []
        for identity, frames in self.to_workers:
            k, header, bufs = frames_of(frames)
            if k is kind:
                out.append((identity, header, bufs))
        return out

    def batches(self) -> list[tuple[bytes, p.Batch]]:
        got = [(i, p.decode_batch(h, b)) for i, h, b in self.sent(p.Kind.BATCH)]
        self.to_workers = [(i, f) for i, f in self.to_workers
                           if frames_of(f)[0] is not p.Kind.BATCH]
        return got

    def stops(self) -> list[p.Stop]:
        return [p.decode(p.Stop, h) for _, h, _ in self.sent(p.Kind.STOP)]

    def partial(self, identity: bytes, batch: p.Batch, parts: list[tuple[str, bool]]) -> None:
        msg = p.Partial(batch.batch_id, [p.PartialItem(item, final, [tensor(1.0)] if not final
                                                       else []) for item, final in parts])
        _, header, bufs = frames_of(p.encode_partial(msg))
        worker = self.pool.get(identity)
        assert worker is not None
        self.path.streaming.on_partial(worker, header, bufs, self.now)

    def end(self, identity: bytes, batch: p.Batch, error: str | None = None) -> None:
        _, header, bufs = frames_of(p.encode_result(p.BatchResult(batch.batch_id, [], 5.0,
                                                                  error=error)))
        worker = self.pool.get(identity)
        assert worker is not None
        self.path.on_result(worker, header, bufs, self.now)

    def answers(self) -> dict[str, list[tuple[str, Any]]]:
        """Per request, what it got in order: ("part", (index, final)) or ("error", code)."""
        out: dict[str, list[tuple[str, Any]]] = {}
        for _, frames in self.to_clients:
            kind, header, bufs = frames_of(frames)
            if kind is p.Kind.PARTS:
                for part in p.decode_parts(header, bufs):
                    out.setdefault(part.request_id, []).append(("part", (part.index,
                                                                         part.final)))
            elif kind is p.Kind.ERROR:
                out.setdefault(header["id"], []).append(("error", header["code"]))
            else:
                out.setdefault(header["id"], []).append((kind.name, None))
        return out

    def finals(self) -> dict[str, int]:
        """How many final answers each request got (a final part or an error)."""
        return {rid: sum(1 for what, v in got if what == "error" or (what == "part" and v[1])
                         or what == "REPLY")
                for rid, got in self.answers().items()}

    def empty(self) -> bool:
        return (self.path.open_count() == 0 and not self.path.streams
                and self.path.streams.sizes() == {"running": 0, "awaiting_first": 0}
                and not self.pool.inflight)


def test_a_unary_request_to_a_decoupled_model_is_refused() -> None:
    h = Harness()
    h.worker("w")
    h.request("u", stream=False)
    assert h.answers() == {"u": [("error", "unsupported")]}
    assert h.empty()


def test_parts_are_forwarded_in_order_and_the_result_ends_open_streams() -> None:
    h = Harness()
    h.worker("w")
    for rid in "ab":
        h.request(rid)
    h.path.dispatch(h.now)
    [(w, batch)] = h.batches()
    assert [i.request_id for i in batch.items] == ["0", "1"]
    h.partial(w, batch, [("0", False), ("1", False)])
    h.partial(w, batch, [("1", False)])
    h.partial(w, batch, [("0", False), ("1", True)])
    assert h.path.open_count() == 1            # b answered at its final part
    h.end(w, batch)                            # a never marked final: an empty final one
    assert h.answers() == {
        "a": [("part", (0, False)), ("part", (1, False)), ("part", (2, True))],
        "b": [("part", (0, False)), ("part", (1, False)), ("part", (2, True))]}
    assert h.empty()
    text = h.metrics.render()
    assert 'zeroserve_streams_total{model="s",status="ok"} 2.0' in text
    assert 'zeroserve_stream_responses_total{model="s"} 6.0' in text
    assert 'zeroserve_stream_first_response_seconds_count{model="s",tenant="anonymous"} 2.0' \
        in text
    # 6 responses on 2 streams: 4 came after another of their stream
    assert 'zeroserve_stream_response_gap_seconds_count{model="s",tenant="anonymous"} 4.0' \
        in text


def test_a_cancelled_stream_is_answered_once_and_stopped_at_its_worker() -> None:
    h = Harness()
    h.worker("w")
    h.request("a")
    h.request("b")
    h.path.dispatch(h.now)
    [(w, batch)] = h.batches()
    h.partial(w, batch, [("0", False), ("1", False)])
    h.path.on_cancel(b"client", "a")
    assert h.stops() == [p.Stop(batch.batch_id, ["0"])]
    h.partial(w, batch, [("0", False), ("1", True)])   # a's part, late: dropped
    h.end(w, batch)
    assert h.answers() == {"a": [("part", (0, False)), ("error", "cancelled")],
                           "b": [("part", (0, False)), ("part", (1, True))]}
    assert h.empty()


def test_a_client_that_goes_away_stops_its_running_streams() -> None:
    h = Harness()
    h.worker("w")
    h.request("a")
    h.path.dispatch(h.now)
    [(w, batch)] = h.batches()
    h.partial(w, batch, [("0", False)])
    assert h.path.client_gone(b"client") == 1
    assert h.stops() == [p.Stop(batch.batch_id, ["0"])]
    assert h.path.open_count() == 0
    assert batch.batch_id in h.pool.inflight   # the slot frees when the worker stops
    h.end(w, batch)
    assert h.finals() == {"a": 1} and h.empty()


def test_the_deadline_bounds_the_first_response_only() -> None:
    h = Harness()
    h.worker("w")
    h.request("slow", timeout_ms=100)
    h.request("fast", timeout_ms=100)
    h.path.dispatch(h.now)
    [(w, batch)] = h.batches()
    h.now = 0.05
    h.partial(w, batch, [("1", False)])            # fast: its first response in time
    assert h.path.next_due(h.now) == pytest.approx(0.1)
    h.now = 0.2
    h.path.expire(h.now)
    assert h.stops() == [p.Stop(batch.batch_id, ["0"])]
    h.now = 5.0
    h.path.expire(h.now)
    h.partial(w, batch, [("1", True)])
    h.end(w, batch)
    assert h.answers() == {"slow": [("error", "deadline")],
                           "fast": [("part", (0, False)), ("part", (1, True))]}
    assert h.empty()


def test_a_lost_worker_retries_streams_without_responses_and_fails_the_others() -> None:
    h = Harness()
    h.worker("w0")
    h.request("started")
    h.request("fresh")
    h.path.dispatch(h.now)
    [(w, batch)] = h.batches()
    h.worker("w1")
    h.partial(w, batch, [("0", False)])
    worker = h.pool.get(w)
    assert worker is not None
    h.path.worker_lost(h.pool.remove(worker, Loss.CRASHED), Loss.CRASHED, "w0", h.now)
    h.path.dispatch(h.now)
    [(w1, retry)] = h.batches()
    assert w1 == b"w1" and len(retry.items) == 1
    h.partial(w1, retry, [("0", False), ("0", True)])
    h.end(w1, retry)
    answers = h.answers()
    assert answers["started"][-1] == ("error", "worker_lost")
    assert answers["fresh"] == [("part", (0, False)), ("part", (1, True))]
    assert h.finals() == {"started": 1, "fresh": 1} and h.empty()


def test_a_model_error_mid_stream_fails_only_the_streams_still_open() -> None:
    h = Harness()
    h.worker("w")
    h.request("a")
    h.request("b")
    h.path.dispatch(h.now)
    [(w, batch)] = h.batches()
    h.partial(w, batch, [("0", True), ("1", False)])
    h.end(w, batch, error="RuntimeError: boom")
    assert h.answers() == {"a": [("part", (0, True))],
                           "b": [("part", (0, False)), ("error", "model_error")]}
    assert h.empty()


def test_a_malformed_partial_fails_the_batch_and_stops_it() -> None:
    h = Harness()
    h.worker("w")
    h.request("a")
    h.path.dispatch(h.now)
    [(w, batch)] = h.batches()
    worker = h.pool.get(w)
    assert worker is not None
    header = {"v": 2, "id": batch.batch_id, "parts": [["0", "yes", []]]}
    with pytest.raises(p.ProtocolError):
        h.path.streaming.on_partial(worker, header, [], h.now)
    assert h.stops() == [p.Stop(batch.batch_id, ["0"])]
    h.partial(w, batch, [("0", True)])   # whatever follows is dropped
    h.end(w, batch)
    assert h.answers() == {"a": [("error", "internal")]} and h.empty()
    raw = msgpack.packb({"v": 2, "id": 999, "parts": []})
    # an unknown batch: dropped
    h.path.streaming.on_partial(worker, msgpack.unpackb(raw), [], h.now)


def test_max_execution_bounds_the_time_between_responses() -> None:
    h = Harness(exec_ms=1000)
    h.worker("w")
    h.request("a")
    h.path.dispatch(h.now)
    [(w, batch)] = h.batches()
    for _ in range(5):                         # 4 s in all, 0.8 s between responses
        h.now += 0.8
        assert h.path.overdue(h.now) == []
        h.partial(w, batch, [("0", False)])
    h.now += 1.5
    assert h.path.overdue(h.now) == [w]        # silent past the bound: the worker is hung
    assert h.answers()["a"][-1] == ("error", "deadline") and h.finals() == {"a": 1}
