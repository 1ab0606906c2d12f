"""OpenTelemetry mode through real processes: ``zeroserve serve --trace-config
mode=opentelemetry`` exporting over OTLP/HTTP to a real receiver in this test (an HTTP
server on loopback that decodes each ``ExportTraceServiceRequest`` with
opentelemetry-proto). Requests over HTTP, gRPC and the direct client with a
``traceparent`` give the gateway's span (a child of the caller's), the queue span
(a child of the gateway's, or of a direct caller's) and a batch span linking every
request it held; sampling at 0 and at a rate, an unsampled caller, and the settings
changed at run time through tritonclient."""

from __future__ import annotations

import asyncio
import json
import queue
import secrets
import shutil
from typing import Any, Iterator

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests import text as tx
from tests.conftest import Server, http, linear_config, short_tmpdir, wait_for, write_model
from zeroserve.broker.client import AsyncClient, Client

pytest.importorskip("opentelemetry.proto", reason="opentelemetry-proto is not installed "
                    "(pip install 'zeroserve[otel]')")
from tests.otlp import Receiver, Span  # noqa: E402 (after the skip: it imports the proto)

pytestmark = pytest.mark.timeout(180)

X = np.ones((1, 4), np.float32)
SERVER, INTERNAL = 2, 1   # the proto's Span.SpanKind values
SKEW_NS = 200_000   # how far two processes' wall-clock conversions may disagree


