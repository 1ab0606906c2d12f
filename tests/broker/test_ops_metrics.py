"""The series the alert rules need (deploy/prometheus): worker restarts, losses and
recycles counted per worker id, each model's readiness and queue-time SLO read from the
catalog at scrape time."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from zeroserve.broker.server.catalog import Catalog
from zeroserve.broker.server.metrics import BrokerMetrics, ModelStates
from tests.conftest import linear_config, short_tmpdir


def samples(m: BrokerMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(m.render()) for s in f.samples
            if not s.name.endswith("_created")}


def test_a_worker_counts_restarts_from_its_second_registration() -> None:
    m = BrokerMetrics()
    m.worker_registered("h/0")
    got = samples(m)
    # the first start creates both series at 0, so increase() sees the first restart
    assert got[("zeroserve_worker_restarts_total", (("worker", "h/0"),))] == 0
    assert got[("zeroserve_worker_recycles_total", (("worker", "h/0"),))] == 0
    m.worker_lost("h/0", "crashed")
    m.worker_registered("h/0")
    m.worker_registered("h/1")
    m.worker_recycled("h/0")
    got = samples(m)
    assert got[("zeroserve_worker_restarts_total", (("worker", "h/0"),))] == 1
    assert got[("zeroserve_worker_restarts_total", (("worker", "h/1"),))] == 0
    assert got[("zeroserve_worker_losses_total", (("reason", "crashed"), ("worker", "h/0")))] == 1
    assert got[("zeroserve_worker_recycles_total", (("worker", "h/0"),))] == 1


@pytest.fixture
def repo() -> Iterator[Path]:
    folder = short_tmpdir("zsrepo")
    for name, extra in (("fast", {}), ("tight", {"autoscaling": {"queue_slo_ms": 250}})):
        (folder / name / "1").mkdir(parents=True)
        (folder / name / "1" / "model.pt").write_bytes(b"")  # the catalog reads configs only
        (folder / name / "config.json").write_text(json.dumps({**linear_config(name), **extra}))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_models_report_readiness_and_their_slo_at_each_scrape(repo: Path) -> None:
    catalog = Catalog(repo)
    m = BrokerMetrics()
    m.registry.register(ModelStates(catalog))
    assert not any(n.startswith("zeroserve_model_ready") for n, _ in samples(m))
    catalog.rescan()   # read when scraped: models the catalog gains show at once
    got = samples(m)
    assert got[("zeroserve_model_ready", (("model", "fast"),))] == 0  # loaded nowhere yet
    assert got[("zeroserve_model_queue_slo_seconds", (("model", "fast"),))] == 0.1
    assert got[("zeroserve_model_queue_slo_seconds", (("model", "tight"),))] == 0.25
