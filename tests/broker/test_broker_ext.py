"""The broker's side of the v2 extensions with real sockets and real files, workers
played by DEALER sockets (tests/broker/test_lifecycle.py's): the ``logging`` verb
reaches every worker, and workers that join later; ``models`` lists optional models,
failed first loads included, and forgets the failure of a folder that is gone;
``metadata`` carries the labels read at commit; model statistics count what ran."""

from __future__ import annotations

import json
import shutil
from typing import Any

import pytest
from zeroserve.broker import protocol as p
from zeroserve.broker.client import Client, InferError
from zeroserve.broker.server.stats import ModelStatistics
from zeroserve.models.repository import version_sha256
from tests.broker.test_lifecycle import FakeWorker, broker, control, write_version
from tests.conftest import linear_config, wait_for

__all__ = ["broker"]  # the fixture, shared with test_lifecycle

pytestmark = pytest.mark.timeout(60)


def call(b: Any, verb: str, **args: Any) -> Any:
    with Client(b.endpoints.control, timeout_s=5) as c:
        return c.control(verb, **args)


def test_log_settings_reach_every_worker_and_later_joiners(broker) -> None:
    b, repo, ctx = broker
    w0 = FakeWorker(ctx, b.endpoints.backend, "host/0")
    w0.expect(p.Kind.LOAD)
    got = call(b, "logging", settings={"log_verbose_level": 1, "log_format": "ISO8601"})
    assert got["log_verbose_level"] == 1 and got["log_format"] == "ISO8601"
    header = w0.expect(p.Kind.LOG_SETTINGS)
    assert p.decode(p.LogSettings, header).settings == {"log_verbose_level": 1,
                                                        "log_format": "ISO8601"}
    w1 = FakeWorker(ctx, b.endpoints.backend, "host/1")
    assert p.decode(p.LogSettings, w1.expect(p.Kind.LOG_SETTINGS)).settings[
        "log_format"] == "ISO8601"
    with pytest.raises(InferError, match="log_format must be one of"):
        call(b, "logging", settings={"log_format": "xml"})
    call(b, "logging", settings={"log_verbose_level": 0, "log_format": "default"})
    with Client(b.endpoints.frontend, timeout_s=5) as c, \
            pytest.raises(InferError, match="changes state"):
        c.control("logging", settings={})


def test_optional_models_and_failures_of_folders_that_are_gone(broker) -> None:
    b, repo, ctx = broker
    w0 = FakeWorker(ctx, b.endpoints.backend, "host/0")
    w0.loaded(w0.expect(p.Kind.LOAD), sha=version_sha256(repo / "m" / "1"))
    assert control(b, "models")["models"]["m"]["optional"] is False
    tmp = repo / ".tmp-n"
    (tmp / "1").mkdir(parents=True)
    (tmp / "1" / "model.pt").write_bytes(b"weights")
    (tmp / "config.json").write_text(json.dumps({**linear_config("n"), "optional": True}))
    tmp.rename(repo / "n")
    w0.loaded(w0.expect(p.Kind.LOAD), ok=False, error="bad archive")
    wait_for(lambda: "n" in control(b, "models")["errors"], 10, "n's failure to show")
    doc = control(b, "models")
    assert "n" not in doc["models"] and doc["optional"] == ["n"]
    shutil.rmtree(repo / "n")
    wait_for(lambda: "n" not in control(b, "models")["errors"], 10,
             "the failure of a removed folder to go")


def test_metadata_carries_the_labels_read_at_commit(broker) -> None:
    b, repo, ctx = broker
    w0 = FakeWorker(ctx, b.endpoints.backend, "host/0")
    w0.loaded(w0.expect(p.Kind.LOAD), sha=version_sha256(repo / "m" / "1"))
    assert call(b, "metadata", model="m")["labels"] is None
    (repo / "m" / "labels.txt").write_text("cat\ndog\nbird\n")
    write_version(repo, 2)
    w0.loaded(w0.expect(p.Kind.LOAD))
    wait_for(lambda: call(b, "models")["models"]["m"]["ready"] == [2], 10, "the swap")
    assert call(b, "metadata", model="m")["labels"] == ["cat", "dog", "bird"]


def test_statistics_count_samples_batches_and_phases() -> None:
    wall = iter([1000.0, 1001.5])
    stats = ModelStatistics(wall_clock=lambda: next(wall))
    phases = {"input": 1.0, "infer": 4.0, "output": 0.5}
    for samples in (3, 2):
        stats.batch_done("m", 1, samples, phases, 5.5)
        stats.request_done("m", 1, 0.002, 0.010, phases, 5.5)
    stats.request_failed("m", None, 0.001)
    [doc] = stats.render("m", [1], 1, {1: [{"type": "CPU", "id": 0, "byte_size": 9}]})
    assert (doc["name"], doc["version"], doc["last_inference"]) == ("m", "1", 1001500)
    assert (doc["inference_count"], doc["execution_count"]) == (5, 2)
    inf = doc["inference_stats"]
    assert inf["success"] == {"count": 2, "ns": 20_000_000}
    assert inf["fail"] == {"count": 1, "ns": 1_000_000}
    assert inf["queue"] == {"count": 2, "ns": 4_000_000}
    assert inf["compute_infer"] == {"count": 2, "ns": 8_000_000}
    assert [s["batch_size"] for s in doc["batch_stats"]] == [2, 3]
    assert doc["batch_stats"][0]["compute_input"] == {"count": 1, "ns": 1_000_000}
    assert doc["memory_usage"] == [{"type": "CPU", "id": 0, "byte_size": 9}]
    stats.forget("m")
    assert stats.render("m", [1], 1, {})[0]["execution_count"] == 0
