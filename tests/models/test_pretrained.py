"""Platform ``transformers`` (models/pretrained.py, models/hfweights.py): a
``save_pretrained`` folder is a version as it is; its weights are read from the
safetensors headers without torch and equal the loaded model's state (one file or
shards, in the dtype saved); the embedding's width is the folder's hidden size; a worker
without transformers refuses it saying what to install."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests import bert
from zeroserve.broker import protocol as p
from zeroserve.models import formats, hfweights
from zeroserve.models.footprint import predict
from zeroserve.models.loader import load
from zeroserve.models.repository import list_versions, parse_config, scan
from zeroserve.workers import batching
from zeroserve.workers.memory import rss_bytes

transformers = pytest.importorskip("transformers")

CONFIG = {"name": "emb", "platform": "transformers", "text": {"task": "embeddings"}}


def loaded_bytes(folder: Path) -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModel.from_pretrained(str(folder), dtype="auto")
    # the saved tensors: a buffer the model makes itself (position ids) is not in the file
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def save(folder: Path, **kw: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = bert.save_pretrained(folder)
        if kw:
            module.save_pretrained(str(folder), **kw)
    return module


@pytest.mark.parametrize("how", ["one file", "shards", "half"])
def test_the_weights_read_without_torch_are_what_the_model_loads(tmp_path: Path,
                                                                 how: str) -> None:
    folder = tmp_path / "1"
    if how == "half":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            bert.save_pretrained(folder).half().save_pretrained(str(folder))
    else:
        save(folder, **({"max_shard_size": "200KB"} if how == "shards" else {}))
    shards = sorted(f.name for f in folder.glob("*.safetensors"))
    assert len(shards) > 1 if how == "shards" else shards == ["model.safetensors"]
    cfg = parse_config(CONFIG, "t")
    assert cfg.model_file == "config.json" and list_versions(tmp_path, cfg) == [1]
    # an adapter's file beside the model's is not the model's
    (folder / "adapter_model.safetensors").write_bytes((folder / shards[0]).read_bytes())
    weights = predict(cfg, folder).weights_bytes
    assert weights == loaded_bytes(folder) > 0


def test_the_broker_reads_them_without_importing_torch(tmp_path: Path) -> None:
    save(tmp_path / "emb" / "1")
    (tmp_path / "emb" / "config.json").write_text(json.dumps(CONFIG))
    code = ("import json, sys; from pathlib import Path\n"
            "from zeroserve.models.footprint import predict\n"
            "from zeroserve.models.repository import load_config\n"
            "cfg = load_config(Path(sys.argv[1]) / 'emb')\n"
            "pred = predict(cfg, Path(sys.argv[1]) / 'emb' / '1')\n"
            "print(json.dumps([pred.weights_bytes, 'torch' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    weights, torch_loaded = json.loads(out.stdout)
    assert weights == loaded_bytes(tmp_path / "emb" / "1") and not torch_loaded


def test_what_does_not_read_is_not_predicted(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert hfweights.weights_bytes(tmp_path / "config.json") is None   # no weights
    (tmp_path / "pytorch_model.bin").write_bytes(b"\0" * 16)
    assert hfweights.weights_bytes(tmp_path / "config.json") is None   # torch's pickle
    bad = tmp_path / "model.safetensors"
    for raw in (b"\1\2", struct.pack("<Q", 1 << 40) + b"{}",
                struct.pack("<Q", 2) + b"[]",
                struct.pack("<Q", 40) + json.dumps({"w": {"data_offsets": [8, 0]}})
                .encode().ljust(40)):
        bad.write_bytes(raw)
        assert hfweights.safetensors_bytes(bad) is None, raw
        assert formats.weights_bytes("transformers", tmp_path / "config.json") is None


def test_a_worker_without_transformers_says_what_to_install(tmp_path: Path) -> None:
    save(tmp_path / "1")
    code = ("import sys; from pathlib import Path\n"
            "sys.modules['transformers'] = None   # as where it is not installed\n"
            "from zeroserve.models.loader import LoadError, load\n"
            "from zeroserve.models.repository import parse_config\n"
            f"cfg = parse_config({CONFIG!r}, 't')\n"
            "try:\n"
            "    load(cfg, 1, Path(sys.argv[1]), 'cpu', lambda: 0)\n"
            "except LoadError as exc:\n"
            "    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "1")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "platform 'transformers' needs the transformers library" in out.stdout
    assert "pip install 'zeroserve[text]'" in out.stdout


def test_the_embedding_s_width_is_the_folder_s_hidden_size(tmp_path: Path) -> None:
    save(tmp_path / "emb" / "1")
    (tmp_path / "emb" / "config.json").write_text(json.dumps(CONFIG))
    with warnings.catch_warnings():   # transformers' and the tracer's, not ours
        warnings.simplefilter("ignore")
        bert.save_traced(bert.model(), tmp_path / "ts" / "1" / "model.pt")
    (tmp_path / "ts" / "config.json").write_text(json.dumps(
        {**CONFIG, "name": "ts", "platform": "pytorch_torchscript"}))
    models, errors = scan(tmp_path)
    assert errors == {}
    assert [(t.name, t.shape) for t in models["emb"].config.outputs] == \
        [("embedding", (bert.SMALL["hidden_size"],))]
    assert models["ts"].config.outputs[0].shape == (-1,)   # a traced file does not say


def test_a_folder_without_a_text_section_answers_its_outputs_by_name(tmp_path: Path) -> None:
    """The platform serves any AutoModel: its ModelOutput's fields are the outputs the
    config names, whatever their order in it."""
    module = save(tmp_path / "1")
    hidden = bert.SMALL["hidden_size"]
    cfg = parse_config({
        "name": "raw", "platform": "transformers", "max_batch_size": 4,
        "inputs": [{"name": "attention_mask", "datatype": "INT64", "shape": [-1]},
                   {"name": "input_ids", "datatype": "INT64", "shape": [-1]}],
        "outputs": [{"name": "pooler_output", "datatype": "FP32", "shape": [hidden]},
                    {"name": "last_hidden_state", "datatype": "FP32",
                     "shape": [-1, hidden]}]}, "t")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = load(cfg, 1, tmp_path / "1", "cpu", rss_bytes)
    ids = np.random.default_rng(0).integers(0, 1000, (2, 6), dtype=np.int64)
    mask = np.ones_like(ids)
    result = batching.run(loaded, p.Batch(1, "raw", 1, [p.BatchItem("0", [
        p.from_numpy("input_ids", ids), p.from_numpy("attention_mask", mask)], None)], 0))
    assert result.error is None, result.error
    got = {t.meta.name: p.to_numpy(t) for t in result.replies[0].tensors}
    with torch.inference_mode():
        want = module(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask))
    np.testing.assert_allclose(got["last_hidden_state"], want.last_hidden_state.numpy(),
                               atol=1e-5)
    np.testing.assert_allclose(got["pooler_output"], want.pooler_output.numpy(), atol=1e-5)
    loaded.release()
