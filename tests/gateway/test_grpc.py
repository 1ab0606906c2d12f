"""Triton's gRPC service through tritonclient.grpc and tritonclient.grpc.aio unchanged,
against the shared real ``zeroserve serve`` (two workers; ``linear`` v1 and v2, ``half``
FP16, ``upper`` BYTES): health, metadata, config, every way to infer, compression,
headers, statistics, classification, a stream on a plain model, errors."""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import Any, Iterator

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.grpc.aio as tga
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

from zeroserve.broker import wording
from zeroserve.models.proto import grpc_service_pb2 as pb
from zeroserve.models.proto import health_pb2
from tests.conftest import Server

pytestmark = pytest.mark.timeout(180)

X = np.random.default_rng(3).standard_normal((3, 4)).astype(np.float32)
SERVICE = "/inference.GRPCInferenceService/"


@pytest.fixture(scope="module")
def srv(api_server: Server) -> Server:
    return api_server


@pytest.fixture(scope="module")
def gc(srv: Server) -> Iterator[tg.InferenceServerClient]:
    c = tg.InferenceServerClient(srv.grpc_url)
    yield c
    c.close()


@pytest.fixture
def channel(srv: Server) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(srv.grpc_url) as ch:
        yield ch


def linear_input(x: np.ndarray = X) -> tg.InferInput:
    return tg.InferInput("input", list(x.shape), "FP32").set_data_from_numpy(x)


def over_http(srv: Server, model: str, x: np.ndarray, version: str = "") -> np.ndarray:
    c = th.InferenceServerClient(srv.url.removeprefix("http://"))
    try:
        inp = th.InferInput("input", list(x.shape), "FP32").set_data_from_numpy(x)
        return c.infer(model, [inp], model_version=version).as_numpy("output")
    finally:
        c.close()


def code_of(exc: InferenceServerException) -> str:
    return str(exc.status()).removeprefix("StatusCode.")


# -- health and metadata -------------------------------------------------------------

def test_health_and_readiness(gc: tg.InferenceServerClient) -> None:
    assert gc.is_server_live() and gc.is_server_ready()
    assert gc.is_model_ready("linear") and gc.is_model_ready("linear", "2")
    assert not gc.is_model_ready("nope")


def test_standard_health_service(channel: grpc.Channel) -> None:
    check = channel.unary_unary("/grpc.health.v1.Health/Check",
                                request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                                response_deserializer=health_pb2.HealthCheckResponse.FromString)
    serving = health_pb2.HealthCheckResponse.SERVING
    for service in ("", "inference.GRPCInferenceService", "live", "ready"):
        assert check(health_pb2.HealthCheckRequest(service=service), timeout=10).status \
            == serving
    with pytest.raises(grpc.RpcError) as got:
        check(health_pb2.HealthCheckRequest(service="nothing"), timeout=10)
    assert got.value.code() is grpc.StatusCode.NOT_FOUND


def test_server_and_model_metadata(gc: tg.InferenceServerClient, srv: Server) -> None:
    meta = gc.get_server_metadata(as_json=True)
    http = th.InferenceServerClient(srv.url.removeprefix("http://"))
    try:
        assert meta["name"] == http.get_server_metadata()["name"]
        assert meta["extensions"] == http.get_server_metadata()["extensions"]
        model = gc.get_model_metadata("linear", as_json=True)
        want = http.get_model_metadata("linear")
    finally:
        http.close()
    assert model["name"] == "linear" and model["versions"] == want["versions"]
    assert model["inputs"] == [{"name": "input", "datatype": "FP32", "shape": ["-1", "4"]}]
    assert model["outputs"][0]["name"] == "output"


def test_model_config_is_a_model_config_message(gc: tg.InferenceServerClient) -> None:
    config = gc.get_model_config("linear").config
    assert config.name == "linear" and config.max_batch_size == 8
    assert config.platform == "pytorch_libtorch" and config.backend == "pytorch"
    [inp] = config.input
    assert (inp.name, list(inp.dims)) == ("input", [4])
    assert tg.model_config_pb2.DataType.Name(inp.data_type) == "TYPE_FP32"
    assert config.version_policy.HasField("all")
    assert config.dynamic_batching.priority_levels == 2
    assert config.dynamic_batching.default_queue_policy.max_queue_size == 1024
    assert len(config.instance_group) == 1
    assert not config.model_transaction_policy.decoupled
    strings = gc.get_model_config("upper").config.input[0]
    assert tg.model_config_pb2.DataType.Name(strings.data_type) == "TYPE_STRING"


