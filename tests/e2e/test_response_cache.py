"""The response cache through a real ``zeroserve serve``, seen as a Triton client sees
it: tritonclient.http's answers and its statistics (``cache_hit``, ``cache_miss``), the
metrics, and the broker's ``response_cache`` and ``census`` verbs."""

from __future__ import annotations

import re
import shutil
from typing import Any, Iterator

import numpy as np
import pytest
import torch
import tritonclient.http as triton

from zeroserve.broker.client import Client
from tests.conftest import Server, http, linear_config, short_tmpdir, wait_for, write_model

pytestmark = pytest.mark.timeout(240)

BOUND = 32 << 10   # about 38 answers of one row of the linear model
CACHED = {"response_cache": {"enable": True}}


@pytest.fixture(scope="module")
def srv() -> Iterator[Server]:
    repo = short_tmpdir("zsrepo")
    for name, extra in (("cached", CACHED), ("stream", CACHED), ("versioned", CACHED),
                        ("plain", {})):
        write_model(repo, name, 1, "nn.Linear(4, 3)", linear_config(name, **extra))
    server = Server(repo, extra=["--response-cache-bytes", str(BOUND)])
    try:
        yield server.wait_ready()
    finally:
        server.stop()
        shutil.rmtree(repo, ignore_errors=True)


@pytest.fixture
def client(srv: Server) -> Iterator[Any]:
    c = triton.InferenceServerClient(srv.url.removeprefix("http://"))
    yield c
    c.close()


def row(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, 4)).astype(np.float32)


def infer(client: Any, model: str, x: np.ndarray, outputs: list[str] | None = None
          ) -> np.ndarray:
    inp = triton.InferInput("input", list(x.shape), "FP32").set_data_from_numpy(x)
    asked = [triton.InferRequestedOutput(o) for o in outputs] if outputs is not None else None
    result = client.infer(model, [inp], outputs=asked)
    return np.asarray(result.as_numpy("output"))


def expected(srv: Server, model: str, version: int, x: np.ndarray) -> np.ndarray:
    module = torch.jit.load(str(srv.model_dir / model / str(version) / "model.pt"))
    with torch.inference_mode():
        return np.asarray(module(torch.from_numpy(x)).numpy())


def stats(client: Any, model: str, version: str = "") -> dict[str, Any]:
    (doc,) = client.get_inference_statistics(model, version)["model_stats"]
    return dict(doc)


def counts(doc: dict[str, Any]) -> tuple[int, int]:
    st = doc["inference_stats"]
    return int(st["cache_hit"]["count"]), int(st["cache_miss"]["count"])


def broker_verb(srv: Server, verb: str) -> Any:
    with Client(srv.control, timeout_s=5) as c:
        return c.control(verb)


def test_twenty_identical_requests_are_one_miss_and_nineteen_hits(srv, client) -> None:
    x = row(20)
    answers = [infer(client, "cached", x) for _ in range(20)]
    for a in answers:
        np.testing.assert_array_equal(a, answers[0])
    np.testing.assert_allclose(answers[0], expected(srv, "cached", 1, x), rtol=1e-5)
    doc = stats(client, "cached")
    assert counts(doc) == (19, 1), doc
    assert doc["execution_count"] == 1 and doc["inference_count"] == 1, doc
    assert doc["inference_stats"]["success"]["count"] == 20
    status, _, body = http("GET", srv.url + "/metrics")
    assert status == 200
    text = body.decode()
    hits = re.search(r'^zeroserve_cache_hits_total\{[^}]*model="cached"[^}]*\} (\S+)$', text,
                     re.M)
    assert hits is not None and float(hits.group(1)) == 19.0
    assert re.search(r'^zeroserve_cache_misses_total\{[^}]*model="cached"[^}]*\} 1\.0$', text,
                     re.M)
    # the census holds only what is unanswered; the cache is reported apart
    census = broker_verb(srv, "census")
    assert not any(census.values()), census
    assert broker_verb(srv, "response_cache")["entries"] >= 1


def test_a_model_without_response_cache_never_caches(client) -> None:
    x = row(5)
    for _ in range(5):
        infer(client, "plain", x)
    doc = stats(client, "plain")
    assert counts(doc) == (0, 0) and doc["execution_count"] == 5, doc


def test_a_different_input_a_changed_output_and_a_new_version_each_miss(srv, client) -> None:
    a, b = row(1), row(2)
    infer(client, "versioned", a)                           # miss
    first = infer(client, "versioned", a)                   # hit
    infer(client, "versioned", b)                           # another input: miss
    infer(client, "versioned", a, outputs=["output"])       # the outputs asked: miss
    assert counts(stats(client, "versioned")) == (1, 3)
    write_model(srv.model_dir, "versioned", 2, "nn.Linear(4, 3)")   # other weights

    def on_version_2() -> bool:
        meta = client.get_model_metadata("versioned")
        return meta["versions"] == ["2"] and client.is_model_ready("versioned", "2")
    wait_for(on_version_2, 60, "version 2 to replace version 1")
    again = infer(client, "versioned", a)                   # the new version: miss
    np.testing.assert_allclose(again, expected(srv, "versioned", 2, a), rtol=1e-5)
    assert not np.allclose(again, first)
    assert counts(stats(client, "versioned", "2")) == (0, 1)
    assert np.array_equal(infer(client, "versioned", a), again)   # and then a hit
    assert counts(stats(client, "versioned", "2")) == (1, 1)


def test_the_cache_stays_within_its_bound_under_distinct_inputs(srv, client) -> None:
    """A stream of inputs never seen: every answer is kept and the oldest go; the bytes
    the broker counts, and the gauge, never pass the bound (a cache that grew would)."""
    seen = []
    for i in range(200):
        infer(client, "stream", row(1000 + i))
        if i % 10 == 9:
            seen.append(broker_verb(srv, "response_cache"))
    assert all(s["bytes"] <= BOUND for s in seen), seen
    last = seen[-1]
    assert last["bound_bytes"] == BOUND and last["evicted"] > 0 and last["entries"] > 10
    assert counts(stats(client, "stream")) == (0, 200)
    _, _, body = http("GET", srv.url + "/metrics")
    gauge = re.search(r"^zeroserve_cache_bytes\{[^}]*\} (\S+)$", body.decode(), re.M)
    assert gauge is not None and 0 < float(gauge.group(1)) <= BOUND
