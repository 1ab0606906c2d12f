"""One real ``zeroserve serve`` (two workers) shared by the gateway's e2e tests."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any, Iterator

import pytest

from zeroserve.broker.client import Client
from tests.conftest import Server, http, linear_config, short_tmpdir, wait_for, write_model

MAX_BODY_BYTES = 200_000


def elementwise_config(name: str, datatype: str, n: int = 4) -> dict[str, Any]:
    return {"name": name, "platform": "pytorch_torchscript", "max_batch_size": 8,
            "inputs": [{"name": "input", "datatype": datatype, "shape": [n]}],
            "outputs": [{"name": "output", "datatype": datatype, "shape": [n]}]}


def make_repo() -> Path:
    repo = short_tmpdir("zsrepo")
    write_model(repo, "linear", 1, "nn.Linear(4, 3)")
    write_model(repo, "linear", 2, "nn.Linear(4, 3)")
    (repo / "linear" / "config.json").write_text(json.dumps(
        linear_config("linear", version_policy={"all": True})))
    write_model(repo, "half", 1, "nn.ReLU()", elementwise_config("half", "FP16"))
    write_model(repo, "bf16", 1, "nn.ReLU()", elementwise_config("bf16", "BF16"))
    write_upper(repo)
    return repo


UPPER = '''
import numpy as np


class Model:
    """BYTES in, BYTES out: each string upper-cased (a Python handler)."""

    def load(self, version_dir, device):
        pass

    def predict(self, inputs):
        text = inputs["input"]
        return {"output": np.array([t.upper() for t in text.reshape(-1)],
                                   dtype=object).reshape(text.shape)}
'''


def write_upper(repo: Path) -> None:
    (repo / "upper" / "1").mkdir(parents=True)
    (repo / "upper" / "1" / "model.py").write_text(UPPER)
    (repo / "upper" / "config.json").write_text(json.dumps({
        "name": "upper", "platform": "python", "max_batch_size": 8,
        "inputs": [{"name": "input", "datatype": "BYTES", "shape": [-1]}],
        "outputs": [{"name": "output", "datatype": "BYTES", "shape": [-1]}]}))


def queued_count(srv: Server, model: str, priority: int) -> float:
    """How many requests of ``model`` the broker queued under ``priority`` (a metric)."""
    _, _, body = http("GET", srv.url + "/metrics")
    pattern = (rf'zeroserve_inference_queue_seconds_count\{{[^}}]*model="{model}"[^}}]*'
               rf'priority="{priority}"[^}}]*\}} ([0-9.e+]+)')
    found = re.search(pattern, body.decode())
    return float(found.group(1)) if found else 0.0


def _all_ready(srv: Server) -> bool:
    with Client(srv.control, timeout_s=5) as c:
        models = c.control("models")["models"]
        workers = c.control("status")["workers"]
    return (len(workers) == 2 and models["linear"]["ready"] == [1, 2]
            and all(models[m]["ready"] for m in ("half", "bf16", "upper")))


@pytest.fixture(scope="session")
def api_server() -> Iterator[Server]:
    repo = make_repo()
    srv = Server(repo, workers=2, extra=["--max-body-bytes", str(MAX_BODY_BYTES)])
    try:
        srv.wait_ready()
        wait_for(lambda: _all_ready(srv), 60, "every model on two workers")
        yield srv
    finally:
        srv.stop()
        shutil.rmtree(repo, ignore_errors=True)


@pytest.fixture(scope="module")
def client(srv: Server) -> Iterator[Any]:
    """tritonclient.http against the module's own ``srv`` (a module may define its own)."""
    import tritonclient.http as triton
    c = triton.InferenceServerClient(srv.url.removeprefix("http://"))
    yield c
    c.close()
