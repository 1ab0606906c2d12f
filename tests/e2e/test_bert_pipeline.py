"""A real transformer as an ensemble step (issue 31): a Python step makes BERT's inputs
from raw token ids of mixed lengths, ``transformers``' BertModel (random weights,
traced, padded) runs them, and every answer over tritonclient.http equals the model
run in-process on that request alone."""

from __future__ import annotations

import json
import shutil
import warnings
from typing import Any, Iterator

import numpy as np
import pytest

from tests import bert
from tests.conftest import Server, short_tmpdir

pytest.importorskip("transformers")
th = pytest.importorskip("tritonclient.http")

pytestmark = pytest.mark.timeout(600)

LENGTHS = (5, 12, 31)
VOCAB = bert.SMALL["vocab_size"]
# the ids folded into the vocabulary, and a mask of ones: what a tokenizer step hands on
TOK = f'''
import torch


class Model:
    def load(self, version_dir, device):
        pass

    def predict(self, inputs):
        ids = inputs["ids"] % {VOCAB}
        return {{"input_ids": ids, "attention_mask": torch.ones_like(ids)}}
'''


def seq(name: str) -> dict[str, Any]:
    return {"name": name, "datatype": "INT64", "shape": [-1]}


@pytest.fixture(scope="module")
def module() -> Any:
    with warnings.catch_warnings():   # transformers' and the tracer's, not ours
        warnings.simplefilter("ignore")
        return bert.model()


@pytest.fixture(scope="module")
def srv(module: Any) -> Iterator[Server]:
    repo = short_tmpdir("zsrepo")
    hidden = bert.SMALL["hidden_size"]
    (repo / "tok" / "1").mkdir(parents=True)
    (repo / "tok" / "1" / "model.py").write_text(TOK)
    (repo / "tok" / "config.json").write_text(json.dumps({
        "name": "tok", "platform": "python", "max_batch_size": 16,
        "inputs": [seq("ids")], "outputs": [seq("input_ids"), seq("attention_mask")],
        "dynamic_batching": {"max_queue_delay_ms": 2}}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bert.write(repo, "bert", module, padding=bert.PADDING, max_queue_delay_ms=5)
    outs = {"last_hidden_state": "HIDDEN", "pooler_output": "POOLED"}
    (repo / "pipe" / "1").mkdir(parents=True)
    (repo / "pipe" / "config.json").write_text(json.dumps({
        "name": "pipe", "platform": "ensemble", "max_batch_size": 16,
        "inputs": [seq("ids")],
        "outputs": [{"name": "HIDDEN", "datatype": "FP32", "shape": [-1, hidden]},
                    {"name": "POOLED", "datatype": "FP32", "shape": [hidden]}],
        "ensemble_scheduling": {"step": [
            {"model_name": "tok", "model_version": -1, "input_map": {"ids": "ids"},
             "output_map": {"input_ids": "t_ids", "attention_mask": "t_mask"}},
            {"model_name": "bert", "model_version": -1,
             "input_map": {"input_ids": "t_ids", "attention_mask": "t_mask"},
             "output_map": outs}]}}))
    server = Server(repo, workers=1)
    try:
        yield server.wait_ready(180)
    finally:
        server.stop()
        shutil.rmtree(repo, ignore_errors=True)


def test_mixed_lengths_through_a_bert_pipeline_equal_bert_in_process(srv: Server,
                                                                     module: Any) -> None:
    rng = np.random.default_rng(3)
    raw = [rng.integers(0, 10 * VOCAB, (1, LENGTHS[i % len(LENGTHS)]), dtype=np.int64)
           for i in range(24)]
    client = th.InferenceServerClient(srv.url.removeprefix("http://"), concurrency=len(raw))
    try:
        pending = [client.async_infer("pipe", [th.InferInput("ids", list(r.shape), "INT64")
                                               .set_data_from_numpy(r, binary_data=True)])
                   for r in raw]
        results = [p.get_result() for p in pending]
    finally:
        client.close()
    for r, res in zip(raw, results):
        ids = r % VOCAB
        hidden, pooled = bert.expected(module, ids, np.ones_like(ids))
        assert res.as_numpy("HIDDEN").shape == hidden.shape
        np.testing.assert_allclose(res.as_numpy("HIDDEN"), hidden, atol=1e-4)
        np.testing.assert_allclose(res.as_numpy("POOLED"), pooled, atol=1e-4)
