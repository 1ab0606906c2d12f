"""Triton's trace extension through real processes: ``zeroserve serve`` with a trace file
(``--trace-config``), settings changed at run time with tritonclient, requests over HTTP
gRPC and the direct client with a W3C ``traceparent``; each trace record has every timestamp,
in order, agreeing with the answer's own stats; sampling by rate, by the caller's
sampled flag, and capped by the count."""

from __future__ import annotations

import glob
import json
import shutil
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import Server, linear_config, short_tmpdir, wait_for, write_model
from zeroserve.broker.client import Client

pytestmark = pytest.mark.timeout(180)

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
UNSAMPLED = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"
ORDER = ["HTTP_RECV_START", "HTTP_RECV_END", "REQUEST_START", "QUEUE_START", "COMPUTE_START",
         "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START", "COMPUTE_END", "REQUEST_END",
         "HTTP_SEND_START", "HTTP_SEND_END"]
CORE = ORDER[2:-2]
X = np.ones((1, 4), np.float32)


class World:
    def __init__(self) -> None:
        self.repo = short_tmpdir("zsrepo")
        write_model(self.repo, "linear", 1, "nn.Linear(4, 3)", linear_config("linear"))
        self.traces = short_tmpdir("zstrace")
        self.file = self.traces / "trace.json"
        self.server = Server(self.repo, extra=[
            "--trace-config", f"triton,file={self.file}", "--trace-config",
            "triton,log-frequency=1", "--trace-config", "rate=1000"]).wait_ready()
        self.triton = httpclient.InferenceServerClient(f"127.0.0.1:{self.server.port}")

    def files(self) -> list[str]:
        return sorted(glob.glob(f"{self.file}.*"), key=lambda f: int(f.rsplit(".", 1)[1]))

    def new_traces(self, before: int, expect: int) -> list[list[dict[str, Any]]]:
        """The records of the trace files written after the first ``before``."""
        wait_for(lambda: len(self.files()) >= before + expect, 10, f"{expect} trace files")
        return [json.loads(Path(f).read_text()) for f in self.files()[before:]]

    def http_infer(self, headers: dict[str, str] | None = None) -> None:
        x = httpclient.InferInput("input", [1, 4], "FP32")
        x.set_data_from_numpy(X)
        self.triton.infer("linear", [x], headers=headers or {})

    def close(self) -> None:
        self.triton.close()
        self.server.stop()
        shutil.rmtree(self.repo, ignore_errors=True)
        shutil.rmtree(self.traces, ignore_errors=True)


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    w = World()
    yield w
    w.close()


@pytest.fixture
def traced(world: World) -> Iterator[World]:
    world.triton.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"],
                                                 "trace_rate": "1000", "trace_count": "-1"})
    yield world
    world.triton.update_trace_settings(settings={"trace_level": ["OFF"]})
    world.triton.update_trace_settings("linear", {"trace_level": None, "trace_rate": None,
                                                  "trace_count": None})


def stamps(records: list[dict[str, Any]]) -> list[tuple[str, int]]:
    return [(t["name"], t["ns"]) for r in records for t in r.get("timestamps", ())]


def in_order(records: list[dict[str, Any]], names: list[str]) -> dict[str, int]:
    got = stamps(records)
    assert [n for n, _ in got] == names, got
    values = [v for _, v in got]
    assert values == sorted(values), got
    return dict(got)


def test_settings_change_at_run_time_through_tritonclient(world: World) -> None:
    t = world.triton
    assert t.get_trace_settings() == {
        "trace_level": ["OFF"], "trace_rate": "1000", "trace_count": "-1",
        "log_frequency": "1", "trace_file": str(world.file), "trace_mode": "triton"}
    assert "trace" in t.get_server_metadata()["extensions"]
    got = t.update_trace_settings("linear", {"trace_level": ["TIMESTAMPS", "TENSORS"],
                                             "trace_rate": "5"})
    assert got["trace_level"] == ["TIMESTAMPS", "TENSORS"] and got["trace_rate"] == "5"
    t.update_trace_settings(settings={"trace_rate": "7", "trace_count": "20"})
    model = t.get_trace_settings("linear")   # its own rate; the count follows the global
    assert (model["trace_rate"], model["trace_count"]) == ("5", "20")
    t.update_trace_settings("linear", {"trace_rate": None})   # null: the global's again
    assert t.get_trace_settings("linear")["trace_rate"] == "7"
    t.update_trace_settings("linear", {"trace_level": None})
    assert t.get_trace_settings("linear") == t.get_trace_settings()
    for model, body, why in [(None, {"trace_file": "/etc/x"}, "can not be updated"),
                             (None, {"trace_level": ["LOUD"]}, "unknown trace level"),
                             (None, {"trace_level": ["OFF", "TENSORS"]}, "only one"),
                             (None, {"trace_rate": "-1"}, "out of range"),
                             (None, {"trace_count": "many"}, "Unable to parse"),
                             (None, {"colour": "1"}, "unknown trace setting"),
                             ("nope", {}, "unknown model")]:
        with pytest.raises(InferenceServerException, match=why):
            t.update_trace_settings(model, body)
    t.update_trace_settings(settings={"trace_rate": "1000", "trace_count": "-1"})
    assert t.get_trace_settings()["trace_level"] == ["OFF"]


