"""Text models through a real broker and worker (issue 42, the worker's half): a
``save_pretrained`` folder served as platform ``transformers`` and the same BertModel
traced to TorchScript (and exported, for one pooling), each with a ``text`` section and
nothing else declared. Token ids of mixed lengths sent at once through the direct client
batch together padded to their longest, and every ``embedding`` equals the model run
in-process on that request alone, pooled and normalized, for each pooling. A Python
handler declaring ``token_cost: "packed"`` gets the same rows packed with their offsets,
and its packed hidden states are pooled per row."""

from __future__ import annotations

import asyncio
import json
import shutil
import textwrap
import warnings
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import torch

from tests import bert
from tests.conftest import Server, http, short_tmpdir
from zeroserve.broker.client import AsyncClient

pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(300)

POOLINGS = ("mean", "cls", "last")
LENGTHS = (2, 7, 19, 4, 33, 11)
# hidden states that are a running sum of each row's token vectors, restarting at every
# row: right only where the handler read the offsets right
PACKED = textwrap.dedent('''
    import torch

    class Model:
        def load(self, version_dir, device):
            torch.manual_seed(0)
            self.table = torch.randn(1000, 8)

        def predict(self, inputs):
            ids, cu = inputs["input_ids"], inputs["cu_seqlens"]
            assert ids.shape == inputs["attention_mask"].shape == (1, int(cu[-1]))
            rows = self.table[ids[0]].split((cu[1:] - cu[:-1]).tolist())
            return {"hidden": torch.cat([h.cumsum(0) for h in rows]).unsqueeze(0)}
''')


@pytest.fixture(scope="module")
def repo() -> Iterator[tuple[Path, dict[str, Any]]]:
    """The repository, and the in-process models it was written from by kind: the
    pretrained one (answering a ModelOutput) and the traced one."""
    root = short_tmpdir("zstext")
    with warnings.catch_warnings():   # transformers' and the tracer's, not ours
        warnings.simplefilter("ignore")
        modules = {"hf": bert.save_pretrained(root / ".pretrained"), "ts": bert.model()}
        for pooling in POOLINGS:
            shutil.copytree(root / ".pretrained", root / f"hf_{pooling}" / "1")
            bert.save_traced(modules["ts"], root / f"ts_{pooling}" / "1" / "model.pt")
            for kind, platform in (("hf", "transformers"), ("ts", "pytorch_torchscript")):
                (root / f"{kind}_{pooling}" / "config.json").write_text(json.dumps(
                    {"platform": platform,
                     "text": {"task": "embeddings", "pooling": pooling},
                     # a window wide enough that the requests sent at once share batches
                     "dynamic_batching": {"max_queue_delay_ms": 50}}))
        # exported as a plain tuple (a ModelOutput only loads where transformers is)
        modules["exp"] = modules["ts"]
        bert.save_exported(modules["ts"], root / "exp_mean" / "1" / "model.pt2", 64)
        (root / "exp_mean" / "config.json").write_text(json.dumps(
            {"platform": "pytorch_export", "text": {"task": "embeddings"},
             "dynamic_batching": {"max_queue_delay_ms": 50}}))
        (root / "packed" / "1").mkdir(parents=True)
        (root / "packed" / "1" / "model.py").write_text(PACKED)
        (root / "packed" / "config.json").write_text(json.dumps(
            {"platform": "python", "text": {"task": "embeddings"},
             "dynamic_batching": {"max_queue_delay_ms": 50, "token_cost": "packed"}}))
    yield root, modules
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def srv(repo: tuple[Path, dict[str, Any]]) -> Iterator[Server]:
    server = Server(repo[0], workers=1)
    try:
        yield server.wait_ready(180)
    finally:
        server.stop()


async def embed_all(srv: Server, model: str, reqs: list[np.ndarray]
                    ) -> list[tuple[np.ndarray, float]]:
    async with AsyncClient(srv.frontend) as client:
        assert await client.wait_connected(10), "the broker does not answer"
        results = await asyncio.gather(*(
            client.infer(model, {"input_ids": ids, "attention_mask": np.ones_like(ids)},
                         timeout_ms=60000) for ids in reqs))
    return [(r.outputs["embedding"], r.stats.get("batch_size", 0.0)) for r in results]


@pytest.mark.parametrize("kind, pooling", [(kind, pooling) for kind in ("hf", "ts")
                                           for pooling in POOLINGS] + [("exp", "mean")])
def test_every_vector_is_the_model_run_alone(srv: Server, repo: tuple[Path, dict[str, Any]],
                                             kind: str, pooling: str) -> None:
    modules = repo[1]
    rng = np.random.default_rng(len(pooling))
    reqs = [bert.inputs(LENGTHS[i % len(LENGTHS)], bert.SMALL["vocab_size"], rng)
            ["input_ids"] for i in range(24)]
    got = asyncio.run(embed_all(srv, f"{kind}_{pooling}", reqs))
    for ids, (vec, _) in zip(reqs, got):
        assert vec.dtype == np.float32 and vec.shape == (1, bert.SMALL["hidden_size"])
        np.testing.assert_allclose(vec, bert.embedding(modules[kind], ids, pooling),
                                   atol=1e-4)
    # lengths from 2 to 33 shared batches: each was padded, and its vector did not move
    assert max(size for _, size in got) > 1, got


def test_a_packed_handler_s_rows_are_pooled_each_on_its_own(srv: Server) -> None:
    rng = np.random.default_rng(7)
    reqs = [bert.inputs(LENGTHS[i % len(LENGTHS)], 1000, rng)["input_ids"]
            for i in range(24)]
    got = asyncio.run(embed_all(srv, "packed", reqs))
    torch.manual_seed(0)
    table = torch.randn(1000, 8)
    for ids, (vec, _) in zip(reqs, got):
        want = torch.nn.functional.normalize(table[torch.from_numpy(ids)].cumsum(1).mean(1))
        np.testing.assert_allclose(vec, want.numpy(), atol=1e-5)
    assert max(size for _, size in got) > 1, got


def test_the_metadata_gives_a_pretrained_folder_s_width(srv: Server) -> None:
    status, _, body = http("GET", f"{srv.url}/v2/models/hf_mean")
    assert status == 200, body
    assert json.loads(body)["outputs"] == [
        {"name": "embedding", "datatype": "FP32", "shape": [-1, bert.SMALL["hidden_size"]]}]
