"""The seed's own requests, end to end over HTTP: its registration body (``input_shape``,
no ``outputs``) registers a traced transformer taking token ids, with the outputs and
INT64 found by the trial load; its ``/models/{m}/v{n}/predict`` answers; a Python
handler returning numpy answers, and a wrong type is refused while the server serves."""

from __future__ import annotations

import json
import shutil
import textwrap
import warnings
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import torch

from tests.conftest import Server, http, linear_config, short_tmpdir, wait_for, write_model

pytestmark = pytest.mark.timeout(240)

SEQ = 128


def traced_bert(path: Path) -> None:
    """A small BERT (random weights from seed 0, no download) traced on (input_ids,
    attention_mask), as a user exports one for TorchScript serving."""
    from transformers import BertConfig, BertModel   # heavy: only where it is used

    torch.manual_seed(0)
    config = BertConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=128, vocab_size=1000, torchscript=True,
                        return_dict=False)
    model = BertModel(config).eval()
    ids = torch.randint(0, 1000, (1, SEQ))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # TracerWarnings about Python values in the graph
        traced = torch.jit.trace(model, (ids, torch.ones_like(ids)))
    torch.jit.save(traced, str(path))


class BoolOnly(torch.nn.Module):
    def forward(self, flags: torch.Tensor) -> torch.Tensor:
        assert flags.dtype == torch.bool, "flags must be a BOOL mask"
        return flags.logical_not()


HANDLER = textwrap.dedent('''
    import numpy as np

    class Model:
        def load(self, version_dir, device):
            pass

        def predict(self, inputs):
            x = inputs["x"].numpy()
            ids = np.argsort(x, axis=1)
            if (x < 0).any():   # the test's wrong type: floats for an INT64 output
                ids = ids.astype(np.float32)
            return {"score": x.sum(axis=1, keepdims=True), "ids": ids}
''')


@pytest.fixture(scope="module")
def imports() -> Iterator[Path]:
    root = short_tmpdir("zsimp")
    traced_bert(root / "bert.pt")
    torch.jit.save(torch.jit.script(BoolOnly()), str(root / "flags.pt"))
    (root / "numpy").mkdir()
    (root / "numpy" / "model.py").write_text(HANDLER)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def server(imports: Path) -> Iterator[Server]:
    repo = short_tmpdir("zsrepo")
    write_model(repo, "m", 1, "nn.Linear(4, 3)", linear_config("m"))
    srv = Server(repo, extra=["--import-root", str(imports)]).wait_ready()
    yield srv
    srv.stop()
    shutil.rmtree(repo, ignore_errors=True)


def post(url: str, path: str, doc: Any) -> tuple[int, Any]:
    status, _, body = http("POST", url + path, json.dumps(doc).encode(),
                           {"Content-Type": "application/json"}, timeout=120)
    return status, json.loads(body)


def ready(srv: Server, name: str) -> None:
    wait_for(lambda: http("GET", f"{srv.url}/v2/models/{name}/ready")[0] == 200, 60,
             f"{name} ready")


def seed_body(name: str, path: Path, **shapes: Any) -> dict[str, Any]:
    return {"name": name, "platform": "pytorch", "model_path": str(path),
            "max_batch_size": 16,
            "input_shape": shapes or {"input_ids": [1, SEQ], "attention_mask": [1, SEQ]}}


def bert_in_process(srv: Server, ids: np.ndarray, mask: np.ndarray) -> list[np.ndarray]:
    module = torch.jit.load(str(srv.model_dir / "bert" / "1" / "model.pt"))
    with torch.inference_mode():
        return [t.numpy() for t in module(torch.from_numpy(ids), torch.from_numpy(mask))]


