"""The seed's predict routes and the TorchServe-compatible ones, over real HTTP."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.conftest import http
from tests.gateway.conftest import queued_count

pytestmark = pytest.mark.timeout(120)

X = np.random.default_rng(3).standard_normal((2, 4)).astype(np.float32)


def expected(srv, version, x):
    module = torch.jit.load(str(srv.model_dir / "linear" / str(version) / "model.pt"))
    with torch.inference_mode():
        return module(torch.from_numpy(x)).numpy()


def post(srv, path, doc, headers=None):
    status, hdrs, body = http("POST", srv.url + path, json.dumps(doc).encode(),
                              {"Content-Type": "application/json", **(headers or {})})
    return status, hdrs, json.loads(body)


def test_seed_predict_batched_single_and_pinned(api_server):
    status, _, doc = post(api_server, "/models/linear/predict",
                          {"inputs": {"input": X.tolist()}, "id": "s1"})
    assert status == 200 and doc["model_name"] == "linear" and doc["model_version"] == 2
    assert doc["id"] == "s1"
    np.testing.assert_allclose(doc["outputs"]["output"], expected(api_server, 2, X), atol=1e-5)
    # one sample, no batch dimension: none comes back either
    status, _, doc = post(api_server, "/models/linear/1/predict",
                          {"inputs": {"input": X[0].tolist()}})
    assert status == 200 and doc["model_version"] == 1
    np.testing.assert_allclose(doc["outputs"]["output"], expected(api_server, 1, X)[0],
                               atol=1e-5)


@pytest.mark.parametrize("version", ["1", "v1", "2", "v2"])
def test_seed_predict_takes_the_version_as_the_seed_writes_it(api_server, version):
    """The seed's path is /models/resnet50/v2/predict; Triton-style clients send 2."""
    status, _, doc = post(api_server, f"/models/linear/{version}/predict",
                          {"inputs": {"input": X.tolist()}})
    n = int(version.lstrip("v"))
    assert status == 200 and doc["model_version"] == n, doc
    np.testing.assert_allclose(doc["outputs"]["output"], expected(api_server, n, X), atol=1e-5)


def test_priority_header_reaches_the_broker(api_server):
    before = queued_count(api_server, "linear", 1)
    for path in ("/models/linear/predict", "/predictions/linear"):
        sample = X[0].tolist()
        doc = {"inputs": {"input": sample}} if path.endswith("/predict") else sample
        assert post(api_server, path, doc, {"X-Priority": "1"})[0] == 200
    assert queued_count(api_server, "linear", 1) == before + 2


def test_seed_predict_half_precision_and_headers(api_server):
    status, _, doc = post(api_server, "/models/bf16/predict",
                          {"inputs": {"input": [-1.0, 2.5, 0.0, 3.0]}},
                          {"X-Priority": "1", "X-Timeout-Ms": "20000"})
    assert status == 200 and doc["outputs"]["output"] == [0.0, 2.5, 0.0, 3.0]
    status, _, doc = post(api_server, "/models/half/predict",
                          {"inputs": {"input": [[-1.0, 2.5, 0.0, 3.0]]}})
    assert status == 200 and doc["outputs"]["output"] == [[0.0, 2.5, 0.0, 3.0]]


@pytest.mark.parametrize("path, doc, headers, status, needle", [
    ("/models/nope/predict", {"inputs": {"input": [1, 2, 3, 4]}}, {}, 404, "unknown model"),
    ("/models/linear/9/predict", {"inputs": {"input": [1, 2, 3, 4]}}, {}, 404, "version 9"),
    ("/models/linear/x/predict", {"inputs": {"input": [1, 2, 3, 4]}}, {}, 400, "version"),
    ("/models/linear/v9/predict", {"inputs": {"input": [1, 2, 3, 4]}}, {}, 404, "version 9"),
    ("/models/linear/vx/predict", {"inputs": {"input": [1, 2, 3, 4]}}, {}, 400, "'vx'"),
    ("/models/linear/v0/predict", {"inputs": {"input": [1, 2, 3, 4]}}, {}, 400, "'v0'"),
    ("/models/linear/V2/predict", {"inputs": {"input": [1, 2, 3, 4]}}, {}, 400, "'V2'"),
    ("/models/linear/predict", {"inputs": {"wrong": [1, 2, 3, 4]}}, {}, 400, "'wrong'"),
    ("/models/linear/predict", {"inputs": {"input": [1, 2, 3]}}, {}, 400, "shape"),
    ("/models/linear/predict", {"inputs": {"input": ["a", "b", "c", "d"]}}, {}, 400, "FP32"),
    ("/models/linear/predict", [1, 2], {}, 400, "JSON object"),
    ("/models/linear/predict", {"inputs": {"input": [1, 2, 3, 4]}}, {"X-Priority": "high"},
     400, "X-Priority"),
    ("/models/linear/predict", {"inputs": {"input": [1, 2, 3, 4]}}, {"X-Timeout-Ms": "-3"},
     400, "x-timeout-ms"),
    ("/predictions/linear", {"a": 1, "b": 2}, {}, 400, "input names"),
    ("/predictions/nope", [1, 2, 3, 4], {}, 404, "unknown model"),
])
def test_simple_routes_answer_bad_requests_clearly(api_server, path, doc, headers, status,
                                                   needle):
    got_status, hdrs, got = post(api_server, path, doc, headers)
    assert got_status == status, got
    assert hdrs["content-type"] == "application/json"
    assert needle.lower() in got["error"].lower()


def test_torchserve_predictions_and_ping(api_server):
    for body in (X[0].tolist(), {"data": X[0].tolist()}, {"input": X[0].tolist()}):
        status, _, doc = post(api_server, "/predictions/linear/1", body)
        assert status == 200
        np.testing.assert_allclose(doc, expected(api_server, 1, X)[0], atol=1e-5)
    status, _, doc = post(api_server, "/predictions/linear/2.0", X.tolist())
    assert status == 200 and np.asarray(doc).shape == (2, 3)
    status, _, got = http("GET", api_server.url + "/ping")
    assert status == 200 and json.loads(got) == {"status": "Healthy"}


def test_malformed_json_is_a_400(api_server):
    status, _, got = http("POST", api_server.url + "/predictions/linear", b"{nope")
    assert status == 400 and "malformed JSON" in json.loads(got)["error"]
