"""A real transformer fed mixed lengths at once (issue 29): ``transformers``' BertModel,
random weights, as TorchScript (traced) and as a torch.export program, each with and
without padding, through tritonclient.http and tritonclient.grpc unchanged. Every answer
is a 200 equal to the model run in-process on that request alone; a padded model batches
mixed lengths (fewer executions than inferences); nothing fails for another request's
shape."""

from __future__ import annotations

import shutil
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest

from tests import bert
from tests.conftest import Server, http, short_tmpdir

pytest.importorskip("transformers")
th = pytest.importorskip("tritonclient.http")
tg = pytest.importorskip("tritonclient.grpc")

pytestmark = pytest.mark.timeout(300)

LENGTHS = (5, 12, 31)
MODELS = {"ts": ("pytorch_torchscript", None), "ts_pad": ("pytorch_torchscript", bert.PADDING),
          "exp": ("pytorch_export", None),
          "ts_bucket": ("pytorch_torchscript", {**bert.PADDING, "buckets": [8, 16, 32]})}


@pytest.fixture(scope="module")
def module() -> Any:
    with warnings.catch_warnings():   # transformers' and the tracer's, not ours
        warnings.simplefilter("ignore")
        return bert.model()


@pytest.fixture(scope="module")
def repo(module: Any) -> Iterator[Path]:
    root = short_tmpdir("zsbert")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, (platform, padding) in MODELS.items():
            bert.write(root, name, module, platform, padding=padding, max_queue_delay_ms=20)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def srv(repo: Path) -> Iterator[Server]:
    server = Server(repo, workers=1)
    try:
        yield server.wait_ready(180)
    finally:
        server.stop()


def requests(n: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [bert.inputs(LENGTHS[i % len(LENGTHS)], bert.SMALL["vocab_size"], rng)
            for i in range(n)]


def check(module: Any, req: dict[str, np.ndarray], got: dict[str, np.ndarray]) -> None:
    hidden, pooled = bert.expected(module, req["input_ids"], req["attention_mask"])
    assert got["last_hidden_state"].shape == hidden.shape
    np.testing.assert_allclose(got["last_hidden_state"], hidden, atol=1e-4)
    np.testing.assert_allclose(got["pooler_output"], pooled, atol=1e-4)


def over_http(srv: Server, model: str, reqs: list[dict[str, np.ndarray]]
              ) -> list[dict[str, np.ndarray]]:
    client = th.InferenceServerClient(srv.url.removeprefix("http://"), concurrency=len(reqs))
    try:
        pending = []
        for req in reqs:
            inputs = [th.InferInput(k, list(v.shape), "INT64").set_data_from_numpy(
                v, binary_data=True) for k, v in req.items()]
            pending.append(client.async_infer(model, inputs))
        results = [p.get_result() for p in pending]
        return [{n: r.as_numpy(n) for n in ("last_hidden_state", "pooler_output")}
                for r in results]
    finally:
        client.close()


def over_grpc(srv: Server, model: str, reqs: list[dict[str, np.ndarray]]
              ) -> list[dict[str, np.ndarray]]:
    client = tg.InferenceServerClient(srv.grpc_url)

    def one(req: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        inputs = [tg.InferInput(k, list(v.shape), "INT64").set_data_from_numpy(v)
                  for k, v in req.items()]
        r = client.infer(model, inputs)
        return {n: r.as_numpy(n) for n in ("last_hidden_state", "pooler_output")}
    try:
        with ThreadPoolExecutor(len(reqs)) as pool:
            return list(pool.map(one, reqs))
    finally:
        client.close()


def stats(srv: Server, model: str) -> tuple[int, int]:
    client = th.InferenceServerClient(srv.url.removeprefix("http://"))
    try:
        [st] = client.get_inference_statistics(model)["model_stats"]
        return int(st["inference_count"]), int(st["execution_count"])
    finally:
        client.close()


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("transport", [over_http, over_grpc], ids=["http", "grpc"])
def test_mixed_lengths_at_once_all_answered_right(
        srv: Server, module: Any, model: str,
        transport: Callable[[Server, str, list[dict[str, np.ndarray]]],
                            list[dict[str, np.ndarray]]]) -> None:
    reqs = requests(48 if transport is over_http else 24)
    got = transport(srv, model, reqs)
    assert len(got) == len(reqs)
    for req, out in zip(reqs, got):
        check(module, req, out)


def test_padding_batches_mixed_lengths(srv: Server, module: Any) -> None:
    before = {m: stats(srv, m) for m in ("ts", "ts_pad")}
    reqs = requests(48, seed=1)
    for model in ("ts", "ts_pad"):
        for req, out in zip(reqs, over_http(srv, model, reqs)):
            check(module, req, out)
    ran = {m: (stats(srv, m)[0] - before[m][0], stats(srv, m)[1] - before[m][1])
           for m in before}
    assert ran["ts"][0] == ran["ts_pad"][0] == 48
    # shape-only batching forms at least one batch per length present; padding lets the
    # lengths share batches, so it runs fewer of them
    assert ran["ts"][1] >= len(LENGTHS)
    assert ran["ts_pad"][1] < ran["ts_pad"][0]


def test_padded_inputs_that_disagree_in_length_are_refused(srv: Server) -> None:
    body = (b'{"inputs":[{"name":"input_ids","datatype":"INT64","shape":[1,3],'
            b'"data":[1,2,3]},{"name":"attention_mask","datatype":"INT64","shape":[1,2],'
            b'"data":[1,1]}]}')
    status, _, text = http("POST", srv.url + "/v2/models/ts_pad/infer", body,
                           {"Content-Type": "application/json"})
    assert status == 400, text
    assert b"must agree in length" in text
    # and the model keeps serving
    [out] = over_http(srv, "ts_pad", requests(1))
    assert out["pooler_output"].shape == (1, bert.SMALL["hidden_size"])
