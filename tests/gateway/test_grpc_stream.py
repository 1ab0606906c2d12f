"""ModelStreamInfer on a decoupled model through tritonclient.grpc and its aio client
unchanged: many requests on one stream, each answered by every response it yields
(matched by id, in order, ``triton_final_response`` on each, the empty final response
only when asked); unary ModelInfer refuses the model with Triton's message; a stream
the client closes stops its generation."""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import shutil
import threading
from typing import Any, Iterator

import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.grpc.aio as tga
from tritonclient.utils import InferenceServerException

from zeroserve.broker import wording
from zeroserve.broker.client import Client
from tests.conftest import Server, linear_config, short_tmpdir, wait_for, write_model
from zeroserve.models.repository import version_sha256

pytestmark = pytest.mark.timeout(180)

# input [[n, fail]]: n responses of [[k, k, k]], then an empty final one (it says
# nothing more); fail -1 raises after the first response
COUNTER = '''
import time
import torch


class Model:
    def load(self, version_dir, device):
        pass

    def predict(self, inputs, rows):
        counts = [int(inputs["input"][r][0, 0]) for r in rows]
        fail = [float(inputs["input"][r][0, 1]) == -1.0 for r in rows]
        sent = [0] * len(rows)
        while any(sent[i] < n for i, n in enumerate(counts)):
            if any(f and s for f, s in zip(fail, sent)):
                raise RuntimeError("counter failed on purpose")
            time.sleep(0.01)  # noqa: sleep-ok (a model that produces step by step)
            step = {}
            for i, n in enumerate(counts):
                if sent[i] < n:
                    sent[i] += 1
                    step[i] = ({"output": torch.full((1, 3), float(sent[i]))}, False)
            yield step
'''

# one response, then a pause before the generator ends: its final part (empty, not asked
# for) arrives after the client has seen everything it will see
LINGERING = '''
import time
import torch


class Model:
    def load(self, version_dir, device):
        pass

    def predict(self, inputs, rows):
        yield {i: ({"output": torch.full((1, 3), 1.0)}, False) for i in range(len(rows))}
        time.sleep(0.5)  # noqa: sleep-ok (the pause under test)
'''


@pytest.fixture(scope="module")
def srv() -> Iterator[Server]:
    repo = short_tmpdir("zsrepo")
    (repo / "counter" / "1").mkdir(parents=True)
    (repo / "counter" / "1" / "model.py").write_text(COUNTER)
    (repo / "counter" / "config.json").write_text(json.dumps({
        **linear_config("counter", mbs=8, n_in=2), "platform": "python",
        "model_transaction_policy": {"decoupled": True}, "warmup": {"batch_sizes": []}}))
    (repo / "lingering" / "1").mkdir(parents=True)
    (repo / "lingering" / "1" / "model.py").write_text(LINGERING)
    (repo / "lingering" / "config.json").write_text(json.dumps({
        **linear_config("lingering", mbs=8, n_in=2), "platform": "python",
        "model_transaction_policy": {"decoupled": True}, "warmup": {"batch_sizes": []}}))
    write_model(repo, "linear", 1, "nn.Linear(2, 3)", linear_config("linear", n_in=2))
    server = Server(repo)
    try:
        yield server.wait_ready(120)
    finally:
        server.stop()
        shutil.rmtree(repo, ignore_errors=True)


def ask(n: int, fail: bool = False) -> list[tg.InferInput]:
    x = np.array([[n, -1.0 if fail else 0.0]], np.float32)
    return [tg.InferInput("input", [1, 2], "FP32").set_data_from_numpy(x)]


@contextlib.contextmanager
def stream(srv: Server) -> Iterator[tuple[tg.InferenceServerClient, "queue.Queue[Any]"]]:
    """A stream and the queue its answers arrive on. Leaving it half-closes the stream and
    waits, bounded, for the server to end the call (which it does once every request of
    the stream has had its last response); leaving it on an error cancels the stream, so
    the test fails with that error instead of waiting on the call."""
    answers: queue.Queue[Any] = queue.Queue()
    c = tg.InferenceServerClient(srv.grpc_url)
    c.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        yield c, answers
    except BaseException:
        c.stop_stream(cancel_requests=True)
        c.close()
        raise
    closing = threading.Thread(target=c.stop_stream, daemon=True)
    closing.start()
    closing.join(30)
    stuck = closing.is_alive()
    if stuck:
        c.stop_stream(cancel_requests=True)
    c.close()
    assert not stuck, "the server held the stream open 30 s after the client closed it"


def collect(srv: Server, requests: list[tuple[str, list[tg.InferInput], bool]],
            expected: int) -> list[tuple[Any, Any]]:
    with stream(srv) as (c, answers):
        for rid, inputs, empty_final in requests:
            c.async_stream_infer("counter", inputs, request_id=rid,
                                 enable_empty_final_response=empty_final)
        return [answers.get(timeout=30) for _ in range(expected)]


