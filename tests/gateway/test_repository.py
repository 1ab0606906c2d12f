"""The statistics and model repository extensions through tritonclient.http and
tritonclient.http.aio unchanged, against a real ``zeroserve serve`` started with
``--model-control-mode explicit`` (``linear`` and ``counted`` loaded at start,
``other`` left in the repository)."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from typing import Iterator

import numpy as np
import pytest
import tritonclient.http as triton
import tritonclient.http.aio as triton_aio
from tritonclient.utils import InferenceServerException

from tests.conftest import Server, linear_config, short_tmpdir, write_model
from zeroserve.models.repository import version_sha256

pytestmark = pytest.mark.timeout(180)

X = np.random.default_rng(2).standard_normal((3, 4)).astype(np.float32)


@pytest.fixture(scope="module")
def srv() -> Iterator[Server]:
    repo = short_tmpdir("zsrepo")
    for name in ("linear", "counted", "other"):
        write_model(repo, name, 1, "nn.Linear(4, 3)", linear_config(name))
    server = Server(repo, extra=["--model-control-mode", "explicit", "--load-model", "linear",
                                 "--load-model", "counted"])
    try:
        yield server.wait_ready()
    finally:
        server.stop()
        shutil.rmtree(repo, ignore_errors=True)


def infer(client: triton.InferenceServerClient, model: str) -> np.ndarray:
    inp = triton.InferInput("input", [3, 4], "FP32").set_data_from_numpy(X)
    return client.infer(model, [inp]).as_numpy("output")


def states(client: triton.InferenceServerClient) -> dict[str, str]:
    return {e["name"]: e["state"] for e in client.get_model_repository_index()}


def test_statistics_count_exactly_what_ran(client, srv) -> None:
    before_ms = int(time.time() * 1000)
    for _ in range(5):  # one at a time: each request is one batch of 3 samples
        infer(client, "counted")
    doc = client.get_inference_statistics("counted")
    [st] = doc["model_stats"]
    assert (st["name"], st["version"]) == ("counted", "1")
    assert st["inference_count"] == 15 and st["execution_count"] == 5
    assert st["last_inference"] >= before_ms
    inf = st["inference_stats"]
    for key in ("success", "queue", "compute_input", "compute_infer", "compute_output"):
        assert inf[key]["count"] == 5, key
    assert inf["fail"]["count"] == 0
    assert inf["success"]["ns"] > 0 and inf["compute_infer"]["ns"] > 0
    inside = sum(inf[k]["ns"] for k in ("queue", "compute_input", "compute_infer",
                                        "compute_output"))
    assert inside <= inf["success"]["ns"]
    [batch] = st["batch_stats"]
    assert batch["batch_size"] == 3 and batch["compute_infer"]["count"] == 5
    assert isinstance(st["memory_usage"], list)
    assert {s["name"] for s in client.get_inference_statistics()["model_stats"]} == \
        {"linear", "counted"}
    assert client.get_inference_statistics("counted", "1")["model_stats"][0][
        "execution_count"] == 5
    with pytest.raises(InferenceServerException,
                       match="Request for unknown model: 'nope' is not found"):
        client.get_inference_statistics("nope")

    async def aio() -> dict:
        c = triton_aio.InferenceServerClient(srv.url.removeprefix("http://"))
        try:
            return await c.get_inference_statistics("counted")
        finally:
            await c.close()
    assert asyncio.run(aio())["model_stats"][0]["inference_count"] == 15


def test_index_load_and_unload(client) -> None:
    assert client.is_server_ready(), "a model not asked for must not hold readiness back"
    index = client.get_model_repository_index()
    assert {"name": "other", "version": "1", "state": "UNAVAILABLE",
            "reason": "not loaded"} in index
    assert states(client) == {"linear": "READY", "counted": "READY", "other": "UNAVAILABLE"}
    assert not client.is_model_ready("other")
    client.load_model("other")
    assert client.is_model_ready("other") and infer(client, "other").shape == (3, 3)
    ready = client.get_model_repository_index(query_params=None)
    assert {e["name"] for e in ready if e["state"] == "READY"} == {"linear", "counted",
                                                                   "other"}
    client.unload_model("other")
    assert not client.is_model_ready("other")
    [entry] = [e for e in client.get_model_repository_index() if e["name"] == "other"]
    assert entry["state"] == "UNAVAILABLE" and entry["reason"] == "unloaded"
    with pytest.raises(InferenceServerException):
        infer(client, "other")
    assert client.is_server_ready()


def test_a_config_override_and_a_broken_one(client, srv) -> None:
    client.load_model("other", config=json.dumps(linear_config("other", mbs=2)))
    assert client.get_model_config("other")["max_batch_size"] == 2
    with pytest.raises(InferenceServerException, match="batch-size must be <= 2 for 'other'"):
        infer(client, "other")
    with pytest.raises(InferenceServerException, match="failed to load 'other'.*JSON|"
                       "failed to load 'other'.*Expecting"):
        client.load_model("other", config="{not json")
    with pytest.raises(InferenceServerException, match="failed to load 'other'.*platform"):
        client.load_model("other", config=json.dumps({**linear_config("other"),
                                                       "platform": "onnx_nope"}))
    # a broken override changes nothing: the override before it keeps serving
    assert client.is_model_ready("other")
    assert client.get_model_config("other")["max_batch_size"] == 2
    client.load_model("other")   # from the repository again
    assert client.get_model_config("other")["max_batch_size"] == 8


def test_a_partial_override_keeps_the_rest_of_the_stored_config(client, srv) -> None:
    """As Triton: the override's fields replace the stored config's, numbers may be
    strings (Triton's JSON parser takes them), and Triton's field names are read."""
    client.load_model("other", config='{"max_batch_size":"2"}')
    cfg = client.get_model_config("other")
    assert cfg["max_batch_size"] == 2 and cfg["platform"] == "pytorch_torchscript"
    assert cfg["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [4]}]
    with pytest.raises(InferenceServerException, match="batch-size must be <= 2 for 'other'"):
        infer(client, "other")
    client.load_model("other", config=json.dumps({"dynamic_batching": {
        "preferred_batch_size": ["2", 4], "max_queue_delay_microseconds": "1500"}}))
    cfg = client.get_model_config("other")   # one override replaces the one before
    assert cfg["max_batch_size"] == 8 and cfg["dynamic_batching"]["preferred_batch_sizes"] \
        == [2, 4] and cfg["dynamic_batching"]["max_queue_delay_ms"] == 1.5
    assert infer(client, "other").shape == (3, 3)
    with pytest.raises(InferenceServerException,
                       match="failed to load 'other'.*field 'sequence_batching'"):
        client.load_model("other", config='{"sequence_batching": {}}')
    client.load_model("other")
    assert client.get_model_config("other")["dynamic_batching"]["max_queue_delay_ms"] == 0


def test_a_load_with_files_and_one_that_fails_on_the_worker(client, tmp_path) -> None:
    vdir = write_model(tmp_path, "fresh", 1, "nn.Linear(4, 3)")
    cfg = json.dumps(linear_config("fresh"))
    client.load_model("fresh", config=cfg, files={"file:1/model.pt":
                                                  (vdir / "model.pt").read_bytes()})
    assert infer(client, "fresh").shape == (3, 3)
    with pytest.raises(InferenceServerException, match="failed to load 'broken'"):
        client.load_model("broken", config=json.dumps(linear_config("broken")),
                          files={"file:1/model.pt": b"not a torchscript archive"})
    assert not client.is_model_ready("broken")
    with pytest.raises(InferenceServerException, match="need a config"):
        client.load_model("fresh", files={"file:1/model.pt": b"x"})


def test_a_load_with_files_persists_and_a_failed_one_leaves_the_folder_as_it_was(
        client, srv, tmp_path) -> None:
    """As a push: the files and their config are the model's folder from then on, past
    an unload and a plain load; a load with files that fails puts the folder back."""
    vdir = write_model(tmp_path, "kept", 1, "nn.Linear(4, 3)")
    client.load_model("kept", config=json.dumps(linear_config("kept", mbs=4)),
                      files={"file:1/model.pt": (vdir / "model.pt").read_bytes()})
    folder = srv.model_dir / "kept"
    assert (folder / "1" / "model.pt").read_bytes() == (vdir / "model.pt").read_bytes()
    client.unload_model("kept")
    client.load_model("kept")   # from the repository: what the load with files left
    assert client.is_model_ready("kept") and client.get_model_config("kept")[
        "max_batch_size"] == 4
    before = version_sha256(folder / "1")
    with pytest.raises(InferenceServerException, match="failed to load 'kept'"):
        client.load_model("kept", config=json.dumps(linear_config("kept")),
                          files={"file:1/model.pt": b"not a torchscript archive"})
    assert version_sha256(folder / "1") == before
    assert client.is_model_ready("kept") and infer(client, "kept").shape == (3, 3)
    assert not [p.name for p in srv.model_dir.iterdir() if p.name.startswith(".")]


def test_a_file_path_too_long_fails_as_triton_does(client, srv) -> None:
    """NVIDIA's simple_grpc_model_control.py expects INTERNAL and these words."""
    import tritonclient.grpc as tg
    grpc_client = tg.InferenceServerClient(srv.grpc_url)
    try:
        with pytest.raises(InferenceServerException) as got:
            grpc_client.load_model("linear", config="{}", files={"file:" + "A" * 256: b"a"})
        assert got.value.status() == "StatusCode.INTERNAL"
        assert "failed to poll from model repository" in got.value.message()
        assert grpc_client.is_server_live()
    finally:
        grpc_client.close()
    with pytest.raises(InferenceServerException,
                       match="failed to poll from model repository") as over_http:
        client.load_model("linear", config="{}", files={"file:" + "A" * 256: b"a"})
    assert over_http.value.status() == "500"
    assert client.is_model_ready("linear")


def test_model_control_none_loads_everything_and_refuses_changes() -> None:
    repo = short_tmpdir("zsrepo")
    for name in ("linear", "other"):
        write_model(repo, name, 1, "nn.Linear(4, 3)", linear_config(name))
    srv = Server(repo, extra=["--model-control-mode", "none"])
    try:
        srv.wait_ready()
        c = triton.InferenceServerClient(srv.url.removeprefix("http://"))
        assert states(c) == {"linear": "READY", "other": "READY"}
        with pytest.raises(InferenceServerException, match="model control mode 'none'"):
            c.load_model("other")
        with pytest.raises(InferenceServerException, match="model control mode 'none'"):
            c.unload_model("other")
        assert c.is_model_ready("other")
        assert "model control none:" in srv.log() and "is not watched" in srv.log()
        c.close()
    finally:
        srv.stop()
        shutil.rmtree(repo, ignore_errors=True)
