"""Decoupled models served for real: ``zeroserve serve`` with the example chargen model
(examples/chargen), a slow "ticker" stream model and a plain one, through
``Client.stream``, ``AsyncClient.stream`` and HTTP generate / generate_stream."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from http.client import HTTPConnection, HTTPResponse
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from zeroserve.broker.client import AsyncClient, Client, ErrorCode, InferError
from zeroserve.models.repository import version_sha256
from tests.conftest import ROOT, Server, http, linear_config, short_tmpdir, wait_for, \
    write_model

pytestmark = pytest.mark.timeout(240)

# one response per request every 20 ms: slow enough to be cancelled or killed mid-stream
TICKER = '''
import time
from http.client import HTTPConnection, HTTPResponse
import torch


class Model:
    def load(self, version_dir, device):
        self.steps = 0

    def predict(self, inputs, rows):
        counts = [int(inputs["input"][r][0, 0]) for r in rows]
        fail = [float(inputs["input"][r][0, 1]) == -1.0 for r in rows]
        sent = [0] * len(rows)
        while True:
            if any(fail) and any(sent):
                raise RuntimeError("ticker failed on purpose")
            time.sleep(0.02)  # noqa: sleep-ok (the model under test is slow on purpose)
            self.steps += 1
            step = {}
            for i, n in enumerate(counts):
                if sent[i] < n:
                    sent[i] += 1
                    step[i] = ({"output": torch.full((1, 3), float(sent[i]))}, sent[i] == n)
            if not step:
                return
            yield step
'''


def ticker_config() -> dict[str, Any]:
    return {**linear_config("ticker", mbs=8), "platform": "python",
            "model_transaction_policy": {"decoupled": True},
            "dynamic_batching": {"max_execution_ms": 5000}, "warmup": {"batch_sizes": []}}


def make_repo() -> Path:
    repo = short_tmpdir("zsrepo")
    shutil.copytree(ROOT / "examples" / "chargen", repo / "chargen")
    (repo / "ticker" / "1").mkdir(parents=True)
    (repo / "ticker" / "1" / "model.py").write_text(TICKER)
    (repo / "ticker" / "config.json").write_text(json.dumps(ticker_config()))
    write_model(repo, "linear", 1, "nn.Linear(4, 3)", linear_config("linear"))
    return repo


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    repo = make_repo()
    srv = Server(repo, workers=1).wait_ready(120)
    yield srv
    srv.stop()
    shutil.rmtree(repo, ignore_errors=True)


def prompt(text: str, n: int) -> dict[str, np.ndarray]:
    return {"text_input": np.array([[text.encode()]], dtype=object),
            "max_tokens": np.array([[n]], np.int32)}


def ticks(n: int) -> dict[str, np.ndarray]:
    return {"input": np.full((1, 4), float(n), np.float32)}


def status(srv: Server) -> dict[str, Any]:
    with Client(srv.control, timeout_s=5) as c:
        return c.control("status")  # type: ignore[no-any-return]


def settled(srv: Server) -> bool:
    """Nothing of any request left in the broker (open requests, streams, batches)."""
    st = status(srv)
    return st["open_requests"] == 0 and st["inflight_batches"] == 0 and \
        st["streams"] == {"running": 0, "awaiting_first": 0}


def text_of(responses: list[Any]) -> str:
    return "".join(r.outputs["text_output"].reshape(-1)[0].decode() for r in responses
                   if "text_output" in r.outputs)


def test_client_stream_yields_each_response_in_order_then_the_final(server: Server) -> None:
    with Client(server.frontend) as c:
        got = list(c.stream("chargen", prompt("the model ", 40)))
        again = list(c.stream("chargen", prompt("the model ", 40), timeout_ms=5000))
    assert [r.index for r in got] == list(range(40))
    assert [r.final for r in got] == [False] * 39 + [True]
    assert all(r.model == "chargen" and r.version == 1 for r in got)
    # every part names the build that generated it
    assert {r.build for r in got} == {version_sha256(server.model_dir / "chargen" / "1")}
    assert len(text_of(got)) == 40 and text_of(got) == text_of(again)   # seeded by prompt
    assert got[-1].stats["responses"] == 40


def test_zero_tokens_is_one_empty_final_response(server: Server) -> None:
    with Client(server.frontend) as c:
        [only] = list(c.stream("chargen", prompt("x", 0)))
    assert only.final and only.index == 0 and only.outputs == {}


def test_unary_infer_on_a_decoupled_model_is_refused(server: Server) -> None:
    with Client(server.frontend) as c:
        with pytest.raises(InferError) as err:
            c.infer("chargen", prompt("a", 3))
    assert err.value.code is ErrorCode.UNSUPPORTED
    status_code, _, body = http("POST", server.url + "/v2/models/chargen/infer", json.dumps(
        {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1, 1],
                     "data": ["a"]},
                    {"name": "max_tokens", "datatype": "INT32", "shape": [1, 1],
                     "data": [3]}]}).encode())
    assert status_code == 501
    assert json.loads(body)["error"] == ("HTTP end point doesn't support models with "
                                         "decoupled transaction policy")


def test_a_stream_on_a_plain_model_is_its_one_reply(server: Server) -> None:
    x = np.ones((2, 4), np.float32)
    with Client(server.frontend) as c:
        [only] = list(c.stream("linear", {"input": x}))
        unary = c.infer("linear", {"input": x})
    assert only.final and only.index == 0
    np.testing.assert_array_equal(only.outputs["output"], unary.outputs["output"])
    assert only.build == unary.build == version_sha256(server.model_dir / "linear" / "1")


def test_errors_raise_out_of_the_iteration(server: Server) -> None:
    with Client(server.frontend) as c:
        with pytest.raises(InferError) as err:
            list(c.stream("nope", prompt("a", 3)))
        assert err.value.code is ErrorCode.NOT_FOUND
        with pytest.raises(InferError) as err:
            list(c.stream("chargen", {"text_input": np.array([[b"a"]], dtype=object)}))
        assert err.value.code is ErrorCode.BAD_INPUT
        assert len(list(c.stream("chargen", prompt("a", 3)))) == 3   # the client still works


def test_async_client_stream_and_concurrent_streams_batch(server: Server) -> None:
    async def main() -> list[list[Any]]:
        async with AsyncClient(server.frontend) as c:
            await c.wait_connected(5)

            async def one(i: int) -> list[Any]:
                return [r async for r in c.stream("chargen", prompt(f"p{i} ", 10 + i))]
            return await asyncio.gather(*(one(i) for i in range(8)))
    results = asyncio.run(main())
    for i, got in enumerate(results):
        assert [r.index for r in got] == list(range(10 + i)) and got[-1].final
    with Client(server.frontend) as c:
        assert text_of(results[3]) == text_of(list(c.stream("chargen", prompt("p3 ", 13))))
    wait_for(lambda: settled(server), 10, "the broker to hold nothing")


def test_a_closed_stream_stops_the_generation_and_frees_the_worker(server: Server) -> None:
    with Client(server.frontend, timeout_s=10) as c:
        for _ in range(2):   # both of the worker's credits: each stream would run forever
            endless = c.stream("ticker", ticks(10**6))
            assert [next(endless).index for _ in range(3)] == [0, 1, 2]
            endless.close()
        start = time.monotonic()
        got = list(c.stream("ticker", ticks(5), timeout_ms=3000))
        assert [r.final for r in got] == [False] * 4 + [True]
        assert time.monotonic() - start < 3.0
    wait_for(lambda: settled(server), 10, "the broker to hold nothing")


def test_async_break_cancels_the_request(server: Server) -> None:
    async def main() -> None:
        async with AsyncClient(server.frontend) as c:
            await c.wait_connected(5)
            async with c.stream("ticker", ticks(10**6)) as endless:
                async for r in endless:
                    if r.index == 2:
                        break
            got = [r async for r in c.stream("ticker", ticks(3), timeout_ms=3000)]
            assert [r.index for r in got] == [0, 1, 2]
    asyncio.run(main())
    wait_for(lambda: settled(server), 10, "the broker to hold nothing")


def test_the_deadline_bounds_the_first_response(server: Server) -> None:
    with Client(server.frontend) as c:
        with pytest.raises(InferError) as err:   # the first tick takes 20 ms
            list(c.stream("ticker", ticks(3), timeout_ms=5))
        assert err.value.code is ErrorCode.DEADLINE
        got = list(c.stream("ticker", ticks(20), timeout_ms=200))   # runs ~400 ms in all
        assert len(got) == 20
    wait_for(lambda: settled(server), 10, "the broker to hold nothing")


class Answer:
    def __init__(self, resp: HTTPResponse) -> None:
        self.status = resp.status
        self.content_type = resp.getheader("Content-Type") or ""
        self.body = resp.read()


def post(srv: Server, path: str, doc: Any) -> Answer:
    conn = HTTPConnection("127.0.0.1", srv.port, timeout=30)
    try:
        conn.request("POST", path, json.dumps(doc).encode(),
                     {"Content-Type": "application/json"})
        return Answer(conn.getresponse())
    finally:
        conn.close()


def events(resp: Answer) -> list[dict[str, Any]]:
    body = resp.body.decode()
    assert body.endswith("\n\n")
    return [json.loads(chunk[len("data: "):]) for chunk in body.split("\n\n") if chunk]


def test_generate_stream_sends_each_response_as_an_event(server: Server) -> None:
    resp = post(server, "/v2/models/chargen/generate_stream",
                {"text_input": "the model ", "max_tokens": 25})
    assert resp.status == 200
    assert resp.content_type.startswith("text/event-stream")
    got = events(resp)
    assert len(got) == 25 and all(e["model_name"] == "chargen" and e["model_version"] == "1"
                                  for e in got)
    with Client(server.frontend) as c:
        assert "".join(e["text_output"] for e in got) == \
            text_of(list(c.stream("chargen", prompt("the model ", 25))))
    pinned = post(server, "/v2/models/chargen/versions/1/generate_stream",
                  {"text_input": "a", "parameters": {"max_tokens": 2}})
    assert pinned.status == 200 and len(events(pinned)) == 2


def test_generate_answers_one_document(server: Server) -> None:
    resp = post(server, "/v2/models/chargen/generate", {"text_input": "ab", "max_tokens": 5})
    assert resp.status == 200
    doc = json.loads(resp.body)
    assert set(doc) == {"model_name", "model_version", "text_output"}
    assert isinstance(doc["text_output"], str) and len(doc["text_output"]) == 1
    plain = post(server, "/v2/models/linear/generate", {"input": [1, 2, 3, 4]})
    assert plain.status == 200 and len(json.loads(plain.body)["output"]) == 3


def test_generate_errors_before_the_first_event_are_json_with_a_status(
        server: Server) -> None:
    for path, doc, status_code in [
            ("/v2/models/nope/generate_stream", {"text_input": "a"}, 404),
            ("/v2/models/chargen/generate_stream", {"text_input": "a"}, 400),   # no max_tokens
            ("/v2/models/chargen/generate_stream", ["not", "an", "object"], 400),
            ("/v2/models/chargen/generate", {"text_input": 3, "max_tokens": 1}, 400),
            ("/v2/models/chargen/versions/x/generate", {"text_input": "a"}, 400)]:
        resp = post(server, path, doc)
        assert resp.status == status_code, (path, resp.body)
        assert resp.content_type.startswith("application/json")
        assert "error" in json.loads(resp.body)


def test_a_model_error_after_the_first_event_is_an_error_event(server: Server) -> None:
    resp = post(server, "/v2/models/ticker/generate_stream", {"input": [5, -1, 0, 0]})
    assert resp.status == 200
    got = events(resp)
    assert got[0]["output"] == [1.0, 1.0, 1.0]
    assert got[1] == {"error": "RuntimeError: ticker failed on purpose"} and len(got) == 2


def test_a_client_that_leaves_generate_stream_frees_the_worker(server: Server) -> None:
    conn = HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request("POST", "/v2/models/ticker/generate_stream",
                     json.dumps({"input": [10**6, 0, 0, 0]}).encode())
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.readline().startswith(b"data: {")
    finally:
        conn.close()   # the client leaves: the request is cancelled, the worker freed
    with Client(server.frontend) as c:
        assert len(list(c.stream("ticker", ticks(3), timeout_ms=3000))) == 3
    wait_for(lambda: settled(server), 10, "the broker to hold nothing")


def test_stream_metrics_count_streams_responses_and_first_response(server: Server) -> None:
    with Client(server.frontend) as c:
        list(c.stream("chargen", prompt("m", 4)))
    _, _, body = http("GET", server.url + "/metrics")
    text = body.decode()
    for family in ("zeroserve_streams_total", "zeroserve_stream_responses_total",
                   "zeroserve_stream_first_response_seconds_bucket"):
        assert f'{family}{{' in text and 'model="chargen"' in text, family
