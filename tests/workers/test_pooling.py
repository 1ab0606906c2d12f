"""A text model's answer (workers/pooling.py, through workers/batching.py): the model's
hidden states pooled over the attention mask, normalized, one ``embedding`` a row, equal
to the model run in-process on that row alone whatever the batch padded it to. A real
BertModel (random weights, no download) as TorchScript and as a ``save_pretrained``
folder, and Python handlers, loaded in this process."""

from __future__ import annotations

import re
import textwrap
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import torch

from tests import bert
from zeroserve.broker import protocol as p
from zeroserve.models.loader import LoadedModel, load
from zeroserve.models.repository import parse_config
from zeroserve.workers import batching
from zeroserve.workers.memory import rss_bytes

pytest.importorskip("transformers")

LENGTHS = (3, 17, 9, 1, 30)


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Path]]:
    """The module traced as it is (its outputs a dict, as transformers 5 returns them
    traced) and wrapped to return a plain tuple."""
    out = {}
    with warnings.catch_warnings():   # transformers' and the tracer's, not ours
        warnings.simplefilter("ignore")
        module = bert.model()
        for kind, traced_module in (("dict", module), ("tuple", bert.Tuple(module))):
            vdir = tmp_path_factory.mktemp(kind) / "1"
            bert.save_traced(traced_module, vdir / "model.pt")
            out[kind] = module, vdir
    return out


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    vdir = tmp_path_factory.mktemp("hf") / "1"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return bert.save_pretrained(vdir), vdir


@contextmanager
def text_model(vdir: Path, platform: str, inputs: list[str] | None = None,
               **text: Any) -> Iterator[LoadedModel]:
    raw: dict[str, Any] = {"name": "emb", "platform": platform,
                           "text": {"task": "embeddings", **text},
                           "warmup": {"batch_sizes": [1, 2]}}
    if inputs is not None:
        raw["inputs"] = [{"name": n, "datatype": "INT64", "shape": [-1]} for n in inputs]
    cfg = parse_config(raw, "t")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = load(cfg, 1, vdir, "cpu", rss_bytes)
    try:
        yield loaded
    finally:
        loaded.release()


def requests(seed: int = 0, rows: int = 1) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [bert.inputs(n, bert.SMALL["vocab_size"], rng, rows) for n in LENGTHS]


def run(loaded: LoadedModel, reqs: list[dict[str, np.ndarray]]) -> list[np.ndarray]:
    items = [p.BatchItem(str(i), [p.from_numpy(k, v) for k, v in req.items()], None)
             for i, req in enumerate(reqs)]
    result = batching.run(loaded, p.Batch(1, "emb", 1, items, 0))
    assert result.error is None, result.error
    out = []
    for reply in result.replies:
        (t,) = reply.tensors
        assert (t.meta.name, t.meta.datatype) == ("embedding", "FP32")
        out.append(p.to_numpy(t))
    return out


@pytest.mark.parametrize("platform", ["dict", "tuple", "transformers"])
@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_each_row_pooled_as_alone_whatever_its_batch(
        traced: dict[str, tuple[Any, Path]], pretrained: tuple[Any, Path], platform: str,
        pooling: str) -> None:
    module, vdir = traced[platform] if platform in traced else pretrained
    platform = platform if platform == "transformers" else "pytorch_torchscript"
    with text_model(vdir, platform, pooling=pooling) as loaded:
        assert loaded.format == ("TorchScript" if platform == "pytorch_torchscript"
                                 else "transformers folder")
        reqs = requests(rows=2)
        got = run(loaded, reqs)
        alone = run(loaded, reqs[:1])
        for req, vec in zip(reqs, got):
            want = bert.embedding(module, req["input_ids"], pooling)
            assert vec.shape == (2, bert.SMALL["hidden_size"])
            np.testing.assert_allclose(vec, want, atol=1e-4)
            np.testing.assert_allclose(np.linalg.norm(vec, axis=1), 1.0, atol=1e-5)
        # the shortest row padded to 30 and not padded at all: one vector
        np.testing.assert_allclose(alone[0], got[0], atol=1e-4)


def test_unnormalized_mean_is_the_masked_mean(pretrained: tuple[Any, Path]) -> None:
    module, vdir = pretrained
    with text_model(vdir, "transformers", normalize=False) as loaded:
        reqs = requests(seed=1)
        for req, vec in zip(reqs, run(loaded, reqs)):
            np.testing.assert_allclose(
                vec, bert.embedding(module, req["input_ids"], normalize=False), atol=1e-4)