# -- inference ---------------------------------------------------------------------

def test_infer_equals_http_for_each_version(gc: tg.InferenceServerClient, srv: Server) -> None:
    for version in ("1", "2"):
        got = gc.infer("linear", [linear_input()], model_version=version,
                       request_id=f"r{version}", outputs=[tg.InferRequestedOutput("output")])
        np.testing.assert_allclose(got.as_numpy("output"), over_http(srv, "linear", X, version),
                                   rtol=1e-6)
        response = got.get_response()
        assert (response.id, response.model_version) == (f"r{version}", version)
        assert len(response.raw_output_contents) == 1


def test_priority_timeout_and_headers_pass(gc: tg.InferenceServerClient, srv: Server) -> None:
    got = gc.infer("linear", [linear_input()], priority=1, timeout=5_000_000,
                   headers={"x-trace": "t1"}, client_timeout=30)
    np.testing.assert_allclose(got.as_numpy("output"), over_http(srv, "linear", X), rtol=1e-6)


def test_fp16_and_bytes_tensors(gc: tg.InferenceServerClient) -> None:
    half = np.array([[-1.5, 0.0, 2.25, 3.0]], np.float16)
    got = gc.infer("half", [tg.InferInput("input", [1, 4], "FP16").set_data_from_numpy(half)])
    np.testing.assert_array_equal(got.as_numpy("output"), np.maximum(half, 0))
    words = np.array([[b"abc", "héllo".encode(), b""]], dtype=object)
    got = gc.infer("upper", [tg.InferInput("input", [1, 3], "BYTES").set_data_from_numpy(words)])
    assert got.as_numpy("output").tolist() == [[b"ABC", "HéLLO".encode(), b""]]


def test_async_infer_with_a_callback(gc: tg.InferenceServerClient, srv: Server) -> None:
    done: queue.Queue[Any] = queue.Queue()
    gc.async_infer("linear", [linear_input()], lambda result, error: done.put((result, error)),
                   request_id="cb")
    result, error = done.get(timeout=30)
    assert error is None and result.get_response().id == "cb"
    np.testing.assert_allclose(result.as_numpy("output"), over_http(srv, "linear", X),
                               rtol=1e-6)


def test_aio_client(srv: Server) -> None:
    async def run() -> list[np.ndarray]:
        async with tga.InferenceServerClient(srv.grpc_url) as c:
            assert await c.is_server_ready()
            config = await c.get_model_config("linear")
            assert config.config.max_batch_size == 8
            calls = [c.infer("linear", [linear_input(X[i:i + 1])]) for i in range(3)]
            return [r.as_numpy("output")[0] for r in await asyncio.gather(*calls)]
    got = asyncio.run(run())
    np.testing.assert_allclose(np.stack(got), over_http(srv, "linear", X), rtol=1e-6)


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_requests(gc: tg.InferenceServerClient, srv: Server, algorithm: str) -> None:
    got = gc.infer("linear", [linear_input()], compression_algorithm=algorithm)
    np.testing.assert_allclose(got.as_numpy("output"), over_http(srv, "linear", X), rtol=1e-6)


def test_typed_contents_and_their_mix_with_raw(channel: grpc.Channel) -> None:
    infer = channel.unary_unary(SERVICE + "ModelInfer",
                                request_serializer=pb.ModelInferRequest.SerializeToString,
                                response_deserializer=pb.ModelInferResponse.FromString)
    req = pb.ModelInferRequest(model_name="linear", id="typed")
    inp = req.inputs.add(name="input", datatype="FP32", shape=[3, 4])
    inp.contents.fp32_contents.extend(X.reshape(-1).tolist())
    typed = infer(req, timeout=30)
    raw = pb.ModelInferRequest(model_name="linear", raw_input_contents=[X.tobytes()])
    raw.inputs.add(name="input", datatype="FP32", shape=[3, 4])
    assert typed.raw_output_contents == infer(raw, timeout=30).raw_output_contents
    req.raw_input_contents.append(X.tobytes())
    with pytest.raises(grpc.RpcError) as got:
        infer(req, timeout=30)
    assert got.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert got.value.details() == ("contents field must not be specified when using "
                                   "raw_input_contents for 'input' for model 'linear'")


