"""Every inference entry point is the same door (gateway/inference.py): flooded past the
gateway's in-flight bound with a model that holds its batch, HTTP v2 infer, gRPC
ModelInfer and ModelStreamInfer, generate, generate_stream, the seed's predict,
TorchServe's predictions and OpenAI's embeddings each shed what is past the bound at
once (503 with Retry-After over HTTP, UNAVAILABLE over gRPC), count it in the shed
counter, and never hold more in flight than the bound; what they let in is answered
once the model lets go."""

from __future__ import annotations

import json
import queue
import re
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest
import tritonclient.grpc as tg
from tritonclient.utils import InferenceServerException

from tests import text as tx
from tests.conftest import Server, http, linear_config, short_tmpdir, wait_for

pytestmark = pytest.mark.timeout(180)

BOUND = 3   # --max-in-flight
OVER = 4    # requests past the bound, each shed
X = [0.5, 0.5, 0.5, 0.5]

HELD = '''
import os
import time


class Model:
    """The input back, once the test creates RELEASE (bounded, so a failed test ends)."""

    def load(self, version_dir, device):
        pass

    def predict(self, inputs):
        deadline = time.monotonic() + 60
        while not os.path.exists(RELEASE) and time.monotonic() < deadline:
            time.sleep(0.01)  # noqa: sleep-ok (holds the batch until the test lets go)
        return {"output": inputs["input"]}
'''


class Rig:
    def __init__(self, srv: Server, release: Path) -> None:
        self.srv = srv
        self.release = release
        self.grpc = tg.InferenceServerClient(srv.grpc_url)

    def metric(self, pattern: str) -> float:
        _, _, text = http("GET", self.srv.url + "/metrics")
        return sum(float(v) for v in re.findall(pattern, text.decode(), re.MULTILINE))

    def in_flight(self) -> float:
        return self.metric(r"^zeroserve_gateway_in_flight(?:\{[^}]*\})? ([0-9.e+]+)$")

    def shed_in_flight(self) -> float:
        return self.metric(r'^zeroserve_gateway_shed_total\{[^}]*reason="in_flight"[^}]*\} '
                           r"([0-9.e+]+)$")


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    repo = short_tmpdir("zsrepo")
    release = repo / "release"
    (repo / "held" / "1").mkdir(parents=True)
    (repo / "held" / "1" / "model.py").write_text(HELD.replace("RELEASE",
                                                                repr(str(release))))
    (repo / "held" / "config.json").write_text(json.dumps(
        {**linear_config("held", n_out=4), "platform": "python",
         "warmup": {"batch_sizes": []}}))
    # a text model that holds its batch likewise, for OpenAI's embeddings
    text = tx.write_embedder(repo, "held_text")
    (text / "model.py").write_text(HELD.replace("RELEASE", repr(str(release))).replace(
        'return {"output": inputs["input"]}',
        'return {"embedding": inputs["input_ids"][:, :1].float().repeat(1, 16)}'))
    config = json.loads((repo / "held_text" / "config.json").read_text())
    (repo / "held_text" / "config.json").write_text(json.dumps(
        {**config, "warmup": {"batch_sizes": []}}))
    srv = Server(repo, extra=["--max-in-flight", str(BOUND)])
    try:
        srv.wait_ready(120)
        made = Rig(srv, release)
        try:
            yield made
        finally:
            made.grpc.close()
    finally:
        release.touch()   # nothing stays held past the test
        srv.stop()
        shutil.rmtree(repo, ignore_errors=True)


# -- one call through each entry point: (status, retry-after or None, message) ------------
Outcome = tuple[str, str | None, str]


def over_http(path: str, body: Any) -> Callable[[Rig], Outcome]:
    def call(rig: Rig) -> Outcome:
        status, headers, got = http("POST", rig.srv.url + path, json.dumps(body).encode(),
                                    {"Content-Type": "application/json"}, timeout=60)
        text = got.decode(errors="replace")
        error = json.loads(text).get("error", "") if status != 200 else ""
        if isinstance(error, dict):   # OpenAI's error object
            error = error["message"]
        return str(status), headers.get("retry-after") or headers.get("Retry-After"), error
    return call


