"""A request of 1,000 texts spread over many batches on two workers, one of which is
SIGKILLed mid-request: the request gets one answer (every vector right, or one error
naming an input), the broker keeps its pid, and nothing of the request remains."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
from typing import Any, Iterator

import numpy as np
import pytest

from tests import text as tx
from tests.conftest import Server, http, short_tmpdir, wait_for
from zeroserve.broker.client import Client

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def srv() -> Iterator[Server]:
    repo = short_tmpdir("zsoaif")
    tx.write_embedder(repo, batching={"max_batch_tokens": 256}, delay_s=0.01)
    server = Server(repo, workers=2)
    try:
        yield server.wait_ready(120)
    finally:
        server.stop()
        shutil.rmtree(repo, ignore_errors=True)


def batches(srv: Server) -> float:
    _, _, raw = http("GET", srv.url + "/metrics")
    return sum(float(line.rsplit(" ", 1)[1]) for line in raw.decode().splitlines()
               if line.startswith("zeroserve_batches_total{"))


def test_a_worker_killed_under_a_thousand_texts(srv: Server) -> None:
    broker = srv.pids("broker")
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0,
                           timeout=120)
    texts = [tx.distinct(i, 3 + i % 40) for i in range(1000)]   # no two alike
    outcomes: list[Any] = []

    def call() -> None:
        try:
            outcomes.append(client.embeddings.create(model="emb", input=texts,
                                                     encoding_format="float"))
        except openai.APIError as exc:
            outcomes.append(exc)

    before = batches(srv)
    t = threading.Thread(target=call)
    t.start()
    wait_for(lambda: batches(srv) >= before + 6, 60, "the request spread over batches")
    os.kill(srv.pids("worker")[0], signal.SIGKILL)
    t.join(120)
    assert not t.is_alive(), "the request got no answer"
    client.close()
    assert len(outcomes) == 1
    got = outcomes[0]
    if isinstance(got, openai.APIError):
        body = got.body if isinstance(got.body, dict) else json.loads(str(got.body))
        assert body["message"].startswith("input "), body   # which input failed
    else:
        assert len(got.data) == 1000
        from tokenizers import Tokenizer
        folder = short_tmpdir("zstok")
        tok = Tokenizer.from_file(str(tx.write_tokenizer(folder)))
        shutil.rmtree(folder, ignore_errors=True)
        for i in (0, 500, 999):
            ids = tok.encode(texts[i]).ids
            np.testing.assert_allclose(got.data[i].embedding, tx.reference(ids), atol=1e-4)
    assert srv.pids("broker") == broker, "the broker restarted"

    def empty() -> bool:
        with Client(srv.control, timeout_s=10) as c:
            census = c.control("census")
        return bool(census) and not any(census.values())
    wait_for(empty, 30, "nothing of the request left in the broker")
    # the server keeps serving
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0) as again:
        assert again.embeddings.create(model="emb", input="w1").data


def test_a_client_that_leaves_takes_its_texts_out_of_the_queue(srv: Server) -> None:
    import socket
    texts = [tx.distinct(i, 3 + i % 40) for i in range(1000)]
    body = json.dumps({"model": "emb", "input": texts}).encode()
    before = batches(srv)
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        s.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        wait_for(lambda: batches(srv) >= before + 3, 60, "the request's first batches")
    # the connection closed: the rest of its 1,000 texts leave the queue

    def empty() -> bool:
        with Client(srv.control, timeout_s=10) as c:
            census = c.control("census")
        return bool(census) and not any(census.values())
    wait_for(empty, 30, "the texts withdrawn from the broker")
    ran = batches(srv) - before
    # 1,000 texts of 3-42 tokens under a budget of 256 tokens take over 100 batches
    assert ran < 60, f"{ran} batches ran for a client that had left"
