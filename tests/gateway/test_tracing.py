"""The trace settings, sampling and records without a server (gateway/tracing.py,
broker/tracing.py), and what an untraced request costs on the wire: nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from zeroserve.broker import protocol as p, traceconfig, tracing
from zeroserve.broker.tracesettings import TraceState
from zeroserve.gateway.tracing import Setting, TraceSettingError, TraceSettings, Tracer, \
    parse_config

TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_trace_config_reads_tritons_entries() -> None:
    setting, mode = parse_config(["rate=100", "level=TIMESTAMPS", "level=TENSORS", "count=5",
                                  "mode=triton", "triton,file=/tmp/t.json",
                                  "triton,log-frequency=50"])
    assert mode == "triton"
    assert setting == Setting(("TIMESTAMPS", "TENSORS"), 100, 5, 50, "/tmp/t.json")
    assert parse_config([]) == (Setting(), "triton")   # OFF, every 1000th, no cap
    for bad, why in [(["rate=fast"], "Unable to parse"), (["shade=1"], "unknown setting"),
                     (["jaeger,url=x"], "not supported"), (["rate"], "setting=value"),
                     (["mode=zipkin"], "must be one of"), (["level=LOUD"], "unknown"),
                     (["opentelemetry,colour=1"], "unknown opentelemetry setting"),
                     (["opentelemetry,bsp_schedule_delay=soon"], "positive integer"),
                     (["opentelemetry,resource=nameless"], "KEY=VALUE")]:
        with pytest.raises(TraceSettingError, match=why):
            parse_config(bad)


def test_a_model_keeps_what_it_set_and_follows_the_global_for_the_rest() -> None:
    s = TraceSettings(Setting(rate=10))
    assert not s.active
    s.update("m", {"trace_level": ["TIMESTAMPS"]})
    assert s.active and s.get("m")["trace_rate"] == "10"
    s.update(None, {"trace_rate": "20"})
    assert s.get("m")["trace_rate"] == "20" and s.get("m")["trace_level"] == ["TIMESTAMPS"]
    assert s.get("other")["trace_level"] == ["OFF"]
    s.update("m", {"trace_level": None})
    assert s.get("m") == s.get() and not s.active
    s.update(None, {"trace_rate": None})   # null on the global setting: the default
    assert s.get()["trace_rate"] == "1000"
    assert s.update_lists("m", {"trace_level": ["TENSORS"], "trace_count": ["3"]}) == {
        **s.get_lists(), "trace_level": ["TENSORS"], "trace_count": ["3"]}
    assert s.update_lists("m", {"trace_level": [], "trace_count": []}) == s.get_lists()


def test_a_copy_of_the_brokers_settings_restarts_only_the_entries_a_change_replaced(
        ) -> None:
    s = TraceSettings(Setting(level=("TIMESTAMPS",), rate=1, count=5, file="/here/t.json"))
    tracer = Tracer(s)
    broker = TraceState.start(Setting(level=("TIMESTAMPS",), rate=1, count=5, file="/b.json"))
    assert broker.version != TraceState.start(Setting()).version   # a restart's differ
    s.load(TraceState.from_doc(broker.to_doc()))   # as the verb answers it
    assert s.version == broker.version and s.get()["trace_file"] == "/here/t.json"
    for _ in range(2):
        assert tracer.begin("m", None) is not None
    assert s.get()["trace_count"] == "3"
    s.load(broker)   # the same version again: nothing starts afresh
    assert s.get()["trace_count"] == "3"
    broker = broker.updated("other", {"trace_rate": "2"})
    s.load(TraceState.from_doc(broker.to_doc()))
    assert s.get()["trace_count"] == "3"               # the global entry was not replaced
    assert s.get("other") == {**s.get(), "trace_rate": "2", "trace_count": "5"}
    broker = broker.updated(None, {"trace_count": "5"})
    s.load(broker)   # the global one replaced: a model following it starts afresh too
    assert s.get()["trace_count"] == s.get("other")["trace_count"] == "5"
    s.load(broker.updated("other", {"trace_rate": None}))
    assert s.get("other") == s.get()
    with pytest.raises(TraceSettingError, match="not the broker's"):
        TraceState.from_doc({"version": 1})
    with pytest.raises(TraceSettingError, match="out of range"):
        broker.updated(None, {"trace_rate": "-1"})   # validated wherever it is changed


def test_sampling_follows_the_rate_the_callers_flag_and_the_count() -> None:
    s = TraceSettings(Setting(level=("TIMESTAMPS",), rate=3, count=4))
    tracer = Tracer(s)
    picked = [tracer.begin("m", None) is not None for _ in range(9)]
    assert picked == [False, False, True] * 3
    assert tracer.begin("m", TP.replace("-01", "-00")) is None   # the caller said no
    assert tracer.begin("m", TP) is not None                     # the caller said yes
    assert tracer.begin("m", "00-zz-bad") is None   # invalid: ignored, so the rate decides
    assert s.get()["trace_count"] == "0"
    assert tracer.begin("m", TP) is None            # count spent
    fresh = Tracer(TraceSettings(Setting(level=("TIMESTAMPS",), rate=1)))
    trace = fresh.begin("m", None)
    assert trace is not None and not trace.caller   # a context of its own, sampled
    assert tracing.parse_traceparent(trace.context["traceparent"])[2]


def test_records_go_to_indexed_files_or_the_plain_file_at_the_end(tmp_path: Path) -> None:
    file = tmp_path / "t.json"
    s = TraceSettings(Setting(level=("TIMESTAMPS", "TENSORS"), rate=1, log_frequency=2,
                              file=str(file)))
    tracer = Tracer(s)
    x = p.from_numpy("input", np.arange(3, dtype=np.int32).reshape(1, 3))
    for _ in range(3):
        trace = tracer.begin("m", TP)
        assert trace is not None
        trace.stamp("HTTP_SEND_END")
        tracer.finish(trace, None, 0, 0, "r1", [x])
    assert json.loads((tmp_path / "t.json.0").read_text())[1]["id"] == 1  # 2 traces in .0
    assert not (tmp_path / "t.json.1").exists()
    tracer.close()   # the last one: its own indexed file
    last = json.loads((tmp_path / "t.json.1").read_text())
    assert last[0] == {"id": 3, "model_name": "m", "model_version": 0, "request_id": "r1",
                       "traceparent": TP}
    assert last[-1]["tensor"] == {"name": "input", "data": "0,1,2", "shape": "1,3",
                                  "dtype": "INT32"}
    plain = TraceSettings(Setting(level=("TIMESTAMPS",), rate=1, file=str(file)))
    tracer = Tracer(plain)
    for _ in range(2):
        trace = tracer.begin("m", None)
        assert trace is not None
        tracer.finish(trace, None, 0, 0)
    assert not file.exists()
    plain.update(None, {"trace_rate": "2"})   # a replaced setting writes what it holds
    trace = tracer.begin("m", None)
    trace = tracer.begin("m", None)
    assert trace is not None
    tracer.finish(trace, None, 0, 0)
    tracer.close()
    assert [r["id"] for r in json.loads(file.read_text()) if "model_name" in r] == [1, 2, 3]


def test_traceparent_is_checked_as_w3c_says() -> None:
    assert tracing.parse_traceparent(TP) == ("0af7651916cd43dd8448eb211c80319c",
                                             "b7ad6b7169203331", True)
    for bad in ["", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",
                "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
                "00-00000000000000000000000000000000-b7ad6b7169203331-01",
                "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
                TP + "-extra"]:
        with pytest.raises(tracing.TraceContextError):
            tracing.parse_traceparent(bad)
    assert tracing.parse_traceparent("01" + TP[2:] + "-future")[2]   # a later version's tail


def test_another_hosts_stamps_are_centred_in_the_interval_seen_here() -> None:
    mine = {"A": 5, "B": 9}
    assert tracing.aligned(mine, tracing.boot_id(), 0, 100) == mine   # one clock: as is
    assert tracing.aligned({"A": 1_000_005, "B": 1_000_009}, "elsewhere", 100, 200) == \
        {"A": 148, "B": 152}
    reply = tracing.broker_stamps(1.0, 1.001, 1.010,
                                  {"boot": "elsewhere", "ns": {"COMPUTE_START": 7_000,
                                                               "COMPUTE_END": 9_000}})
    ns = reply["ns"]
    assert ns["REQUEST_START"] < ns["COMPUTE_START"] < ns["COMPUTE_END"] < ns["REQUEST_END"]
    assert ns["COMPUTE_END"] - ns["COMPUTE_START"] == 2_000


def test_an_untraced_request_carries_nothing_on_the_wire() -> None:
    x = p.from_numpy("input", np.ones((1, 4), np.float32))
    header, _ = p.request_header(p.InferRequest("1", "m", [x]))
    assert "trace" not in header
    reply, _ = p.reply_header(p.InferReply("1", "m", 1, [x]))
    assert "trace" not in reply
    _, batch, _ = p.unpack(p.encode_batch(p.Batch(1, "m", 1, [p.BatchItem("0", [x])])))
    assert "trace" not in batch
    _, result, _ = p.unpack(p.encode_result(p.BatchResult(1, [])))
    assert "trace" not in result
    traced = p.InferRequest("1", "m", [x], trace=tracing.context(TP, "k=v"))
    kind, header, frames = p.unpack(p.encode_request(traced))
    assert p.decode_request(header, frames).trace == {"traceparent": TP, "tracestate": "k=v"}
    header["trace"] = {"traceparent": 5}
    with pytest.raises(p.ProtocolError, match="trace"):
        p.decode_request(header, frames)


def test_opentelemetry_mode_without_the_sdk_says_how_to_install_it() -> None:
    # a process where the SDK cannot be imported, as on an install without the extra
    code = ("import sys; sys.modules['opentelemetry'] = None\n"
            "from zeroserve.broker import traceconfig, tracing\n"
            "tracing.require_otel(traceconfig.parse_trace_config(['mode=triton']))\n"
            "try:\n"
            "    tracing.require_otel(traceconfig.parse_trace_config(['mode=opentelemetry']))\n"
            "except traceconfig.TraceConfigError as exc:\n"
            "    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert "pip install 'zeroserve[otel]'" in out.stdout, out.stdout + out.stderr


def test_opentelemetry_settings_and_the_otel_environment(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    config = traceconfig.parse_trace_config([
        "mode=opentelemetry", "opentelemetry,url=collector:4318/v1/traces",
        "opentelemetry,resource=a=b=c", "opentelemetry,resource=team=ml",
        "opentelemetry,bsp_schedule_delay=50", "triton,file=/tmp/t,with,commas"])
    assert config.mode == "opentelemetry" and config.front == (("file", "/tmp/t,with,commas"),)
    assert config.otel == traceconfig.OtelConfig(
        "http://collector:4318/v1/traces", (("a", "b=c"), ("team", "ml")), None, 50, None)
    otel = ["mode=opentelemetry", "level=TIMESTAMPS"]
    env = {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.25"}
    _sampler_env(monkeypatch, env)
    setting, _ = parse_config(otel)
    assert (setting.ratio, setting.rate, setting.parent_based) == (0.25, 4, True)
    assert parse_config([*otel, "rate=10"])[0].chance() == 0.1   # the flag wins
    assert parse_config(["level=TIMESTAMPS"])[0].ratio is None    # triton mode: no
    # a run-time rate replaces the environment's ratio, for the global setting and a model
    s = TraceSettings(setting, "opentelemetry")
    s.update("m", {"trace_rate": "2"})
    assert s.effective("m").chance() == 0.5 and s.effective(None).chance() == 0.25
    s.update(None, {"trace_rate": "5"})
    assert s.effective(None).chance() == 0.2 and s.get()["trace_rate"] == "5"
    _sampler_env(monkeypatch, {"OTEL_TRACES_SAMPLER": "always_off"})
    setting, _ = parse_config(otel)
    assert (setting.chance(), setting.parent_based) == (0.0, False)
    for bad in [{"OTEL_TRACES_SAMPLER": "jaeger_remote"}, {"OTEL_TRACES_SAMPLER_ARG": "2"}]:
        _sampler_env(monkeypatch, bad)
        with pytest.raises(TraceSettingError, match="OTEL_TRACES_SAMPLER"):
            parse_config(otel)


def _sampler_env(mp: pytest.MonkeyPatch, values: dict[str, str]) -> None:
    for key in ("OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG"):
        mp.delenv(key, raising=False)
    for key, value in values.items():
        mp.setenv(key, value)


def test_a_traced_batch_carries_each_traced_items_context_and_arrival() -> None:
    x = p.from_numpy("input", np.ones((1, 4), np.float32))
    bt = p.BatchTrace("boot", 900, [(1, {"traceparent": TP}, 500)])
    batch = p.Batch(1, "m", 1, [p.BatchItem("0", [x]), p.BatchItem("1", [x])], trace=bt)
    _, header, frames = p.unpack(p.encode_batch(batch))
    assert p.decode_batch(header, frames).trace == bt
    for bad in [True, {"boot": "b", "sent_ns": 1, "items": [[2, {"traceparent": TP}, 5]]},
                {"boot": "b", "sent_ns": 1, "items": [[0, {"traceparent": 5}, 5]]},
                {"boot": "b", "items": []}]:
        with pytest.raises(p.ProtocolError):
            p.decode_batch({**header, "trace": bad}, frames)
