"""A recurrent LM (a GRU: its state a hidden state, no key/value cache) as an iterative
Python handler behind OpenAI's completions and chat, through ``zeroserve serve`` and the
`openai` client: 16 concurrent completions of mixed prompt lengths, streamed and not,
through 4 sequence slots (requests wait, join mid-run and leave at every step), each
the text of the same GRU run alone in-process, a token at a time (a near-tie in
float32, top two logits within 1e-4, may flip a token, and is named); a client that
leaves frees its slot at the next step."""

from __future__ import annotations

import json
import random
import shutil
import socket
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.conftest import Server, short_tmpdir, wait_for
from tests.gru import TEMPLATE, greedy, write_gru
from tests.lm import check, complete_all, prompt_ids
from zeroserve.broker.client import Client

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(300)

SLOTS = 4


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Server, Path, Any, Path]]:
    repo = short_tmpdir("zsgru")
    trace = repo / "steps.log"
    folder, tokenizer = write_gru(repo, most=SLOTS, trace_to=trace)
    write_gru(repo, "slow", most=2, step_s=0.05)
    srv = Server(repo, workers=1).wait_ready(120)
    yield srv, folder, tokenizer, trace
    srv.stop()
    shutil.rmtree(repo, ignore_errors=True)


def empty(srv: Server) -> bool:
    with Client(srv.control, timeout_s=10) as c:
        census = c.control("census")
    return bool(census) and not any(census.values())


def test_concurrent_completions_equal_the_gru_alone(
        served: tuple[Server, Path, Any, Path]) -> None:
    srv, folder, tokenizer, trace = served
    rng = random.Random(11)
    # a GRU forgets: only a short prompt's answer shows its first tokens were read
    plan = [(rng.randint(4, 8) if k < 4 else rng.randint(4, 200), rng.randint(1, 48))
            for k in range(16)]
    prompts = [prompt_ids(tokenizer, i, n) for i, (n, _) in enumerate(plan)]
    trace.write_text("")

    got = complete_all(srv.url, "gru", prompts, [m for _, m in plan])
    notes: list[str] = []
    for ids, (_, m), (text, finish) in zip(prompts, plan, got):
        check(folder, tokenizer, ids, m, text, notes, greedy)
        assert finish in ("length", "stop")
    assert len(notes) <= 2, notes
    assert len({text for text, _ in got}) > 8   # the prompts steer it: not one answer
    # 16 requests through 4 slots: never more than 4 stepped at once, and sequences
    # joined while others ran on (a step that kept some and took in a new one)
    steps = [set(line.split()) for line in trace.read_text().splitlines()]
    assert steps and max(len(s) for s in steps) == SLOTS
    assert any(a & b and b - a for a, b in zip(steps, steps[1:])), "no join mid-run"
    assert len(set().union(*steps)) == len(plan)
    wait_for(lambda: empty(srv), 10, "the broker to hold nothing")


def test_chat_streamed_is_the_template_and_the_gru_alone(
        served: tuple[Server, Path, Any, Path]) -> None:
    srv, folder, tokenizer, _ = served
    messages = [{"role": "system", "content": "kato rine"},
                {"role": "user", "content": "musa lope dife"}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             chat_template=TEMPLATE, tokenize=False)
    ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0) as c:
        chunks = list(c.chat.completions.create(
            model="gru", messages=messages, max_tokens=24, stream=True,
            stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert chunks[-1].usage.prompt_tokens == len(ids)
    notes: list[str] = []
    check(folder, tokenizer, ids, 24, text, notes, greedy)
    assert len(notes) <= 1, notes


def test_a_client_that_leaves_frees_its_slot(
        served: tuple[Server, Path, Any, Path]) -> None:
    srv, _, _, _ = served
    body = json.dumps({"model": "slow", "prompt": "kato rine musa", "max_tokens": 400,
                       "stream": True}).encode()
    # two clients take both of slow's slots and leave: 400 steps of 50 ms would hold
    # each 20 s; gone, they leave at the next step
    for _ in range(2):
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            assert s.recv(4096).startswith(b"HTTP/1.1 200")
    wait_for(lambda: empty(srv), 2.5, "the sequences withdrawn")
    # and a slot serves the next request at once, where a held one would make it wait
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0,
                       timeout=5) as c:
        got = c.completions.create(model="slow", prompt="kato", max_tokens=3)
    assert got.usage.completion_tokens >= 1
