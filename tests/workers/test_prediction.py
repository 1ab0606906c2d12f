"""The first prediction of a version's memory, as the broker makes it before anything
was measured (the weights its files hold, the files its format maps, the first
activations guess, its format's runtime where the worker has not loaded that), against
what a real worker process measures loading it after warm-up (its resident bytes and the
peak of a real batch at the model's largest batch size): within ±30 % for the
bundled mlp and cnn and a BERT-mini, as TorchScript, exported program and (the BERT)
AOTInductor package, loaded one after the other as a worker serving them would (the
first exported program brings torch.export's runtime in). On a CPU: a GPU's is in
tests/workers/test_memplan.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.bench.bench_memory_plan import build_forms, cold_and_measured, run_worker

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

TOLERANCE = 0.30


def test_the_first_prediction_of_each_model_and_format_is_within_30_percent(
        tmp_path: Path) -> None:
    repo = tmp_path / "models"
    subprocess.run([sys.executable, "-m", "zeroserve.models.examples", str(repo)],
                   check=True, capture_output=True, timeout=120)
    names = build_forms(repo, compiled=True)
    assert names == ["mlp", "cnn", "mlp_export", "cnn_export", "bert", "bert_export",
                     "bert_aoti"]
    out = run_worker(repo, "cpu", names)
    assert out["models"]["mlp_export"]["runtime_bytes"] > 50e6, \
        "the first exported program brought torch.export's runtime in"
    assert out["models"]["bert_aoti"]["runtime_bytes"] == 0, "an AOTI package shares it"
    rows, wrong = compare(repo, names, out)
    if wrong:
        # what a worker measures is its resident set, which a busy host's timing moves
        # (cnn -31 % beside a concurrent benchmark, -12 % alone): a fresh worker measures
        # again, and only an error both show counts (the prediction, from the files, is the same)
        again, wrong_again = compare(repo, names, run_worker(repo, "cpu", names))
        rows += ["measured again:", *again]
        wrong = [name for name in wrong if name in wrong_again]
    print("\n".join(rows))   # pytest -s: the table docs/memory.md quotes
    assert not wrong, "\n".join(rows)


def compare(repo: Path, names: list[str], out: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Each model's row of predicted against measured, and the models out of the band."""
    rows, wrong = [], []
    for name in names:
        cold, reported, measured = cold_and_measured(repo, name, out, "cpu")
        error = (cold - measured) / measured
        rows.append(f"{name}: predicted {cold / 1e6:.1f} MB, measured {measured / 1e6:.1f} MB "
                    f"({100 * error:+.0f}%); the worker's warm-up fit "
                    f"{reported / 1e6:.1f} MB ({100 * (cold - reported) / reported:+.0f}%)")
        if abs(error) > TOLERANCE:
            wrong.append(name)
    return rows, wrong
