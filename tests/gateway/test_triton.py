"""tritonclient.http, unchanged, against a real ``zeroserve serve``."""

from __future__ import annotations

import gzip
import json

import ml_dtypes
import numpy as np
import pytest
import torch
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from tests.conftest import http
from tests.gateway.conftest import queued_count

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def client(api_server):
    c = triton.InferenceServerClient(api_server.url.removeprefix("http://"),
                                     network_timeout=30.0)
    yield c
    c.close()


def in_process(srv, version, x):
    module = torch.jit.load(str(srv.model_dir / "linear" / str(version) / "model.pt"))
    with torch.inference_mode():
        return module(torch.from_numpy(x)).numpy()


def linear_input(x, binary=True):
    inp = triton.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    return inp


X = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)


def test_health_and_metadata(client, api_server):
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("linear") and client.is_model_ready("linear", "2")
    assert not client.is_model_ready("nope")
    meta = client.get_server_metadata()
    assert meta["name"] == "zeroserve"
    assert {"binary_tensor_data", "schedule_policy", "model_configuration"} <= \
        set(meta["extensions"])
    model = client.get_model_metadata("linear")
    assert model["versions"] == ["1", "2"] and model["platform"] == "pytorch_torchscript"
    assert model["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 4]}]
    assert client.get_model_metadata("linear", "1")["name"] == "linear"
    config = client.get_model_config("linear")
    assert config["max_batch_size"] == 8 and config["inputs"][0]["shape"] == [4]
    assert client.get_model_config("half", "1")["inputs"][0]["datatype"] == "FP16"
    with pytest.raises(InferenceServerException) as err:
        client.get_model_config("nope")
    assert err.value.message() == "Request for unknown model: 'nope' is not found"


@pytest.mark.parametrize("binary_in", [True, False])
@pytest.mark.parametrize("binary_out", [True, False, None])
def test_infer_binary_and_json_both_ways(client, api_server, binary_in, binary_out):
    outputs = None if binary_out is None else [
        triton.InferRequestedOutput("output", binary_data=binary_out)]
    res = client.infer("linear", [linear_input(X, binary_in)], outputs=outputs,
                       model_version="1", request_id="r-9")
    np.testing.assert_allclose(res.as_numpy("output"), in_process(api_server, 1, X),
                               atol=1e-6)
    response = res.get_response()
    assert response["id"] == "r-9" and response["model_version"] == "1"
    out = response["outputs"][0]
    # None: no outputs named, so tritonclient asks for binary_data_output
    assert ("data" in out) == (binary_out is False)


def test_pinned_version_and_default(client, api_server):
    for version in ("1", "2"):
        res = client.infer("linear", [linear_input(X)], model_version=version)
        assert res.get_response()["model_version"] == version
        np.testing.assert_allclose(res.as_numpy("output"),
                                   in_process(api_server, int(version), X), atol=1e-6)
    assert client.infer("linear", [linear_input(X)]).get_response()["model_version"] == "2"


def test_fp16_binary_and_json(client):
    x = np.array([[-1.5, 0.25, 2.0, -0.0], [3.0, -4.0, 0.5, 1.0]], np.float16)
    for binary in (True, False):
        inp = triton.InferInput("input", list(x.shape), "FP16")
        inp.set_data_from_numpy(x, binary_data=binary)
        out = client.infer("half", [inp], outputs=[
            triton.InferRequestedOutput("output", binary_data=binary)]).as_numpy("output")
        assert out.dtype == np.float16
        np.testing.assert_array_equal(out, np.maximum(x, 0))


def test_bf16_binary(client):
    x = np.array([[-1.5, 0.25, 2.0, 7.0]], dtype=ml_dtypes.bfloat16)
    inp = triton.InferInput("input", [1, 4], "BF16")
    inp.set_data_from_numpy(x, binary_data=True)
    out = client.infer("bf16", [inp]).as_numpy("output")
    np.testing.assert_array_equal(out.astype(np.float32),
                                  np.maximum(x.astype(np.float32), 0))
    # BF16 cannot be JSON: asking for it that way is a clear 400
    with pytest.raises(InferenceServerException, match="BF16"):
        client.infer("bf16", [inp], outputs=[
            triton.InferRequestedOutput("output", binary_data=False)])


def _as_bytes(values):
    return [x.encode() if isinstance(x, str) else bytes(x) for x in values.reshape(-1)]


def test_bytes_round_trip_through_a_python_handler(client):
    raw = np.array([[b"ab", b"", b"\x00\xff", "\u00e9t\u00e9".encode()]], dtype=object)
    inp = triton.InferInput("input", [1, 4], "BYTES")
    inp.set_data_from_numpy(raw, binary_data=True)
    got = client.infer("upper", [inp]).as_numpy("output")  # binary out by default
    assert _as_bytes(got) == [b"AB", b"", b"\x00\xff", "\u00e9T\u00e9".encode()]
    # JSON carries text: every mix of JSON and binary, in and out
    text = np.array([["ab", "", "x y", "\u00e9t\u00e9"]], dtype=object)
    want = [b"AB", b"", b"X Y", "\u00e9T\u00e9".encode()]  # bytes.upper: ASCII only
    for binary_in in (True, False):
        for binary_out in (True, False):
            inp = triton.InferInput("input", [1, 4], "BYTES")
            inp.set_data_from_numpy(text, binary_data=binary_in)
            out = triton.InferRequestedOutput("output", binary_data=binary_out)
            got = client.infer("upper", [inp], outputs=[out]).as_numpy("output")
            assert got.shape == (1, 4) and _as_bytes(got) == want, (binary_in, binary_out)


def test_bytes_to_a_torchscript_model_is_a_clear_400(client):
    inp = triton.InferInput("input", [1, 4], "BYTES")
    inp.set_data_from_numpy(np.array([[b"a", b"b", b"c", b"d"]], dtype=object))
    with pytest.raises(InferenceServerException, match="data-type is 'BYTES'"):
        client.infer("linear", [inp])


def test_priority_reaches_the_broker(client, api_server):
    before = queued_count(api_server, "linear", 1)
    for _ in range(3):
        client.infer("linear", [linear_input(X)], priority=1)
    # the broker files each request under the priority it was given
    assert queued_count(api_server, "linear", 1) == before + 3


def test_timeout_reaches_the_broker(client):
    with pytest.raises(InferenceServerException, match="deadline"):
        client.infer("linear", [linear_input(X)], timeout=1)  # one microsecond
    res = client.infer("linear", [linear_input(X)], timeout=20_000_000)
    assert res.as_numpy("output").shape == (3, 3)


def test_unknown_model_error_reaches_the_client(client):
    with pytest.raises(InferenceServerException) as err:
        client.infer("nope", [linear_input(X)])
    assert err.value.message() == "Request for unknown model: 'nope' is not found"
    with pytest.raises(InferenceServerException) as err:
        client.infer("linear", [linear_input(X)], model_version="7")
    assert err.value.message() == "Request for unknown model: 'linear' version 7 is not found"
    with pytest.raises(InferenceServerException) as err:
        client.infer("linear", [triton.InferInput("other", [1, 4], "FP32")
                                .set_data_from_numpy(X[:1])])
    assert err.value.message() == "unexpected inference input 'other' for model 'linear'"


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_requests_and_responses(client, api_server, algorithm):
    for binary in (True, False):
        res = client.infer("linear", [linear_input(X, binary)],
                           request_compression_algorithm=algorithm,
                           response_compression_algorithm=algorithm,
                           outputs=[triton.InferRequestedOutput("output", binary_data=binary)])
        np.testing.assert_allclose(res.as_numpy("output"), in_process(api_server, 2, X),
                                   atol=1e-6)
    # the server really compresses what it is asked to
    body = json.dumps({"inputs": [{"name": "input", "shape": [3, 4], "datatype": "FP32",
                                   "data": X.reshape(-1).tolist()}]}).encode()
    status, headers, got = http("POST", api_server.url + "/v2/models/linear/infer",
                                gzip.compress(body), {"Content-Encoding": "gzip",
                                                      "Accept-Encoding": algorithm})
    assert status == 200 and headers["content-encoding"] == algorithm
    raw = gzip.decompress(got) if algorithm == "gzip" else __import__("zlib").decompress(got)
    assert json.loads(raw)["outputs"][0]["shape"] == [3, 3]


def test_corrupt_compressed_body_is_a_400(api_server):
    status, _, got = http("POST", api_server.url + "/v2/models/linear/infer", b"not gzip",
                          {"Content-Encoding": "gzip"})
    assert status == 400 and "gzip" in json.loads(got)["error"]
    status, _, got = http("POST", api_server.url + "/v2/models/linear/infer", b"{}",
                          {"Content-Encoding": "br"})
    assert status == 400 and "Content-Encoding" in json.loads(got)["error"]


def test_url_quoted_model_name(api_server):
    status, _, got = http("GET", api_server.url + "/v2/models/li%6Eear")
    assert status == 200 and json.loads(got)["name"] == "linear"


def triton_error(call, *args, **kwargs) -> str:
    with pytest.raises(InferenceServerException) as err:
        call(*args, **kwargs)
    return err.value.message()


def test_bad_requests_in_triton_words(client, api_server):
    """Each text as Triton's server words it (wording.py names the sources)."""
    wide = triton.InferInput("input", [1, 5], "FP32").set_data_from_numpy(
        np.zeros((1, 5), np.float32))
    assert triton_error(client.infer, "linear", [wide]) == (
        "[request id: <id_unknown>] unexpected shape for input 'input' for model 'linear'. "
        "Expected [-1,4], got [1,5]. NOTE: Setting a non-zero max_batch_size in the model "
        "config requires a batch dimension to be prepended to each input shape. If you want "
        "to specify the full shape including the batch dim in your input dims config, try "
        "setting max_batch_size to zero. See the model configuration docs for more info on "
        "max_batch_size.")
    ints = triton.InferInput("input", [1, 4], "INT32").set_data_from_numpy(
        np.zeros((1, 4), np.int32))
    assert triton_error(client.infer, "linear", [ints], request_id="r-5") == (
        "[request id: r-5] inference input 'input' data-type is 'INT32', but model 'linear' "
        "expects 'FP32'")
    assert triton_error(client.infer, "linear", []) == (
        "[request id: <id_unknown>] expected 1 inputs but got 0 inputs for model 'linear'. "
        "Got input(s) [], but missing required input(s) ['input']. Please provide all "
        "required input(s).")
    nine = linear_input(np.zeros((9, 4), np.float32))
    assert triton_error(client.infer, "linear", [nine]) == \
        "[request id: <id_unknown>] inference request batch-size must be <= 8 for 'linear'"
    assert triton_error(client.infer, "linear", [linear_input(X)], model_version="abc") == (
        "failed to get model version from specified version string 'abc' (details: stol), "
        "version should be an integral value > 0")
    assert triton_error(client.get_model_metadata, "linear", "x1").startswith(
        "failed to get model version from specified version string 'x1'")
    assert triton_error(client.get_model_metadata, "linear", "3") == \
        "Request for unknown model: 'linear' version 3 is not found"
    status, _, got = http("POST", api_server.url + "/v2/models/linear/infer", b"{\"inputs\": ")
    assert status == 400 and json.loads(got)["error"].startswith(
        "failed to parse the request JSON buffer: ")
    assert client.is_server_live()


def test_cuda_shared_memory_answers_as_a_triton_without_gpus(client):
    assert client.get_cuda_shared_memory_status() == []
    client.unregister_cuda_shared_memory()            # every region: there are none
    client.unregister_cuda_shared_memory("never")     # one it does not hold: no error
    assert triton_error(client.register_cuda_shared_memory, "r0", "AAAA", 0, 64) == \
        "failed to register CUDA shared memory region: 'r0', GPUs not supported"
    assert triton_error(client.get_cuda_shared_memory_status, "r0") == \
        "Unable to find cuda shared memory region: 'r0'"
    assert client.get_cuda_shared_memory_status() == [] and client.is_server_live()