def test_a_mask_with_zeros_a_client_sent_is_honoured(pretrained: tuple[Any, Path]) -> None:
    """A client that padded its own rows: the zeros of its mask are not the row's."""
    module, vdir = pretrained
    rng = np.random.default_rng(2)
    req = bert.inputs(12, bert.SMALL["vocab_size"], rng)
    req["attention_mask"][0, 7:] = 0
    with text_model(vdir, "transformers") as loaded:
        (vec,) = run(loaded, [req])
    np.testing.assert_allclose(vec, bert.embedding(module, req["input_ids"][:, :7]),
                               atol=1e-4)


HANDLER = textwrap.dedent('''
    import torch

    class Model:
        def load(self, version_dir, device):
            torch.manual_seed(0)
            self.table = torch.randn(50, 4)

        def predict(self, inputs):
            hidden = self.table[inputs["input_ids"]]
            return {"score": hidden.sum((1, 2)), "tokens": hidden}
''')


def handler(tmp_path: Path, inputs: list[str] | None = None, **text: Any) -> Any:
    vdir = tmp_path / "1"
    vdir.mkdir(exist_ok=True)
    (vdir / "model.py").write_text(HANDLER)
    return text_model(vdir, "python", inputs, **text)


def test_a_handler_names_the_output_pooled(tmp_path: Path) -> None:
    ids = np.array([[3, 7, 1, 9]], dtype=np.int64)
    torch.manual_seed(0)
    table = torch.randn(50, 4)
    with handler(tmp_path, output="tokens", pooling="mean") as loaded:
        (vec,) = run(loaded, [{"input_ids": ids, "attention_mask": np.ones_like(ids)}])
    want = torch.nn.functional.normalize(table[torch.from_numpy(ids)].mean(1), dim=1)
    np.testing.assert_allclose(vec, want.numpy(), atol=1e-6)


@pytest.mark.parametrize("output, message", [
    ("missing", r"text\.output 'missing' is not among the model's outputs "
                r"\['score', 'tokens'\]"),
    ("score", r"must be hidden states \[rows, length, hidden\].*shape \[1\]"),
])
def test_what_cannot_be_pooled_fails_the_batch_saying_why(
        tmp_path: Path, output: str, message: str) -> None:
    ids = np.array([[3, 7, 1, 9]], dtype=np.int64)
    with handler(tmp_path, output=output) as loaded:
        items = [p.BatchItem("0", [p.from_numpy("input_ids", ids),
                                   p.from_numpy("attention_mask", np.ones_like(ids))], None)]
        result = batching.run(loaded, p.Batch(1, "emb", 1, items, 0))
    assert result.error is not None and result.replies == []
    assert re.search(message, result.error), result.error


def test_a_named_output_of_a_tuple_model_is_refused(
        traced: dict[str, tuple[Any, Path]]) -> None:
    _, vdir = traced["tuple"]
    with text_model(vdir, "pytorch_torchscript", output="last_hidden_state") as loaded:
        ids = np.array([[3, 7]], dtype=np.int64)
        items = [p.BatchItem("0", [p.from_numpy("input_ids", ids),
                                   p.from_numpy("attention_mask", np.ones_like(ids))], None)]
        result = batching.run(loaded, p.Batch(1, "emb", 1, items, 0))
    assert result.error is not None
    assert "outputs have no names: leave text.output out" in result.error


def test_a_model_without_a_mask_is_pooled_over_each_request_s_own_length(
        tmp_path: Path) -> None:
    """Padding makes the shorter row's tail [PAD] tokens, whose hidden states the model
    computes (it takes no mask): the mean leaves them out all the same."""
    torch.manual_seed(0)
    table = torch.randn(50, 4)
    short, long = (np.array([[3, 7]], dtype=np.int64),
                   np.array([[5, 2, 8, 8, 1]], dtype=np.int64))
    with handler(tmp_path, ["input_ids"], output="tokens") as loaded:
        got = run(loaded, [{"input_ids": short}, {"input_ids": long}])
    for ids, vec in zip((short, long), got):
        want = torch.nn.functional.normalize(table[torch.from_numpy(ids)].mean(1), dim=1)
        np.testing.assert_allclose(vec, want.numpy(), atol=1e-6)