def test_many_requests_on_one_stream_each_answered_in_order(srv: Server) -> None:
    got = collect(srv, [("a", ask(3), False), ("b", ask(5), False), ("c", ask(1), True)],
                  3 + 5 + 1 + 1)
    by_id: dict[str, list[tuple[float | None, bool]]] = {}
    for result, error in got:
        assert error is None, error
        response = result.get_response()
        final = response.parameters["triton_final_response"].bool_param
        # every response names its build: the version and the sha256 of its files
        assert response.parameters["model_build"].string_param == \
            f"1/{version_sha256(srv.model_dir / 'counter' / '1')}"
        value = None if not response.outputs else float(result.as_numpy("output")[0, 0])
        by_id.setdefault(response.id, []).append((value, final))
    assert by_id["a"] == [(1.0, False), (2.0, False), (3.0, False)]
    assert by_id["b"] == [(float(k), False) for k in range(1, 6)]
    assert by_id["c"] == [(1.0, False), (None, True)]   # the empty final: asked for


def test_the_call_ends_once_its_last_request_ends_answering_nothing_more(
        srv: Server) -> None:
    with stream(srv) as (c, answers):
        c.async_stream_infer("lingering", ask(1), request_id="one")
        result, error = answers.get(timeout=30)
        assert error is None and result.get_response().id == "one"
    # closed while the request's final part was still to come: the server skips that part
    # (no empty final response asked for) and must still end the call
    assert answers.empty()


def test_an_error_mid_stream_is_that_requests_answer(srv: Server) -> None:
    # one after the other: a batch's exception fails every request still open in it
    with stream(srv) as (c, answers):
        c.async_stream_infer("counter", ask(3, fail=True), request_id="bad")
        first = [answers.get(timeout=30) for _ in range(2)]
        c.async_stream_infer("counter", ask(2), request_id="ok")   # the stream goes on
        then = [answers.get(timeout=30) for _ in range(2)]
    assert first[0][1] is None and first[0][0].get_response().id == "bad"
    assert "counter failed on purpose" in first[1][1].message()
    assert [(r.get_response().id, e) for r, e in then] == [("ok", None), ("ok", None)]


def test_unary_infer_refuses_a_decoupled_model(srv: Server) -> None:
    c = tg.InferenceServerClient(srv.grpc_url)
    try:
        with pytest.raises(InferenceServerException) as err:
            c.infer("counter", ask(2))
        assert str(err.value.status()) == "StatusCode.UNIMPLEMENTED"
        assert err.value.message() == wording.DECOUPLED_GRPC
        config = c.get_model_config("counter").config
        assert config.model_transaction_policy.decoupled
    finally:
        c.close()


def test_a_plain_model_on_the_same_stream(srv: Server) -> None:
    with stream(srv) as (c, answers):
        x = np.ones((1, 2), np.float32)
        c.async_stream_infer("linear", [tg.InferInput("input", [1, 2], "FP32")
                                        .set_data_from_numpy(x)], request_id="p")
        c.async_stream_infer("counter", ask(2), request_id="d")
        got = [answers.get(timeout=30) for _ in range(3)]
    plain = [r.get_response() for r, e in got if r.get_response().id == "p"]
    assert len(plain) == 1 and plain[0].parameters["triton_final_response"].bool_param


def test_aio_stream_and_a_client_that_leaves(srv: Server) -> None:
    async def run() -> list[float]:
        async with tga.InferenceServerClient(srv.grpc_url) as c:
            async def requests() -> Any:
                x = np.array([[1000, 0.0]], np.float32)   # far more than it waits for
                inp = tga.InferInput("input", [1, 2], "FP32")
                inp.set_data_from_numpy(x)
                yield {"model_name": "counter", "inputs": [inp], "request_id": "long"}
            seen: list[float] = []
            responses = c.stream_infer(requests())
            async for result, error in responses:
                assert error is None
                seen.append(float(result.as_numpy("output")[0, 0]))
                if len(seen) == 3:
                    responses.cancel()
                    break
            return seen
    assert asyncio.run(asyncio.wait_for(run(), 60)) == [1.0, 2.0, 3.0]
    wait_for(lambda: idle(srv), 10, "the stream to stop at the broker and the worker")
    got = collect(srv, [("after", ask(2), False)], 2)
    assert [e for _, e in got] == [None, None]


def idle(srv: Server) -> bool:
    with Client(srv.control, timeout_s=5) as c:
        st = c.control("status")
    return st["open_requests"] == 0 and st["inflight_batches"] == 0 and \
        st["streams"] == {"running": 0, "awaiting_first": 0}
