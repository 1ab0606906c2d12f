"""A real transformer for the tests and benchmarks: ``transformers``' BertModel from a
config, random weights from seed 0, nothing downloaded. Saved as TorchScript (traced) and
as a torch.export program, inputs ``input_ids`` and ``attention_mask`` INT64 [L] with L
free, outputs ``last_hidden_state`` [L, hidden] and ``pooler_output`` [hidden]."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

# the bench's BERT-mini (WORKLOADS.md); the tests take a smaller one by default
MINI = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
        "intermediate_size": 1024, "vocab_size": 30522}
SMALL = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
         "intermediate_size": 128, "vocab_size": 1000}
PADDING = {"inputs": [{"name": "input_ids", "dim": 0, "value": 0},
                      {"name": "attention_mask", "dim": 0, "value": 0}],
           "outputs": [{"name": "last_hidden_state", "dim": 0}]}


def model(size: dict[str, int] | None = None) -> Any:
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(**(size or SMALL), max_position_embeddings=512, torchscript=True,
                     attn_implementation="eager")
    return BertModel(cfg).eval()


def inputs(length: int, vocab: int, rng: np.random.Generator, rows: int = 1
           ) -> dict[str, np.ndarray]:
    return {"input_ids": rng.integers(0, vocab, (rows, length), dtype=np.int64),
            "attention_mask": np.ones((rows, length), dtype=np.int64)}


def config(name: str, platform: str, hidden: int, max_batch_size: int = 16,
           padding: dict[str, Any] | None = None, **batching: Any) -> dict[str, Any]:
    db: dict[str, Any] = dict(batching)
    if padding is not None:
        db["padding"] = padding
    return {"name": name, "platform": platform, "max_batch_size": max_batch_size,
            "inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [-1]},
                       {"name": "attention_mask", "datatype": "INT64", "shape": [-1]}],
            "outputs": [{"name": "last_hidden_state", "datatype": "FP32", "shape": [-1, hidden]},
                        {"name": "pooler_output", "datatype": "FP32", "shape": [hidden]}],
            "dynamic_batching": db, "warmup": {"batch_sizes": [1, 4]}}


def save_traced(module: Any, path: Path) -> None:
    import torch

    ids = torch.ones((2, 8), dtype=torch.int64)
    with torch.no_grad():
        traced = torch.jit.trace(module, (ids, torch.ones_like(ids)), strict=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.jit.save(traced, str(path))


class Tuple:
    """The model returning a plain tuple: an exported program whose output is
    transformers' ModelOutput only loads where transformers is imported (its pytree
    node is registered there), and a worker does not import it."""

    def __new__(cls, module: Any) -> Any:
        import torch

        class _Tuple(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.bert = module

            def forward(self, ids: Any, mask: Any) -> Any:
                out = self.bert(ids, mask)
                return out[0], out[1]

        return _Tuple().eval()


def save_exported(module: Any, path: Path, max_batch_size: int = 16) -> None:
    import torch

    batch = torch.export.Dim("batch", min=1, max=max_batch_size)
    length = torch.export.Dim("length", min=1, max=512)
    ids = torch.ones((2, 8), dtype=torch.int64)
    program = torch.export.export(
        Tuple(module), (ids, torch.ones_like(ids)),
        dynamic_shapes=({0: batch, 1: length}, {0: batch, 1: length}))
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.export.save(program, str(path))


def write(repo: Path, name: str, module: Any, platform: str = "pytorch_torchscript",
          compiled: bool = False, **cfg: Any) -> Path:
    """A model folder with version 1 in ``platform``'s format and its config; with
    ``compiled``, the exported program turned into an AOTInductor package by
    ``zeroserve compile`` (tens of seconds)."""
    vdir = repo / name / "1"
    config_file = repo / name / "config.json"
    config_file.parent.mkdir(parents=True, exist_ok=True)
    config_file.write_text(json.dumps(config(name, platform, module.config.hidden_size, **cfg)))
    if platform == "pytorch_torchscript":
        save_traced(module, vdir / "model.pt")
    elif not compiled:
        save_exported(module, vdir / "model.pt2", cfg.get("max_batch_size", 16))
    else:
        program = repo / f".{name}-program.pt2"
        save_exported(module, program, cfg.get("max_batch_size", 16))
        vdir.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, str(ROOT / "bin" / "zeroserve"), "compile",
                        str(program), "--config", str(config_file),
                        "--output", str(vdir / "model.pt2")], check=True,
                       capture_output=True, timeout=600)
        program.unlink()
    return vdir


def expected(module: Any, ids: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The model run in-process on one request, unpadded."""
    import torch

    with torch.inference_mode():
        hidden, pooled = module(torch.from_numpy(ids), torch.from_numpy(mask))[:2]
    return hidden.numpy(), pooled.numpy()


def vocabulary(size: int) -> list[str]:
    """A WordPiece vocabulary of ``size`` entries written by the test (no download): the
    special tokens, letters and digits (also as ``##`` pieces), then words ``w0``, ``w1``,
    ... so that a text of k words ``w<i>`` is k + 2 tokens."""
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    chars = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [str(d) for d in range(10)]
    head = special + chars + ["##" + c for c in chars]
    return head + [f"w{i}" for i in range(size - len(head))]


def save_pretrained(folder: Path, size: dict[str, int] | None = None,
                    torchscript: bool = False) -> Any:
    """A BertModel (random weights from seed 0) and a BertTokenizerFast on
    :func:`vocabulary`, both written by ``save_pretrained`` into ``folder`` as a user
    brings them: config.json, model.safetensors, tokenizer.json and its companions.
    Returns the model, in eval mode (a ModelOutput unless ``torchscript``)."""
    import torch
    from transformers import BertConfig, BertModel, BertTokenizerFast

    dims = size or SMALL
    folder.mkdir(parents=True, exist_ok=True)
    vocab = folder / "vocab.txt"
    vocab.write_text("\n".join(vocabulary(dims["vocab_size"])) + "\n")
    BertTokenizerFast(vocab_file=str(vocab), do_lower_case=True,
                      model_max_length=512).save_pretrained(str(folder))
    torch.manual_seed(0)
    cfg = BertConfig(**dims, max_position_embeddings=512, torchscript=torchscript)
    module = BertModel(cfg).eval()
    module.save_pretrained(str(folder))
    return module


def embedding(module: Any, ids: np.ndarray, pooling: str = "mean",
              normalize: bool = True) -> np.ndarray:
    """The model run in-process on one request's rows, unpadded, its last hidden state
    pooled over the (all-ones) mask and L2-normalized: what a text model answers."""
    import torch

    with torch.inference_mode():
        hidden = module(torch.from_numpy(ids), torch.ones_like(torch.from_numpy(ids)))[0]
    vec = {"mean": hidden.mean(1), "cls": hidden[:, 0], "last": hidden[:, -1]}[pooling]
    if normalize:
        vec = torch.nn.functional.normalize(vec, dim=1)
    return vec.numpy()