def test_an_http_request_with_traceparent_has_every_timestamp_in_order(traced: World) -> None:
    stats = traced.triton.get_inference_statistics("linear")["model_stats"][0]
    before = len(traced.files())
    traced.http_infer({"traceparent": TRACEPARENT})   # rate 1000: the caller's flag decides
    (records,) = traced.new_traces(before, 1)
    head = records[0]
    assert (head["model_name"], head["model_version"]) == ("linear", 1)
    assert head["traceparent"] == TRACEPARENT
    assert len({r["id"] for r in records}) == 1
    at = in_order(records, ORDER)
    # the statistics extension counts the same request: its phases are these stamps'
    after = traced.triton.get_inference_statistics("linear")["model_stats"][0]

    def delta(key: str) -> int:
        return int(after["inference_stats"][key]["ns"]) - \
            int(stats["inference_stats"][key]["ns"])
    assert abs(delta("compute_input") - (at["COMPUTE_INPUT_END"] - at["COMPUTE_START"])) < 5_000
    assert abs(delta("compute_infer") - (at["COMPUTE_OUTPUT_START"] -
                                         at["COMPUTE_INPUT_END"])) < 5_000
    # queued until sent; the worker starts after the batch's trip to it
    assert 0 <= delta("queue") <= at["COMPUTE_START"] - at["QUEUE_START"]


def test_a_grpc_request_with_traceparent_has_the_grpc_stamps(traced: World) -> None:
    client = grpcclient.InferenceServerClient(traced.server.grpc_url)
    try:
        x = grpcclient.InferInput("input", [1, 4], "FP32")
        x.set_data_from_numpy(X)
        before = len(traced.files())
        client.infer("linear", [x], headers={"traceparent": TRACEPARENT})
    finally:
        client.close()
    (records,) = traced.new_traces(before, 1)
    assert records[0]["traceparent"] == TRACEPARENT
    in_order(records, ["GRPC_WAITREAD_END", *CORE, "GRPC_SEND_START", "GRPC_SEND_END"])


def test_tensors_level_adds_inputs_and_outputs(traced: World) -> None:
    traced.triton.update_trace_settings("linear", {"trace_level": ["TIMESTAMPS", "TENSORS"]})
    before = len(traced.files())
    traced.http_infer({"traceparent": TRACEPARENT})
    (records,) = traced.new_traces(before, 1)
    tensors = {r["activity"]: r["tensor"] for r in records if "activity" in r}
    assert tensors["TENSOR_QUEUE_INPUT"] == {"name": "input", "data": "1.0,1.0,1.0,1.0",
                                             "shape": "1,4", "dtype": "FP32"}
    out = tensors["TENSOR_BACKEND_OUTPUT"]
    assert (out["name"], out["shape"], out["dtype"]) == ("output", "1,3", "FP32")
    assert len(out["data"].split(",")) == 3


def test_a_direct_client_request_with_traceparent_carries_its_record(traced: World) -> None:
    with Client(traced.server.frontend) as c:
        result = c.infer("linear", {"input": X}, traceparent=TRACEPARENT)
        untraced = c.infer("linear", {"input": X})
    assert untraced.trace is None
    assert result.trace is not None and result.trace[0]["traceparent"] == TRACEPARENT
    at = in_order(result.trace, CORE)
    assert abs(result.stats["compute_ms"] * 1e6 - (at["COMPUTE_END"] - at["COMPUTE_START"])) \
        < 5_000
    assert result.stats["queue_ms"] * 1e6 <= at["COMPUTE_START"] - at["QUEUE_START"] + 5_000


def test_sampling_by_rate_by_the_callers_flag_and_capped_by_count(traced: World) -> None:
    t = traced.triton
    t.update_trace_settings(settings={"trace_rate": "0"})
    before = len(traced.files())
    for _ in range(4):
        traced.http_infer()                               # rate 0: never by rate
        traced.http_infer({"traceparent": UNSAMPLED})    # the caller said no
    traced.http_infer({"traceparent": TRACEPARENT})      # the caller said yes
    assert len(traced.new_traces(before, 1)) == 1
    t.update_trace_settings(settings={"trace_rate": "3"})
    before = len(traced.files())
    for _ in range(9):
        traced.http_infer()
    got = traced.new_traces(before, 3)
    assert len(got) == 3 and all(r[0]["traceparent"].endswith("-01") for r in got)
    t.update_trace_settings("linear", {"trace_rate": "1", "trace_count": "2"})
    before = len(traced.files())
    for _ in range(5):
        traced.http_infer()
    assert len(traced.new_traces(before, 2)) == 2
    assert t.get_trace_settings("linear")["trace_count"] == "0"
    assert len(traced.files()) == before + 2