def test_classification(gc: tg.InferenceServerClient, srv: Server) -> None:
    got = gc.infer("linear", [linear_input()],
                   outputs=[tg.InferRequestedOutput("output", class_count=2)])
    top = got.as_numpy("output")
    scores = over_http(srv, "linear", X)
    assert top.shape == (3, 2)
    for row, want in zip(top, scores):
        value, index = row[0].decode().split(":")[:2]
        assert int(index) == int(np.argmax(want))
        assert float(value) == pytest.approx(float(want.max()), rel=1e-5)


def test_statistics_count_what_ran(gc: tg.InferenceServerClient) -> None:
    def count() -> int:
        [st] = gc.get_inference_statistics("half").model_stats
        return st.inference_count
    before = count()
    x = np.ones((2, 4), np.float16)
    gc.infer("half", [tg.InferInput("input", [2, 4], "FP16").set_data_from_numpy(x)])
    assert count() == before + 2
    names = {st.name for st in gc.get_inference_statistics().model_stats}
    assert {"linear", "half", "upper"} <= names


def test_repository_index(gc: tg.InferenceServerClient) -> None:
    index = {m.name: m.state for m in gc.get_model_repository_index().models}
    assert index.get("linear") == "READY" and index.get("upper") == "READY"


def test_log_and_trace_settings(gc: tg.InferenceServerClient) -> None:
    settings = gc.get_log_settings(as_json=True)["settings"]
    assert "log_info" in settings
    trace = gc.get_trace_settings(as_json=True)["settings"]
    assert trace["trace_level"]["value"] == ["OFF"]
    # the settings HTTP changes: a model's own rate, then cleared back to the global one
    got = gc.update_trace_settings("linear", {"trace_rate": "5"}, as_json=True)["settings"]
    assert got["trace_rate"]["value"] == ["5"] and got["trace_level"]["value"] == ["OFF"]
    assert gc.get_trace_settings("linear", as_json=True)["settings"]["trace_rate"]["value"] \
        == ["5"]
    got = gc.update_trace_settings("linear", {"trace_rate": None}, as_json=True)["settings"]
    assert got == gc.get_trace_settings(as_json=True)["settings"]
    with pytest.raises(InferenceServerException, match="trace level"):
        gc.update_trace_settings(settings={"trace_level": ["LOUD"]})
    with pytest.raises(InferenceServerException, match="unknown model"):
        gc.get_trace_settings("nope")


# -- a stream of requests on a plain model -----------------------------------------

def test_a_stream_of_requests_is_answered_by_id(gc: tg.InferenceServerClient,
                                                srv: Server) -> None:
    answers: queue.Queue[Any] = queue.Queue()
    client = tg.InferenceServerClient(srv.grpc_url)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for i in range(8):
            client.async_stream_infer("linear", [linear_input(X[i % 3:i % 3 + 1])],
                                      request_id=f"s{i}")
        client.async_stream_infer("nope", [linear_input()], request_id="bad")
        got = [answers.get(timeout=30) for _ in range(9)]
    finally:
        client.stop_stream()
        client.close()
    scores = over_http(srv, "linear", X)
    by_id = {}
    for result, error in got:
        if error is not None:
            assert wording.unknown_model("nope") in error.message()
            continue
        response = result.get_response()
        assert response.parameters["triton_final_response"].bool_param
        by_id[response.id] = result.as_numpy("output")[0]
    assert sorted(by_id) == sorted(f"s{i}" for i in range(8))
    for i in range(8):
        np.testing.assert_allclose(by_id[f"s{i}"], scores[i % 3], rtol=1e-6)


# -- errors: codes and Triton's messages --------------------------------------------

