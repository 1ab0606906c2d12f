"""One Prometheus scrape covers the gateway, the broker and every worker."""

from __future__ import annotations

import asyncio
import json
import re

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from zeroserve.broker.client import Client, InferError
from zeroserve.broker.protocol import ErrorCode
from zeroserve.gateway import metrics
from tests.conftest import http, wait_for

pytestmark = pytest.mark.timeout(120)

BROKER = """# HELP zeroserve_queue_depth Requests queued
# TYPE zeroserve_queue_depth gauge
zeroserve_queue_depth{model="a"} 2.0
# HELP zeroserve_inference_requests_total Requests
# TYPE zeroserve_inference_requests_total counter
zeroserve_inference_requests_total{model="a",status="ok"} 5.0
# HELP zeroserve_inference_requests_created Requests
# TYPE zeroserve_inference_requests_created gauge
zeroserve_inference_requests_created{model="a",status="ok"} 1.7e9
"""
WORKER = """# HELP zeroserve_queue_depth Worker-side queue
# TYPE zeroserve_queue_depth gauge
zeroserve_queue_depth{model="a"} 1.0
# HELP zeroserve_worker_memory_bytes Worker resident memory
# TYPE zeroserve_worker_memory_bytes gauge
zeroserve_worker_memory_bytes 1.5e8
"""


def test_merge_labels_every_series_and_keeps_one_help_per_family():
    text = metrics.merge([("broker", "h:1", BROKER), ("worker", "h/0", WORKER),
                          ("worker", "h/1", WORKER), ("worker", "h/2", "garbage {{{")])
    assert text.count("# TYPE zeroserve_queue_depth gauge") == 1
    assert text.count("# HELP zeroserve_queue_depth ") == 1
    assert "_created" not in text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    depth = {(s.labels["component"], s.labels["instance"]): s.value
             for s in families["zeroserve_queue_depth"].samples}
    assert depth == {("broker", "h:1"): 2.0, ("worker", "h/0"): 1.0, ("worker", "h/1"): 1.0}
    (req,) = families["zeroserve_inference_requests"].samples
    assert req.labels == {"model": "a", "status": "ok", "component": "broker",
                          "instance": "h:1"}


def test_merge_drops_a_family_whose_type_disagrees():
    clash = "# TYPE zeroserve_queue_depth counter\nzeroserve_queue_depth_total 3\n"
    text = metrics.merge([("broker", "b", BROKER), ("worker", "w", clash)])
    (family,) = [f for f in text_string_to_metric_families(text)
                 if f.name == "zeroserve_queue_depth"]
    assert family.type == "gauge" and len(family.samples) == 1


def _series(text):
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, set()).add((s.labels.get("component"),
                                               s.labels.get("instance")))
    return out


def test_one_scrape_has_gateway_broker_and_each_worker(api_server):
    x = np.ones((1, 4), np.float32)
    body = json.dumps({"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32",
                                   "data": x.reshape(-1).tolist()}]}).encode()
    assert http("POST", api_server.url + "/v2/models/linear/infer", body)[0] == 200
    assert http("POST", api_server.url + "/v2/models/nope/infer", body)[0] == 404
    assert http("POST", api_server.url + "/v2/models/linear/infer",  # the broker says 400
                body.replace(b"[1, 4]", b"[2, 2]"))[0] == 400
    with Client(api_server.control) as c:
        workers = {w["id"] for w in c.control("status")["workers"]}
    assert len(workers) == 2

    def scrape():
        status, headers, got = http("GET", api_server.url + "/metrics")
        assert status == 200 and headers["content-type"].startswith("text/plain")
        series = _series(got.decode())
        instances = {i for c, i in series.get("zeroserve_worker_memory_bytes", ())
                     if c == "worker"}
        return (got.decode(), series) if instances == workers else None

    text, series = wait_for(scrape, 20, "both workers in the scrape")
    http_series = {c for c, _ in series["zeroserve_http_requests_total"]}
    assert http_series == {"gateway"}
    assert re.search(r'zeroserve_http_requests_total\{[^}]*route="/v2/models/\{name\}/infer"'
                     r'[^}]*status="404"', text)
    assert {c for c, _ in series["zeroserve_inference_requests_total"]} == {"broker"}
    assert {c for c, _ in series["zeroserve_workers_alive"]} == {"broker"}
    for name in ("zeroserve_inference_latency_seconds_bucket",
                 "zeroserve_inference_queue_seconds_count",
                 "zeroserve_inference_compute_seconds_count",
                 "zeroserve_inference_batch_size_count", "zeroserve_model_load_success_total",
                 "zeroserve_model_load_seconds_count", "zeroserve_queue_depth",
                 "zeroserve_requests_rejected_total", "zeroserve_http_request_seconds_bucket",
                 "zeroserve_worker_restarts_total", "zeroserve_model_ready",
                 "zeroserve_model_queue_slo_seconds", "zeroserve_gateway_broker_up"):
        assert name in series, name
    assert re.search(r"zeroserve_gateway_broker_up\{[^}]*\} 1\.0", text)
    assert re.search(r'zeroserve_requests_rejected_total\{[^}]*reason="bad_input"', text)
    for family in ("zeroserve_queue_depth", "zeroserve_worker_memory_bytes"):
        assert text.count(f"# TYPE {family} ") == 1


def test_gateways_share_multiprocess_mode_and_the_rest_stays_apart(serve, tiny_repo,
                                                                   tmp_path):
    srv = serve(tiny_repo, env={"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)})
    assert http("GET", srv.url + "/v2/health/live")[0] == 200

    def scrape():
        text = http("GET", srv.url + "/metrics")[2].decode()
        series = _series(text)
        return series if "zeroserve_worker_memory_bytes" in series else None

    series = wait_for(scrape, 20, "a worker's series in the scrape")
    gateway = series["zeroserve_http_requests_total"]
    assert {c for c, _ in gateway} == {"gateway"}
    assert all(":" not in i for _, i in gateway)  # summed over processes: the host
    # broker and worker figures come over the wire once, never from the shared folder
    assert {c for c, _ in series["zeroserve_workers_alive"]} == {"broker"}
    assert {c for c, _ in series["zeroserve_worker_memory_bytes"]} == {"worker"}
    written = {p.name.split("_")[0] for p in tmp_path.glob("*.db")}
    assert written and written <= {"counter", "histogram", "gauge"}  # gauge: the door's
    assert len({p.name.rsplit("_", 1)[1] for p in tmp_path.glob("*.db")}) == 1  # one pid


def test_a_scrape_without_the_broker_says_so_and_keeps_the_gateways_series():
    async def unreachable(verb, **args):
        raise InferError(ErrorCode.UNAVAILABLE, "broker at ipc://x is not reachable")

    async def answering(verb, **args):
        return {"instance": "h:1", "broker": BROKER, "workers": {"h/0": WORKER}}

    down = asyncio.run(metrics.Scrape(unreachable).endpoint(None)).body.decode()
    up = asyncio.run(metrics.Scrape(answering).endpoint(None)).body.decode()
    assert re.search(r"zeroserve_gateway_broker_up\{[^}]*\} 0\.0", down)
    assert re.search(r"zeroserve_gateway_broker_up\{[^}]*\} 1\.0", up)
    assert "zeroserve_inference_requests_total" not in down
    assert "zeroserve_inference_requests_total" in up
    assert "zeroserve_http_requests_total" in down
