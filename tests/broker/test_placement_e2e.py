"""Memory planning in a real server: a version the worker's device cannot hold after its
headroom is refused before any load, with the device and the bytes in the message; what
fits loads, and `zeroserve status` and the metrics show its predicted and measured
footprint."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from tests.conftest import ZEROSERVE, Server, http, linear_config, short_tmpdir, wait_for, \
    write_model
from zeroserve.broker.client import Client
from zeroserve.broker.runtime import hostname
from zeroserve.models.archives import graph_bytes
from zeroserve.models.footprint import ACTIVATION_FACTOR
from zeroserve.models.formats import TORCHSCRIPT_GRAPH_FACTOR

pytestmark = pytest.mark.timeout(120)

BUDGET, HEADROOM = 60_000_000, 30_000_000
BIG_WEIGHTS = (2048 * 4096 + 4096) * 4          # 33.6 MB: fits the budget, not the headroom


@pytest.fixture
def repo() -> Iterator[Path]:
    repo = short_tmpdir("zsrepo")
    write_model(repo, "small", 1, "nn.Linear(64, 64)", linear_config("small", 64, 64))
    write_model(repo, "big", 1, "nn.Linear(2048, 4096)", linear_config("big", 2048, 4096))
    yield repo
    shutil.rmtree(repo, ignore_errors=True)


def control(srv: Server, verb: str) -> Any:
    with Client(srv.control, timeout_s=10) as c:
        return c.control(verb)


def test_a_load_past_the_headroom_is_refused_before_loading_and_named(
        repo: Path, serve: Callable[..., Server]) -> None:
    srv = serve(repo, extra=["--memory-budget", str(BUDGET), "--memory-headroom",
                             str(HEADROOM), "--readiness", "any"])
    wid = f"{hostname()}/0"
    why = wait_for(lambda: control(srv, "models")["errors"].get("big"), 30, "big refused")
    plan = control(srv, "status")["memory_plan"][wid]
    context = plan["context_bytes"]
    assert 0 < context < BUDGET - BIG_WEIGHTS - 1_000_000, "it would fit without the headroom"
    assert why.startswith(f"cpu on worker {wid} (memory budget 60.0 MB, "
                          f"{context / 1e6:.1f} MB context) has "), why
    assert ("free after 30.0 MB headroom; big/1 needs 35.7 MB (predicted: 33.6 MB weights + "
            "0.1 MB overhead + "
            "2.1 MB activations at batch 8 (first guesses from the files and inputs)") in why, why
    assert "loaded big/1" not in srv.log(), "a refused version is never sent to the worker"
    wait_for(lambda: control(srv, "models")["models"]["small"]["ready"] == [1], 30, "small")
    entry = wait_for(lambda: control(srv, "status")["memory_plan"][wid]["models"]
                     .get("small/1", {}).get("measured_bytes"), 10, "small measured")
    small = control(srv, "status")["memory_plan"][wid]["models"]["small/1"]
    assert small["weights_bytes"] == (64 * 64 + 64) * 4
    overhead = TORCHSCRIPT_GRAPH_FACTOR * (graph_bytes(repo / "small" / "1" / "model.pt") or 0)
    assert small["predicted_bytes"] == small["weights_bytes"] + overhead \
        + ACTIVATION_FACTOR * 64 * 4 * 8
    assert small["measured_bytes"] == entry and "error_pct" in small
    out = subprocess.run([*ZEROSERVE, "status", "--runtime-dir", str(srv.runtime)],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if line.startswith(wid + " ")
               and "small/1" in line and "%" in line)
    assert " cpu " in row and f"{HEADROOM / 1e6:.1f}" in row, out.stdout
    print("\n" + out.stdout)
    status_code, _, body = http("GET", srv.url + "/metrics")
    text = body.decode()
    assert status_code == 200
    assert 'zeroserve_memory_refusals_total{' in text and 'model="big"' in text
    assert 'zeroserve_model_memory_predicted_bytes{' in text
    assert 'zeroserve_model_memory_measured_bytes{' in text
    json.dumps(plan)  # plain JSON all the way down
