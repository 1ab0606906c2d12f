"""OpenAI's completions and chat through a real server, driven by the `openai` client
unchanged and by raw SSE, against an iterative model whose answer is known (it counts up
from the prompt's last word): streamed and not, stop strings, max_tokens, the end token,
usage, refusals in OpenAI's shape, a client that leaves freeing its sequence."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
from typing import Any, Iterator

import pytest

from tests import text as tx
from tests.conftest import Server, http, short_tmpdir, wait_for
from zeroserve.broker.client import Client

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    repo = short_tmpdir("zsoaig")
    tx.write_generator(repo, step_s=0.002)
    tx.write_generator(repo, "slow", step_s=0.1, most=2)
    tx.write_embedder(repo)
    srv = Server(repo).wait_ready()
    yield srv
    srv.stop()
    shutil.rmtree(repo, ignore_errors=True)


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[Any]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_a_completion_counts_up_to_max_tokens(client: Any) -> None:
    got = client.completions.create(model="gen", prompt="w3 w4", max_tokens=5)
    assert got.choices[0].text == "w5 w6 w7 w8 w9"
    assert got.choices[0].finish_reason == "length"
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (2, 5)


def test_the_end_token_stops_it(client: Any) -> None:
    got = client.completions.create(model="gen", prompt="w97", max_tokens=10)
    assert got.choices[0].text == "w98 w99" and got.choices[0].finish_reason == "stop"
    assert got.usage.completion_tokens == 3   # the end token counts


def test_chat_through_the_template_streamed_with_usage(client: Any) -> None:
    stream = client.chat.completions.create(
        model="gen", messages=[{"role": "system", "content": "w1"},
                               {"role": "user", "content": "w10 w11"}],
        max_completion_tokens=4, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "w12 w13 w14 w15"
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == "length" and not any(finish[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    # the template rendered "system: w1 user: w10 w11 assistant:": 6 tokens
    assert chunks[-1].usage.prompt_tokens == 6


def test_chat_whole_and_a_stop_string(client: Any) -> None:
    got = client.chat.completions.create(
        model="gen", messages=[{"role": "user", "content": "w20"}], max_tokens=20,
        stop=["w24"])
    assert got.choices[0].message.content == "w21 w22 w23 "
    assert got.choices[0].finish_reason == "stop"


def test_a_streamed_stop_string_never_sends_its_start(client: Any) -> None:
    stream = client.completions.create(model="gen", prompt="w30", max_tokens=30,
                                       stop=[" w35"], stream=True)
    text = "".join(c.choices[0].text for c in stream)
    assert text == "w31 w32 w33 w34"


def test_raw_sse_ends_with_done(server: Server) -> None:
    body = json.dumps({"model": "gen", "prompt": "w1", "max_tokens": 2,
                       "stream": True}).encode()
    status, headers, raw = http("POST", server.url + "/v1/completions", body,
                                {"Content-Type": "application/json"})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [e for e in raw.decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    texts = [json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]]
    assert "".join(texts) == "w2 w3"


@pytest.mark.parametrize("path,body,param,words", [
    ("/v1/chat/completions", {"model": "gen", "messages": []}, "messages", "non-empty"),
    ("/v1/chat/completions", {"model": "gen", "messages": [{"role": "user", "content": "w1"}],
                              "n": 2}, "n", "'n' > 1"),
    ("/v1/chat/completions", {"model": "gen", "messages": [{"role": "user", "content": "w1"}],
                              "tools": [{"type": "function"}]}, "tools", "not supported"),
    ("/v1/chat/completions", {"model": "gen", "messages": [{"role": "user", "content": "w1"}],
                              "logprobs": True}, "logprobs", "not supported"),
    ("/v1/chat/completions", {"model": "gen", "messages": [{"role": "user", "content": "w1"}],
                              "temperature": 0.7}, "temperature", "decodes greedily"),
    ("/v1/completions", {"model": "gen", "prompt": "w1", "max_tokens": 100}, "max_tokens",
     "maximum context length is 64"),
    ("/v1/completions", {"model": "gen", "prompt": ["w1", "w2"]}, "prompt", "one prompt"),
    ("/v1/completions", {"model": "emb", "prompt": "w1"}, "model", "does not generate"),
    ("/v1/embeddings", {"model": "gen", "input": "w1"}, "model", "does not answer embeddings"),
])
def test_refusals_are_400s_in_openais_shape(server: Server, path: str, body: dict[str, Any],
                                            param: str, words: str) -> None:
    status, _, raw = http("POST", server.url + path, json.dumps(body).encode(),
                          {"Content-Type": "application/json"})
    assert status == 400, raw
    err = json.loads(raw)["error"]
    assert err["param"] == param and words in err["message"], err


def test_greedy_settings_are_accepted(client: Any) -> None:
    got = client.completions.create(model="gen", prompt="w3", max_tokens=2, temperature=0,
                                    top_p=1, seed=7)
    assert got.choices[0].text == "w4 w5"


def test_concurrent_streams_each_get_their_own_answer(server: Server) -> None:
    async def run() -> list[str]:
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        try:
            async def one(k: int) -> str:
                stream = await c.completions.create(model="gen", prompt=f"w{k}",
                                                    max_tokens=1 + k % 7, stream=True)
                return "".join([ch.choices[0].text async for ch in stream])
            return list(await asyncio.gather(*(one(k) for k in range(24))))
        finally:
            await c.close()
    got = asyncio.run(run())
    assert got == [tx.counted(k + 1, 1 + k % 7) for k in range(24)]
    # time to the first token and between tokens, per model and tenant
    _, _, raw = http("GET", server.url + "/metrics")
    for family in ("first_response", "response_gap"):
        assert any(line.startswith(f"zeroserve_stream_{family}_seconds_count{{") and
                   'model="gen"' in line and 'tenant="anonymous"' in line
                   for line in raw.decode().splitlines()), family


def test_a_client_that_leaves_frees_its_sequence(server: Server) -> None:
    body = json.dumps({"model": "slow", "prompt": "w1", "max_tokens": 60,
                       "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                  b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        assert s.recv(4096).startswith(b"HTTP/1.1 200")
    # 60 steps of 100 ms would hold it 6 s; gone, it leaves at the next step

    def empty() -> bool:
        with Client(server.control, timeout_s=10) as c:
            census = c.control("census")
        return bool(census) and not any(census.values())
    wait_for(empty, 2.5, "the sequence withdrawn")


@pytest.mark.parametrize("stream", [True, False])
def test_a_deadline_ends_a_generation_with_an_error(server: Server, stream: bool) -> None:
    body = json.dumps({"model": "slow", "prompt": "w1", "max_tokens": 60,
                       "stream": stream}).encode()
    # 60 steps of 100 ms would take 6 s: the deadline of 700 ms ends it
    status, _, raw = http("POST", server.url + "/v1/completions", body,
                          {"Content-Type": "application/json", "X-Timeout-Ms": "700"})
    if stream:
        assert status == 200
        events = [e for e in raw.decode().split("\n\n") if e]
        error = json.loads(events[-1][6:])["error"]   # an error event ends it, no [DONE]
        texts = [json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]]
        assert texts and "".join(texts).startswith("w2 w3")   # what came before it
    else:
        assert status == 504
        error = json.loads(raw)["error"]
    assert error["code"] == "deadline_exceeded" and "deadline passed after" in \
        error["message"]

    def empty() -> bool:
        with Client(server.control, timeout_s=10) as c:
            census = c.control("census")
        return bool(census) and not any(census.values())
    wait_for(empty, 2.5, "the sequence withdrawn at its deadline")