@pytest.mark.parametrize("call, code, message", [
    (lambda c: c.infer("nope", [linear_input()]), "INVALID_ARGUMENT",
     wording.unknown_model("nope")),
    (lambda c: c.infer("linear", [linear_input()], model_version="7"), "NOT_FOUND",
     wording.unknown_version("linear", 7)),
    (lambda c: c.infer("linear", [linear_input()], model_version="0"), "INVALID_ARGUMENT",
     wording.invalid_version("0")),
    (lambda c: c.get_model_metadata("nope"), "INVALID_ARGUMENT", wording.unknown_model("nope")),
    (lambda c: c.get_model_config("nope"), "INVALID_ARGUMENT", wording.unknown_model("nope")),
    (lambda c: c.get_inference_statistics("nope"), "INVALID_ARGUMENT",
     wording.unknown_model("nope")),
    (lambda c: c.infer("linear", [tg.InferInput("wrong", [1, 4], "FP32").set_data_from_numpy(
        X[:1])]), "INVALID_ARGUMENT", "unexpected inference input 'wrong' for model 'linear'"),
    (lambda c: c.infer("linear", [tg.InferInput("input", [1, 5], "FP32").set_data_from_numpy(
        np.ones((1, 5), np.float32))], request_id="abc"), "INVALID_ARGUMENT",
     "[request id: abc] unexpected shape for input 'input' for model 'linear'"),
])
def test_errors_have_tritons_codes_and_words(gc: tg.InferenceServerClient, call: Any,
                                             code: str, message: str) -> None:
    with pytest.raises(InferenceServerException) as got:
        call(gc)
    assert code_of(got.value) == code
    assert message in got.value.message()
    assert gc.is_server_live()


def test_malformed_message_is_invalid_argument_and_serving_goes_on(
        channel: grpc.Channel, gc: tg.InferenceServerClient) -> None:
    raw = channel.unary_unary(SERVICE + "ModelInfer")
    for garbage in (b"\xff\xff\xff\xff", b"\x0a\x05ab"):   # a bad tag; a truncated string
        with pytest.raises(grpc.RpcError) as got:
            raw(garbage, timeout=10)
        assert got.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "malformed ModelInferRequest" in got.value.details()
    unknown = channel.unary_unary(SERVICE + "NoSuchCall")
    with pytest.raises(grpc.RpcError) as got:
        unknown(b"", timeout=10)
    assert got.value.code() is grpc.StatusCode.UNIMPLEMENTED
    assert gc.infer("linear", [linear_input()]).as_numpy("output").shape == (3, 3)


def test_threads_share_one_client(gc: tg.InferenceServerClient) -> None:
    shapes: list[tuple[int, ...]] = []

    def call() -> None:
        for _ in range(5):
            shapes.append(gc.infer("linear", [linear_input()]).as_numpy("output").shape)
    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert shapes == [(3, 3)] * 20


def test_the_model_config_message_carries_response_cache() -> None:
    from tests.conftest import linear_config
    from zeroserve.gateway.grpc import messages
    from zeroserve.models.repository import parse_config

    doc = parse_config(linear_config("m", response_cache={"enable": True}), "t").to_json()
    assert messages.model_config(doc).response_cache.enable
    assert not messages.model_config(parse_config(linear_config("m"), "t").to_json()) \
        .response_cache.enable


@pytest.mark.parametrize("datatype, shape, raw, message", [
    ("FP99", [1, 4], True, "input tensor 'input' for model 'linear': unknown datatype 'FP99'"),
    ("FP32", [1, -4], True, "input tensor 'input' for model 'linear': the shape [1, -4] has "
     "a negative dimension"),
    ("FP32", [1, 4], False, "unable to find data for input tensor 'input' for model "
     "'linear' in request."),
])
def test_decode_refuses_a_bad_input_in_tritons_words(datatype: str, shape: list[int],
                                                     raw: bool, message: str) -> None:
    from zeroserve.gateway.errors import BadRequest
    from zeroserve.gateway.grpc import tensors

    req = pb.ModelInferRequest(model_name="linear")
    req.inputs.add(name="input", datatype=datatype, shape=shape)
    if raw:
        req.raw_input_contents.append(np.ones((1, 4), np.float32).tobytes())
    with pytest.raises(BadRequest) as got:
        tensors.decode(req, None)
    assert str(got.value) == message
