"""A stream of an iterative model, traced (opentelemetry mode, a real OTLP/HTTP receiver
in the test): its trace shows where its time went, a span each, never a span a token.
Beside its queue span (the broker's wait) a ``sequence`` span, from the worker's receipt
of the request to its last step, holds ``wait`` (for the step running to end, and a
slot), ``prefill`` (the handler's join) and ``steps`` (its first response to its last), with the
steps it answered and the times it was paused. Over OpenAI's completions route, the
gateway's span is their parent; with one slot, a VIP pauses a traced stream, and its
span says so."""

from __future__ import annotations

import asyncio
import json
import secrets
import shutil
import urllib.request
from typing import Any, Iterator

import numpy as np
import pytest

from tests.conftest import Server, short_tmpdir, wait_for
from tests.lm import prompt_ids, write_lm
from zeroserve.broker.client import AsyncClient, Client

pytest.importorskip("opentelemetry.proto", reason="opentelemetry-proto is not installed "
                    "(pip install 'zeroserve[otel]')")
from tests.otlp import Receiver, Span  # noqa: E402 (after the skip: it imports the proto)

pytestmark = pytest.mark.timeout(300)

SKEW_NS = 200_000   # how far two processes' wall-clock conversions may disagree
NAMES = {"queue", "sequence", "wait", "prefill", "steps"}


class World:
    def __init__(self) -> None:
        self.receiver = Receiver()
        self.repo = short_tmpdir("zsseqsp")
        # one slot: a VIP (priority 1) pauses the stream that holds it
        _, self.tokenizer = write_lm(self.repo, most=1, dynamic_batching={
            "priority_levels": 2, "default_priority": 2})
        config = json.loads((self.repo / "lm" / "config.json").read_text())
        config["text"] = {"task": "generate", "max_length": 512}
        (self.repo / "lm" / "config.json").write_text(json.dumps(config))
        self.server = Server(self.repo, extra=[
            "--trace-config", "mode=opentelemetry", "--trace-config", "level=TIMESTAMPS",
            "--trace-config", "rate=1",
            "--trace-config", f"opentelemetry,url=127.0.0.1:{self.receiver.port}/v1/traces",
            "--trace-config", "opentelemetry,bsp_schedule_delay=50"]).wait_ready(120)

    def spans_of(self, trace_id: str, names: set[str]) -> dict[str, Span]:
        """The spans named ``names`` of one trace, once all have come (one each)."""
        def arrived() -> dict[str, Span] | None:
            got = {s.name: s for s in self.receiver.of_trace(trace_id)}
            return got if names <= got.keys() else None
        found: dict[str, Span] = wait_for(arrived, 20, f"spans {sorted(names)} of {trace_id}")
        assert sorted(s.name for s in self.receiver.of_trace(trace_id)) == sorted(names)
        return found

    def close(self) -> None:
        self.server.stop()
        self.receiver.close()
        shutil.rmtree(self.repo, ignore_errors=True)


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    w = World()
    yield w
    w.close()


def caller() -> tuple[str, str, str]:
    """A sampled caller's (traceparent, trace id, span id)."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def inputs(ids: list[int], m: int) -> dict[str, np.ndarray]:
    return {"input_ids": np.array([ids], np.int64), "max_tokens": np.array([[m]], np.int32)}


def check_sequence(spans: dict[str, Span], parent: str, tokens: int, paused: int = 0
                   ) -> None:
    """The sequence's spans: beside the queue span, under ``parent``; its three parts
    in order, within it, and its attributes the same times."""
    queue, seq = spans["queue"], spans["sequence"]
    wait, prefill, steps = spans["wait"], spans["prefill"], spans["steps"]
    assert queue.parent == seq.parent == parent
    assert wait.parent == prefill.parent == steps.parent == seq.span_id
    assert seq.attributes["zeroserve.model"] == "lm"
    assert seq.attributes["zeroserve.sequence.steps"] == tokens
    assert steps.attributes["zeroserve.sequence.steps"] == tokens
    assert seq.attributes["zeroserve.sequence.paused"] == paused
    assert seq.attributes["zeroserve.sequence.waited_steps"] == 0   # a slot was free
    assert queue.end_ns <= seq.start_ns + SKEW_NS   # the worker took it once it was sent
    assert seq.start_ns == wait.start_ns <= wait.end_ns == prefill.start_ns
    assert prefill.start_ns < prefill.end_ns <= steps.start_ns <= steps.end_ns == seq.end_ns
    ms = 1e6
    assert seq.attributes["zeroserve.sequence.prefill_ms"] == pytest.approx(
        (prefill.end_ns - prefill.start_ns) / ms, abs=1e-3)
    assert seq.attributes["zeroserve.sequence.wait_ms"] == pytest.approx(
        (wait.end_ns - wait.start_ns) / ms, abs=1e-3)
    assert seq.attributes["zeroserve.sequence.first_response_ms"] == pytest.approx(
        (steps.start_ns - seq.start_ns) / ms, abs=1e-3)


def test_a_streams_trace_shows_its_queue_wait_prefill_and_steps(world: World) -> None:
    tp, trace_id, span_id = caller()
    with Client(world.server.frontend) as c:
        got = list(c.stream("lm", inputs(prompt_ids(world.tokenizer, 3, 20), 12),
                            traceparent=tp))
    tokens = sum(1 for r in got if "token_id" in r.outputs)
    assert tokens == 12
    check_sequence(world.spans_of(trace_id, NAMES), span_id, tokens)


def test_openai_completions_are_traced_under_the_gateways_span(world: World) -> None:
    tp, trace_id, span_id = caller()
    body = json.dumps({"model": "lm", "prompt": prompt_ids(world.tokenizer, 5, 16),
                       "max_tokens": 9, "stream": True}).encode()
    request = urllib.request.Request(world.server.url + "/v1/completions", body, {
        "Content-Type": "application/json", "traceparent": tp})
    with urllib.request.urlopen(request, timeout=60) as r:
        assert r.status == 200 and r.read().endswith(b"data: [DONE]\n\n")
    spans = world.spans_of(trace_id, NAMES | {"gateway"})
    gateway = spans["gateway"]
    assert gateway.parent == span_id and gateway.attributes["zeroserve.model"] == "lm"
    check_sequence(spans, gateway.span_id, 9)
    assert spans["sequence"].end_ns <= gateway.end_ns + SKEW_NS


def test_a_paused_streams_span_counts_its_pause(world: World) -> None:
    tp, trace_id, span_id = caller()
    low_tokens, vip_tokens = 400, 5

    async def run() -> tuple[int, int]:
        async with AsyncClient(world.server.frontend) as c:
            assert await c.wait_connected(10)
            counts = [0, 0]

            async def one(k: int, m: int, priority: int, **trace: Any) -> None:
                async for r in c.stream("lm", inputs(prompt_ids(world.tokenizer, k, 12), m),
                                        priority=priority, **trace):
                    counts[k] += "token_id" in r.outputs
            low = asyncio.create_task(one(0, low_tokens, 0, traceparent=tp))
            while counts[0] < 3:   # it holds the one slot
                await asyncio.sleep(0.005)   # noqa: sleep-ok (polls the count)
            await one(1, vip_tokens, 1)
            await low
            return counts[0], counts[1]
    assert asyncio.run(run()) == (low_tokens, vip_tokens)
    spans = world.spans_of(trace_id, NAMES)
    check_sequence(spans, span_id, low_tokens, paused=1)