def grpc_infer(rig: Rig) -> Outcome:
    x = tg.InferInput("input", [1, 4], "FP32").set_data_from_numpy(
        np.array([X], np.float32))
    try:
        rig.grpc.infer("held", [x], client_timeout=60)
    except InferenceServerException as exc:
        return str(exc.status()).removeprefix("StatusCode."), None, exc.message() or ""
    return "OK", None, ""


ENTRY_POINTS: dict[str, Callable[[Rig], Outcome]] = {
    "v2 infer": over_http("/v2/models/held/infer", {"inputs": [
        {"name": "input", "shape": [1, 4], "datatype": "FP32", "data": X}]}),
    "gRPC ModelInfer": grpc_infer,
    "generate": over_http("/v2/models/held/generate", {"input": X}),
    "generate_stream": over_http("/v2/models/held/generate_stream", {"input": X}),
    "seed predict": over_http("/models/held/predict", {"inputs": {"input": X}}),
    "TorchServe predictions": over_http("/predictions/held", X),
    "OpenAI embeddings": over_http("/v1/embeddings", {"model": "held_text", "input": "w1"}),
}
SHED = {"503", "UNAVAILABLE"}
OK = {"200", "OK"}


@pytest.fixture
def held(rig: Rig) -> Iterator[Rig]:
    """The model holds every batch until the test lets go; after it, nothing in flight."""
    rig.release.unlink(missing_ok=True)
    try:
        yield rig
    finally:
        rig.release.touch()
        wait_for(lambda: rig.in_flight() == 0, 60, "nothing in flight")


def flooded(rig: Rig, fill: Callable[[], list[Any]], past: Callable[[], Outcome]
            ) -> tuple[list[Any], list[Outcome], list[float]]:
    """``fill`` takes the bound; then OVER requests through ``past``, answered while the
    model still holds every request let in; then the model lets go."""
    held_ones = fill()
    wait_for(lambda: rig.in_flight() == BOUND, 30, f"{BOUND} requests in flight")
    seen = [rig.in_flight()]
    shed = []
    for _ in range(OVER):
        shed.append(past())
        seen.append(rig.in_flight())
    rig.release.touch()
    return held_ones, shed, seen


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_each_entry_point_sheds_past_the_bound_at_once(held: Rig, entry: str) -> None:
    call = ENTRY_POINTS[entry]
    before = held.shed_in_flight()
    with ThreadPoolExecutor(BOUND) as pool:
        def fill() -> list[Future[Outcome]]:
            return [pool.submit(call, held) for _ in range(BOUND)]

        filled, shed, seen = flooded(held, fill, lambda: call(held))
        answered = [f.result(timeout=60) for f in filled]
    for status, retry_after, message in shed:
        assert status in SHED and "in flight" in message, (status, message)
        if status == "503":
            assert retry_after == "1"
    assert [status for status, _, _ in answered] == ["200" if entry != "gRPC ModelInfer"
                                                     else "OK"] * BOUND
    assert max(seen) <= BOUND
    assert held.shed_in_flight() == before + OVER


def test_a_stream_sheds_each_request_past_the_bound(held: Rig) -> None:
    answers: "queue.Queue[tuple[Any, Any]]" = queue.Queue()
    c = tg.InferenceServerClient(held.srv.grpc_url)
    c.start_stream(callback=lambda result, error: answers.put((result, error)))
    before = held.shed_in_flight()
    try:
        def send(rid: str) -> None:
            x = tg.InferInput("input", [1, 4], "FP32").set_data_from_numpy(
                np.array([X], np.float32))
            c.async_stream_infer("held", [x], request_id=rid)

        def fill() -> list[str]:
            for n in range(BOUND):
                send(f"held-{n}")
            return [f"held-{n}" for n in range(BOUND)]

        def past() -> Outcome:
            send("past")
            result, error = answers.get(timeout=30)   # before the model lets go
            assert error is not None, "a request past the bound was let in"
            return "UNAVAILABLE", None, error.message() or ""

        filled, shed, seen = flooded(held, fill, past)
        answered = [answers.get(timeout=60) for _ in range(BOUND)]
    finally:
        c.stop_stream(cancel_requests=True)
        c.close()
    assert all("in flight" in message for _, _, message in shed), shed
    assert sorted(r.get_response().id for r, e in answered if e is None) == sorted(filled)
    assert max(seen) <= BOUND
    assert held.shed_in_flight() == before + OVER