def caller(sampled: bool = True) -> tuple[str, str, str]:
    """A caller's (traceparent, trace id, span id)."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-{'01' if sampled else '00'}", trace_id, span_id


# a decoupled model: input [[n, ...]] answers n responses of [[k, k, k]]
COUNTER = '''
import torch


class Model:
    def load(self, version_dir, device):
        pass

    def predict(self, inputs, rows):
        counts = [int(inputs["input"][r][0, 0]) for r in rows]
        for k in range(1, max(counts) + 1):
            yield {i: ({"output": torch.full((1, 3), float(k))}, k == n)
                   for i, n in enumerate(counts) if k <= n}
'''


class World:
    def __init__(self) -> None:
        self.receiver = Receiver()
        self.repo = short_tmpdir("zsrepo")
        # requests that arrive within 100 ms of each other share a batch
        write_model(self.repo, "linear", 1, "nn.Linear(4, 3)", linear_config(
            "linear", dynamic_batching={"max_queue_delay_ms": 100}))
        (self.repo / "counter" / "1").mkdir(parents=True)
        (self.repo / "counter" / "1" / "model.py").write_text(COUNTER)
        (self.repo / "counter" / "config.json").write_text(json.dumps({
            **linear_config("counter"), "platform": "python",
            "model_transaction_policy": {"decoupled": True}, "warmup": {"batch_sizes": []}}))
        # an ensemble of two steps: linear, then head (broker/server/pipeline.py)
        write_model(self.repo, "head", 1, "nn.Linear(3, 3)", linear_config("head", 3, 3))
        (self.repo / "pipe" / "1").mkdir(parents=True)
        (self.repo / "pipe" / "config.json").write_text(json.dumps({
            "name": "pipe", "platform": "ensemble", "max_batch_size": 8,
            "inputs": [{"name": "RAW", "datatype": "FP32", "shape": [4]}],
            "outputs": [{"name": "OUT", "datatype": "FP32", "shape": [3]}],
            "ensemble_scheduling": {"step": [
                {"model_name": "linear", "model_version": -1, "input_map": {"input": "RAW"},
                 "output_map": {"output": "mid"}},
                {"model_name": "head", "model_version": -1, "input_map": {"input": "mid"},
                 "output_map": {"output": "OUT"}}]}}))
        tx.write_embedder(self.repo)   # a text model: its batches count their tokens
        self.server = Server(self.repo, extra=[
            "--trace-config", "mode=opentelemetry", "--trace-config",
            f"opentelemetry,url=127.0.0.1:{self.receiver.port}/v1/traces",
            "--trace-config", "opentelemetry,resource=deployment.environment=test",
            "--trace-config", "opentelemetry,bsp_schedule_delay=50"],
            env={"OTEL_SERVICE_NAME": "zs-under-test"}).wait_ready()
        self.triton = httpclient.InferenceServerClient(f"127.0.0.1:{self.server.port}")

    def http_infer(self, headers: dict[str, str] | None = None) -> None:
        x = httpclient.InferInput("input", [1, 4], "FP32")
        x.set_data_from_numpy(X)
        self.triton.infer("linear", [x], headers=headers or {})

    def spans_of(self, trace_id: str, names: set[str]) -> dict[str, Span]:
        """The spans named ``names`` of one trace, once all have come (one each)."""
        def arrived() -> dict[str, Span] | None:
            got = {s.name: s for s in self.receiver.of_trace(trace_id)}
            return got if names <= got.keys() else None
        found: dict[str, Span] = wait_for(arrived, 20, f"spans {sorted(names)} of {trace_id}")
        assert len(self.receiver.of_trace(trace_id)) == len(names), \
            self.receiver.of_trace(trace_id)
        return found

    def batch_of(self, trace_id: str, queue: Span) -> Span:
        (batch,) = wait_for(lambda: self.receiver.batches_linking(trace_id), 20,
                            f"the batch span linking {trace_id}")
        assert (trace_id, queue.span_id) in batch.links
        return batch

    def close(self) -> None:
        self.triton.close()
        self.server.stop()
        self.receiver.close()
        shutil.rmtree(self.repo, ignore_errors=True)


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    w = World()
    yield w
    w.close()


@pytest.fixture
def traced(world: World) -> Iterator[World]:
    """Every request traced unless its caller says no."""
    world.triton.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"],
                                                 "trace_rate": "1", "trace_count": "-1"})
    yield world
    world.triton.update_trace_settings(settings={"trace_level": ["OFF"], "trace_rate": None})


def check_request(world: World, trace_id: str, caller_span: str, protocol: str) -> None:
    """The gateway's span under the caller's, the queue span under it, a batch linking."""
    spans = world.spans_of(trace_id, {"gateway", "queue"})
    gateway, queue = spans["gateway"], spans["queue"]
    assert (gateway.parent, gateway.kind) == (caller_span, SERVER)
    assert gateway.attributes["zeroserve.model"] == "linear"
    assert gateway.attributes["zeroserve.protocol"] == protocol
    assert gateway.attributes["zeroserve.model.version"] == 1
    assert gateway.events == (("HTTP_RECV_START", "HTTP_RECV_END", "HTTP_SEND_START",
                               "HTTP_SEND_END") if protocol == "http" else
                              ("GRPC_WAITREAD_END", "GRPC_SEND_START", "GRPC_SEND_END"))
    assert (queue.parent, queue.kind) == (gateway.span_id, INTERNAL)
    # across processes, each turned its monotonic stamps into wall-clock time itself
    assert gateway.start_ns <= queue.start_ns + SKEW_NS
    assert queue.start_ns < queue.end_ns <= gateway.end_ns + SKEW_NS
    batch = world.batch_of(trace_id, queue)
    assert queue.end_ns <= batch.start_ns + SKEW_NS
    assert batch.start_ns < batch.end_ns <= gateway.end_ns + SKEW_NS
    assert batch.parent == "" and batch.trace_id != trace_id   # a root of its own
    assert gateway.resource["service.name"] == "zs-under-test"   # OTEL_SERVICE_NAME
    assert gateway.resource["deployment.environment"] == "test"
    assert (gateway.resource["zeroserve.component"], batch.resource["zeroserve.component"]) \
        == ("gateway", "worker")


def test_settings_show_the_mode_and_change_at_run_time(world: World) -> None:
    t = world.triton
    assert t.get_trace_settings()["trace_mode"] == "opentelemetry"
    assert t.get_trace_settings()["trace_level"] == ["OFF"]
    tp, trace_id, _ = caller()
    world.http_infer({"traceparent": tp})   # OFF: nothing, even for a sampled caller
    t.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"], "trace_rate": "1"})
    try:
        marker, marker_id, span = caller()
        world.http_infer({"traceparent": marker})
        world.spans_of(marker_id, {"gateway", "queue"})
        world.batch_of(marker_id, world.spans_of(marker_id, {"gateway", "queue"})["queue"])
        assert world.receiver.of_trace(trace_id) == []
        assert not world.receiver.batches_linking(trace_id)
        # a model's own setting: OFF for it alone
        t.update_trace_settings("linear", {"trace_level": ["OFF"]})
        tp, trace_id, _ = caller()
        world.http_infer({"traceparent": tp})
        t.update_trace_settings("linear", {"trace_level": None})
        marker, marker_id, span = caller()
        world.http_infer({"traceparent": marker})
        world.batch_of(marker_id, world.spans_of(marker_id, {"gateway", "queue"})["queue"])
        assert world.receiver.of_trace(trace_id) == []
    finally:
        t.update_trace_settings(settings={"trace_level": ["OFF"], "trace_rate": None})


def test_an_http_request_gives_the_gateway_queue_and_batch_spans(traced: World) -> None:
    tp, trace_id, span_id = caller()
    traced.http_infer({"traceparent": tp, "tracestate": "vendor=1"})
    check_request(traced, trace_id, span_id, "http")


def test_a_grpc_request_gives_the_same_spans(traced: World) -> None:
    client = grpcclient.InferenceServerClient(traced.server.grpc_url)
    try:
        x = grpcclient.InferInput("input", [1, 4], "FP32")
        x.set_data_from_numpy(X)
        tp, trace_id, span_id = caller()
        client.infer("linear", [x], headers={"traceparent": tp})
    finally:
        client.close()
    check_request(traced, trace_id, span_id, "grpc")


def test_a_direct_clients_context_is_the_queue_spans_parent(traced: World) -> None:
    tp, trace_id, span_id = caller()
    with Client(traced.server.frontend) as c:
        c.infer("linear", {"input": X}, traceparent=tp)
    queue = traced.spans_of(trace_id, {"queue"})["queue"]   # no gateway on its way
    assert queue.parent == span_id
    traced.batch_of(trace_id, queue)


def test_a_batch_span_links_every_request_it_held(traced: World) -> None:
    callers = [caller() for _ in range(4)]

    async def send() -> None:
        async with AsyncClient(traced.server.frontend) as c:
            assert await c.wait_connected(10)
            await asyncio.gather(*(c.infer("linear", {"input": X}, traceparent=tp)
                                   for tp, _, _ in callers))
    asyncio.run(send())
    queues = {trace_id: traced.spans_of(trace_id, {"queue"})["queue"]
              for _, trace_id, _ in callers}
    batches = {s.span_id: s for trace_id, q in queues.items()
               for s in [traced.batch_of(trace_id, q)]}
    for batch in batches.values():   # each batch links each request it ran, once
        assert len(batch.links) == len(set(batch.links)) == \
            batch.attributes["zeroserve.batch.requests"]
    assert sum(len(b.links) for b in batches.values()) == len(callers)
    assert max(len(b.links) for b in batches.values()) > 1, "no batch held several"


def test_a_text_models_batch_span_counts_its_tokens(traced: World) -> None:
    tp, trace_id, _ = caller()
    ids = np.array([[2, 7, 9, 11, 3]], np.int64)
    with Client(traced.server.frontend) as c:
        c.infer("emb", {"input_ids": ids, "attention_mask": np.ones_like(ids)},
                traceparent=tp)
    queue = traced.spans_of(trace_id, {"queue"})["queue"]
    assert traced.batch_of(trace_id, queue).attributes["zeroserve.batch.tokens"] == 5


def test_sampling_at_zero_at_a_rate_and_an_unsampled_caller(traced: World) -> None:
    t = traced.triton
    before = {s.trace_id for s in traced.receiver.spans}
    unsampled, unsampled_id, _ = caller(sampled=False)
    t.update_trace_settings(settings={"trace_rate": "0"})
    for _ in range(5):
        traced.http_infer()                                # ratio 0: never on its own
    traced.http_infer({"traceparent": unsampled})        # the caller said no
    with Client(traced.server.frontend) as c:            # nor from the direct client
        c.infer("linear", {"input": X}, traceparent=unsampled)
    marker, marker_id, _ = caller()
    traced.http_infer({"traceparent": marker})           # the caller said yes
    traced.batch_of(marker_id, traced.spans_of(marker_id, {"gateway", "queue"})["queue"])
    new = {s.trace_id for s in traced.receiver.spans if s.name != "batch"} - before
    assert new == {marker_id}
    assert not traced.receiver.batches_linking(unsampled_id)
    # a ratio of 1/2: about half of 60 requests without a context
    t.update_trace_settings(settings={"trace_rate": "2"})
    before = {s.trace_id for s in traced.receiver.spans}
    for _ in range(60):
        traced.http_infer()
    marker, marker_id, _ = caller()
    traced.http_infer({"traceparent": marker})
    traced.spans_of(marker_id, {"gateway", "queue"})
    with traced.receiver.lock:
        roots = {s.trace_id for s in traced.receiver.spans
                 if s.name == "gateway" and s.parent == ""} - before
    assert 10 <= len(roots) <= 50, len(roots)   # binomial(60, 1/2): outside is < 1e-6
    assert t.get_trace_settings()["trace_rate"] == "2"


def check_stream(world: World, trace_id: str, caller_span: str, gateway: bool) -> None:
    """A stream's spans: the gateway's (when it came through one) under the caller's,
    its queue span under that, and the batch that ran it linking the queue span."""
    spans = world.spans_of(trace_id, {"gateway", "queue"} if gateway else {"queue"})
    queue_span = spans["queue"]
    parent = caller_span
    if gateway:
        assert (spans["gateway"].parent, spans["gateway"].kind) == (caller_span, SERVER)
        assert spans["gateway"].attributes["zeroserve.model"] == "counter"
        parent = spans["gateway"].span_id
    assert queue_span.parent == parent
    batch = world.batch_of(trace_id, queue_span)
    assert batch.attributes["zeroserve.model"] == "counter"
    if gateway:   # the stream's span lasts until its last response was sent
        assert batch.end_ns <= spans["gateway"].end_ns + SKEW_NS


def test_streams_are_traced_over_http_grpc_and_the_direct_client(traced: World) -> None:
    three = np.array([[3, 0, 0, 0]], np.float32)
    tp, trace_id, span_id = caller()
    status, _, body = http("POST", traced.server.url + "/v2/models/counter/generate_stream",
                           json.dumps({"input": [3, 0, 0, 0]}).encode(),
                           {"traceparent": tp})
    assert status == 200 and body.count(b"data: ") == 3
    check_stream(traced, trace_id, span_id, gateway=True)

    tp, trace_id, span_id = caller()
    answers: queue.Queue[Any] = queue.Queue()
    client = grpcclient.InferenceServerClient(traced.server.grpc_url)
    try:
        client.start_stream(callback=lambda result, error: answers.put(error),
                            headers={"traceparent": tp})
        x = grpcclient.InferInput("input", [1, 4], "FP32")
        x.set_data_from_numpy(three)
        client.async_stream_infer("counter", [x])
        assert [answers.get(timeout=30) for _ in range(3)] == [None] * 3
    finally:
        client.stop_stream()
        client.close()
    check_stream(traced, trace_id, span_id, gateway=True)

    tp, trace_id, span_id = caller()
    with Client(traced.server.frontend) as c:
        assert len(list(c.stream("counter", {"input": three}, traceparent=tp))) == 3
    check_stream(traced, trace_id, span_id, gateway=False)


def test_an_ensemble_gives_one_span_per_step_under_the_requests(traced: World) -> None:
    """The gateway's span holds one ``step`` span a step, in the graph's order; each
    step's queue span is the gateway's child too (the step carries the request's
    context)."""
    wait_for(lambda: traced.triton.is_model_ready("pipe"), 60, "the ensemble ready")
    x = httpclient.InferInput("RAW", [1, 4], "FP32")
    x.set_data_from_numpy(X)
    tp, trace_id, span_id = caller()
    traced.triton.infer("pipe", [x], headers={"traceparent": tp})

    def arrived() -> list[Span] | None:
        got = traced.receiver.of_trace(trace_id)
        names = sorted(s.name for s in got)
        return got if names == ["gateway", "queue", "queue", "step", "step"] else None
    spans = wait_for(arrived, 20, f"the ensemble's spans of {trace_id}")
    (gateway,) = [s for s in spans if s.name == "gateway"]
    assert gateway.parent == span_id and gateway.attributes["zeroserve.model"] == "pipe"
    steps = sorted((s for s in spans if s.name == "step"), key=lambda s: s.start_ns)
    assert [s.attributes["zeroserve.model"] for s in steps] == ["linear", "head"]
    for s in steps:
        assert (s.parent, s.kind) == (gateway.span_id, INTERNAL)
        assert s.attributes["zeroserve.model.version"] == 1
        assert gateway.start_ns <= s.start_ns + SKEW_NS
        assert s.start_ns < s.end_ns <= gateway.end_ns + SKEW_NS
    assert steps[0].end_ns <= steps[1].start_ns + SKEW_NS   # one after the other
    assert all(q.parent == gateway.span_id for q in spans if q.name == "queue")