def test_the_seeds_body_registers_a_traced_bert_with_outputs_and_int64_found(
        server: Server, imports: Path) -> None:
    status, doc = post(server.url, "/v1/models", seed_body("bert", imports / "bert.pt"))
    assert status == 201, doc
    assert doc["inputs"] == [{"name": "input_ids", "datatype": "INT64", "shape": [SEQ]},
                             {"name": "attention_mask", "datatype": "INT64", "shape": [SEQ]}]
    assert doc["outputs"] == [{"name": "output__0", "datatype": "FP32", "shape": [SEQ, 64]},
                              {"name": "output__1", "datatype": "FP32", "shape": [64]}]
    published = json.loads((server.model_dir / "bert" / "config.json").read_text())
    assert published["outputs"] == doc["outputs"] and published["inputs"] == doc["inputs"]
    ready(server, "bert")

    rng = np.random.default_rng(0)
    ids = rng.integers(0, 1000, (2, SEQ), dtype=np.int64)
    mask = np.ones((2, SEQ), dtype=np.int64)
    mask[1, 100:] = 0
    want = bert_in_process(server, ids, mask)
    for version in ("v1", "1"):
        status, out = post(server.url, f"/models/bert/{version}/predict",
                           {"inputs": {"input_ids": ids.tolist(),
                                       "attention_mask": mask.tolist()}})
        assert status == 200 and out["model_version"] == 1, out
        for name, expected in zip(("output__0", "output__1"), want):
            np.testing.assert_allclose(out["outputs"][name], expected, atol=1e-4)


def test_datatypes_given_in_input_shape_are_declared_as_given(server: Server,
                                                              imports: Path) -> None:
    shapes = {"input_ids": {"shape": [1, SEQ], "datatype": "INT32"},
              "attention_mask": {"shape": [1, SEQ], "datatype": "INT64"}}
    status, doc = post(server.url, "/v1/models",
                       seed_body("bert32", imports / "bert.pt", **shapes))
    assert status == 201, doc
    assert [t["datatype"] for t in doc["inputs"]] == ["INT32", "INT64"]
    assert [t["name"] for t in doc["outputs"]] == ["output__0", "output__1"]
    ready(server, "bert32")
    status, out = post(server.url, "/models/bert32/v1/predict",
                       {"inputs": {"input_ids": [[5] * SEQ], "attention_mask": [[1] * SEQ]}})
    assert status == 200 and len(out["outputs"]["output__1"][0]) == 64, out


def test_a_model_refusing_fp32_and_int64_is_refused_saying_how_to_declare(
        server: Server, imports: Path) -> None:
    status, doc = post(server.url, "/v1/models",
                       seed_body("flags", imports / "flags.pt", flags=[1, 3]))
    assert status == 422, doc
    assert doc["error"].startswith("flags/1: the model runs neither on FP32 nor on INT64")
    assert "flags must be a BOOL mask" in doc["error"]
    assert ('Declare each input\'s datatype in the registration: "input_shape": '
            '{"flags": {"shape": [1, 3], "datatype": "INT64"}}') in doc["error"]
    assert not [p for p in server.model_dir.iterdir() if p.name.startswith(".register")]
    # declared, it registers
    status, doc = post(server.url, "/v1/models", seed_body(
        "flags", imports / "flags.pt", flags={"shape": [1, 3], "datatype": "BOOL"}))
    assert status == 201 and doc["outputs"] == [
        {"name": "output__0", "datatype": "BOOL", "shape": [3]}], doc


def test_a_handler_returning_numpy_answers_and_a_wrong_type_is_refused_precisely(
        server: Server, imports: Path) -> None:
    status, doc = post(server.url, "/v1/models", {
        "name": "np", "platform": "python", "model_path": str(imports / "numpy"),
        "max_batch_size": 8, "input_shape": {"x": [1, 4]}})
    assert status == 201, doc
    assert doc["outputs"] == [{"name": "score", "datatype": "FP32", "shape": [1]},
                              {"name": "ids", "datatype": "INT64", "shape": [4]}]
    ready(server, "np")
    good = {"inputs": {"x": [[3.0, 1.0, 4.0, 2.0]]}}
    status, out = post(server.url, "/models/np/v1/predict", good)
    assert status == 200 and out["outputs"] == {"score": [[10.0]], "ids": [[1, 3, 0, 2]]}
    status, out = post(server.url, "/models/np/predict", {"inputs": {"x": [[-1.0] * 4]}})
    assert status == 500, out
    assert ("output 'ids': expected INT64 (a tensor, or a numpy array that casts to int64 "
            "within its kind), got ndarray of dtype float32") in out["error"]
    status, out = post(server.url, "/models/np/1/predict", good)
    assert status == 200 and out["outputs"]["ids"] == [[1, 3, 0, 2]], out
