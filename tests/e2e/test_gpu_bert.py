"""BERT end to end on a GPU worker: ``transformers``' BertModel (random weights) as
TorchScript, padded and not, served by ``zeroserve serve`` whose worker runs on CUDA; mixed
lengths at once over HTTP, each answer equal to the model run in-process on the CPU on
that request alone, and the padded model batching mixed lengths. Skipped without a CUDA
device (the same path on the CPU is tests/e2e/test_variable_length.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import warnings
from typing import Any, Iterator

import numpy as np
import pytest

from tests import bert
from tests.conftest import Server, short_tmpdir
from tests.e2e.test_variable_length import over_http, requests, stats
from zeroserve.broker.client import Client

pytest.importorskip("transformers")

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]
# GPU kernels sum in another order than the CPU's: the same model agrees to this
ATOL = 2e-3


@pytest.fixture(scope="module")
def srv() -> Iterator[tuple[Server, Any]]:
    probe = subprocess.run([sys.executable, "-c",
                            "import torch; print(torch.cuda.is_available())"],
                           capture_output=True, text=True, timeout=120)
    if probe.stdout.strip() != "True":
        pytest.skip("needs a CUDA device")
    with warnings.catch_warnings():   # transformers' and the tracer's, not ours
        warnings.simplefilter("ignore")
        module = bert.model()
        root = short_tmpdir("zsgbert")
        for name, padding in (("ts", None), ("ts_pad", bert.PADDING)):
            bert.write(root, name, module, padding=padding, max_queue_delay_ms=20)
    server = Server(root, workers=1)
    try:
        yield server.wait_ready(300), module
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


def test_bert_answers_on_the_gpu_equal_bert_in_process(srv: tuple[Server, Any]) -> None:
    server, module = srv
    with Client(server.control, timeout_s=10) as c:
        (worker,) = c.control("status")["workers"]
    assert worker["device"].startswith("cuda"), worker
    before = stats(server, "ts_pad")
    reqs = requests(48)
    for model in ("ts", "ts_pad"):
        got = over_http(server, model, reqs)
        for req, out in zip(reqs, got):
            hidden, pooled = bert.expected(module, req["input_ids"], req["attention_mask"])
            assert out["last_hidden_state"].shape == hidden.shape
            np.testing.assert_allclose(out["last_hidden_state"], hidden, atol=ATOL)
            np.testing.assert_allclose(out["pooler_output"], pooled, atol=ATOL)
    inferences, executions = (a - b for a, b in zip(stats(server, "ts_pad"), before))
    assert inferences == len(reqs) and executions < inferences, (inferences, executions)
