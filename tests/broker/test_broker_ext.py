"""The broker's side of the v2 extensions with real sockets and real files, workers
played by DEALER sockets (tests/broker/test_lifecycle.py's): the ``logging`` verb
reaches every worker, and workers that join later, and ``log_settings`` reads the
broker's with their version; ``models`` lists optional models,
failed first loads included, and forgets the failure of a folder that is gone;
``metadata`` carries the labels read at commit; model statistics count what ran."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Iterator

import pytest
import zmq

from zeroserve.broker import protocol as p
from zeroserve.broker.client import Client, InferError
from zeroserve.broker.server.broker import Broker
from zeroserve.broker.server.stats import ModelStatistics
from zeroserve.broker.server.lifecycle import LifecycleOptions
from zeroserve.models.repository import version_sha256
from tests.broker.test_lifecycle import OPEN, FakeWorker, broker, control, write_version
from tests.broker.running import broker_in_thread
from tests.conftest import linear_config, short_tmpdir, wait_for

__all__ = ["broker"]  # the fixture, shared with test_lifecycle

pytestmark = pytest.mark.timeout(60)


def call(b: Any, verb: str, **args: Any) -> Any:
    with Client(b.endpoints.control, timeout_s=5) as c:
        return c.control(verb, **args)


def test_log_settings_reach_every_worker_and_later_joiners(broker) -> None:
    b, repo, ctx = broker
    w0 = FakeWorker(ctx, b.endpoints.backend, "host/0")
    w0.expect(p.Kind.LOAD)
    first = call(b, "log_settings")
    got = call(b, "logging", settings={"log_verbose_level": 1, "log_format": "ISO8601"})
    assert got["settings"]["log_verbose_level"] == 1 and got["settings"]["log_format"] == \
        "ISO8601"
    # what every gateway reads (read-only, so on the frontend too) and follows: each
    # change another version
    with Client(b.endpoints.frontend, timeout_s=5) as c:
        assert c.control("log_settings") == got and got["version"] != first["version"]
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


@pytest.fixture
def explicit() -> Iterator[tuple[Broker, Path, zmq.Context[Any]]]:
    """A broker under explicit model control: ``m`` loaded at start, ``n`` only there."""
    repo = short_tmpdir("zsrepo")
    for name in ("m", "n"):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.pt").write_bytes(f"weights of {name}".encode())
        (repo / name / "config.json").write_text(json.dumps(linear_config(name)))
    explicit = LifecycleOptions(control_mode="explicit", load_models=("m",))
    with broker_in_thread(repo, explicit) as (b, ctx):
        yield b, repo, ctx
        while OPEN:
            OPEN.pop().close(linger=0)
    shutil.rmtree(repo, ignore_errors=True)


def outcome(b: Broker, token: str) -> dict[str, Any]:
    """The load's status once it is no longer loading (reported once by the broker)."""
    def ended() -> dict[str, Any] | None:
        status = call(b, "repository_load_status", token=token)
        return status if status["state"] != "loading" else None
    return wait_for(ended, 10, "the load to end")  # type: ignore[no-any-return]


def index(b: Broker) -> dict[str, tuple[str, str]]:
    return {e["name"]: (e["state"], e["reason"]) for e in call(b, "repository_index")}


def test_explicit_control_loads_what_is_asked_for(explicit) -> None:
    b, repo, ctx = explicit
    w0 = FakeWorker(ctx, b.endpoints.backend, "host/0")
    first = w0.expect(p.Kind.LOAD)
    assert first["model"] == "m", "only --load-model's model loads at start"
    w0.loaded(first)
    wait_for(lambda: index(b)["m"][0] == "READY", 10, "m ready")
    assert index(b)["n"] == ("UNAVAILABLE", "not loaded")
    assert list(call(b, "models")["models"]) == ["m"]
    b.request_reload()   # SIGHUP rescans only the models asked for
    job = call(b, "repository_load", model="n")
    assert call(b, "repository_load_status", token=job["token"])["state"] == "loading"
    load = w0.expect(p.Kind.LOAD)
    assert load["model"] == "n"
    assert index(b)["n"][0] == "LOADING"
    w0.loaded(load)
    assert outcome(b, job["token"]) == {"state": "ready", "model": "n", "error": ""}
    assert index(b)["n"] == ("READY", "")
    job = call(b, "repository_load", model="n", config=json.dumps(linear_config("n", mbs=2)))
    w0.loaded(w0.expect(p.Kind.LOAD), ok=False, error="no such luck")
    failed = outcome(b, job["token"])
    assert failed["state"] == "failed" and failed["error"].startswith("failed to load 'n'")
    assert "no such luck" in failed["error"]
    assert call(b, "config", model="n")["max_batch_size"] == 8, "the failure flipped nothing"
    call(b, "repository_unload", model="n")
    assert w0.expect(p.Kind.UNLOAD)["model"] == "n"
    assert index(b)["n"] == ("UNAVAILABLE", "unloaded")
    with pytest.raises(InferError, match="failed to load 'n'.*Expecting"):
        call(b, "repository_load", model="n", config="{broken")
    with pytest.raises(InferError, match="failed to load 'zz'"):
        call(b, "repository_load", model="zz")


def test_explicit_control_swaps_in_a_config_written_over_the_api(explicit) -> None:
    """No watcher under explicit control: the folder the config writer published reaches
    the lifecycle through its outbox (lifecycle.Rescans), drained in the same loop turn,
    and a field that needs a reload swaps in on the worker."""
    b, repo, ctx = explicit
    w0 = FakeWorker(ctx, b.endpoints.backend, "host/0")
    w0.loaded(w0.expect(p.Kind.LOAD))
    wait_for(lambda: index(b)["m"][0] == "READY", 10, "m ready")
    call(b, "configure", model="m", changes={"max_batch_size": 2})
    load = w0.expect(p.Kind.LOAD)
    assert (load["model"], load["config"]["max_batch_size"]) == ("m", 2)
    w0.loaded(load)
    wait_for(lambda: call(b, "config", model="m")["max_batch_size"] == 2, 10,
             "the new config committed")
