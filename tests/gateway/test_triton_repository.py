"""A Triton model repository served as it is: TorchScript models with a config.pbtxt and
no config.json, made by the test, through tritonclient.http unchanged, beside the same
model with the config.json that says the same."""

from __future__ import annotations

import json
import shutil
from typing import Iterator

import numpy as np
import pytest
import torch
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from tests.conftest import Server, short_tmpdir, wait_for, write_model

pytestmark = pytest.mark.timeout(180)

PBTXT = '''
name: "tpt"
platform: "pytorch_libtorch"
max_batch_size: 8
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 3 ] } ]
dynamic_batching {
  preferred_batch_size: [ 4, 8 ]
  max_queue_delay_microseconds: 200
  priority_levels: 2
  default_priority_level: 2
  default_queue_policy { default_timeout_microseconds: 0 max_queue_size: 64 }
}
instance_group [ { count: 2 kind: KIND_CPU } ]
version_policy: { all: { } }
'''

AS_JSON = {
    "name": "tjs", "platform": "pytorch_libtorch", "max_batch_size": 8,
    "inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [4]}],
    "outputs": [{"name": "OUTPUT__0", "datatype": "FP32", "shape": [3]}],
    "dynamic_batching": {"preferred_batch_sizes": [4, 8], "max_queue_delay_ms": 0.2,
                         "priority_levels": 2, "default_priority": 2, "max_queue_size": 64},
    "version_policy": {"all": True}}

STATEFUL = '''
platform: "pytorch_libtorch"
max_batch_size: 2
input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 3 ] } ]
sequence_batching { }
'''

X = np.random.default_rng(4).standard_normal((3, 4)).astype(np.float32)


@pytest.fixture(scope="module")
def srv() -> Iterator[Server]:
    repo = short_tmpdir("zsrepo")
    for version in (1, 2):
        write_model(repo, "tpt", version, "nn.Linear(4, 3)")
        write_model(repo, "tjs", version, "nn.Linear(4, 3)")
    (repo / "tpt" / "config.pbtxt").write_text(PBTXT)
    (repo / "tjs" / "config.json").write_text(json.dumps(AS_JSON))
    write_model(repo, "stateful", 1, "nn.Linear(4, 3)")
    (repo / "stateful" / "config.pbtxt").write_text(STATEFUL)
    # "any": the stateful model is refused, and strict readiness would wait for it
    server = Server(repo, extra=["--readiness", "any"])
    try:
        server.wait_ready()
        with triton.InferenceServerClient(server.url.removeprefix("http://")) as c:
            wait_for(lambda: c.is_model_ready("tpt", "2") and c.is_model_ready("tjs", "2"),
                     60, "both models ready")
        yield server
    finally:
        server.stop()
        shutil.rmtree(repo, ignore_errors=True)


@pytest.fixture(scope="module")
def client(srv: Server) -> Iterator[triton.InferenceServerClient]:
    c = triton.InferenceServerClient(srv.url.removeprefix("http://"))
    yield c
    c.close()


def test_the_pbtxt_model_has_the_config_and_metadata_of_its_json_twin(client) -> None:
    pbtxt, json_twin = client.get_model_config("tpt"), client.get_model_config("tjs")
    assert pbtxt["name"] == "tpt" and {**pbtxt, "name": "tjs"} == json_twin
    assert pbtxt["dynamic_batching"]["max_queue_delay_ms"] == 0.2
    meta = client.get_model_metadata("tpt")
    assert meta["versions"] == ["1", "2"]
    assert meta["inputs"] == [{"name": "INPUT__0", "datatype": "FP32", "shape": [-1, 4]}]
    assert meta["outputs"] == [{"name": "OUTPUT__0", "datatype": "FP32", "shape": [-1, 3]}]


@pytest.mark.parametrize("version", ["1", "2"])
def test_the_pbtxt_model_answers_as_torch_does(client, srv, version) -> None:
    inp = triton.InferInput("INPUT__0", [3, 4], "FP32").set_data_from_numpy(X)
    got = client.infer("tpt", [inp], model_version=version).as_numpy("OUTPUT__0")
    module = torch.jit.load(str(srv.model_dir / "tpt" / version / "model.pt"))
    with torch.inference_mode():
        expected = module(torch.from_numpy(X)).numpy()
    np.testing.assert_allclose(got, expected, atol=1e-6)


def test_ignored_fields_are_logged_and_refused_ones_named(client, srv) -> None:
    assert "config.pbtxt: field 'instance_group' is ignored" in srv.log()
    [entry] = [e for e in client.get_model_repository_index() if e["name"] == "stateful"]
    assert entry["state"] == "UNAVAILABLE"
    assert "field 'sequence_batching': not supported" in entry["reason"]
    with pytest.raises(InferenceServerException) as err:
        client.get_model_config("stateful")
    assert err.value.message() == "Request for unknown model: 'stateful' is not found"
    assert client.is_model_ready("tpt")


def test_an_edited_pbtxt_is_picked_up_as_a_config_json_would_be(client, srv) -> None:
    folder = srv.model_dir / "tpt"
    tmp = folder / ".config.pbtxt.tmp"   # a temp name the watcher ignores, then a rename
    tmp.write_text(PBTXT.replace("max_batch_size: 8", "max_batch_size: 4"))
    tmp.rename(folder / "config.pbtxt")
    wait_for(lambda: client.get_model_config("tpt")["max_batch_size"] == 4, 60,
             "the new config.pbtxt to be served")
    inp = triton.InferInput("INPUT__0", [5, 4], "FP32").set_data_from_numpy(
        np.zeros((5, 4), np.float32))
    with pytest.raises(InferenceServerException, match="batch-size must be <= 4 for 'tpt'"):
        client.infer("tpt", [inp])
