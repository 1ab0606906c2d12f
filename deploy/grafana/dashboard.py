"""Writes zeroserve.json, the Grafana dashboard, beside this file: one row per concern
(traffic, latency by stage, batching, workers and memory, tenants).

    python deploy/grafana/dashboard.py        # after changing a panel; commit both files

tests/deploy/test_prometheus.py checks that the JSON is what this script writes and
runs every query against a live server through a real Prometheus.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RATE = "$__rate_interval"
M = 'model=~"$model"'

# (row title, [(panel title, unit, [(query, legend), ...]), ...])
ROWS: list[tuple[str, list[tuple[str, str, list[tuple[str, str]]]]]] = [
    ("Traffic", [
        ("Broker answers by model and status", "reqps", [
            (f"sum by (model, status) (rate(zeroserve_inference_requests_total{{{M}}}[{RATE}]))",
             "{{model}} {{status}}")]),
        ("HTTP answers by route and status", "reqps", [
            (f"sum by (route, status) (rate(zeroserve_http_requests_total[{RATE}]))",
             "{{route}} {{status}}")]),
        ("Rejected by reason (broker) and shed at the gateway's door", "reqps", [
            (f"sum by (model, reason) (rate(zeroserve_requests_rejected_total{{{M}}}[{RATE}]))",
             "{{model}} {{reason}}"),
            (f"sum by (reason) (rate(zeroserve_gateway_shed_total[{RATE}]))",
             "gateway {{reason}}")]),
        ("Gateway: requests in flight", "short", [
            ("sum by (instance) (zeroserve_gateway_in_flight)", "{{instance}}")]),
        ("Gateway: event loop lag", "s", [
            ("max by (instance) (zeroserve_gateway_loop_lag_seconds)", "{{instance}}")]),
        ("Gateway: CPU", "percentunit", [
            (f"rate(zeroserve_process_cpu_seconds_total{{component=\"gateway\"}}[{RATE}])",
             "{{instance}}")]),
    ]),
    ("Latency by stage", [
        ("HTTP, first byte in to last out (p50, p99)", "s", [
            ("route:zeroserve_http_request_seconds:p99_5m", "p99 {{route}}"),
            ("route:zeroserve_http_request_seconds:p50_5m", "p50 {{route}}")]),
        ("Broker arrival to reply (p50, p99)", "s", [
            (f"model:zeroserve_inference_latency_seconds:p99_5m{{{M}}}", "p99 {{model}}"),
            (f"model:zeroserve_inference_latency_seconds:p50_5m{{{M}}}", "p50 {{model}}")]),
        ("Queue time against the model's SLO", "s", [
            (f"model:zeroserve_inference_queue_seconds:p99_5m{{{M}}}", "p99 {{model}}"),
            (f"model:zeroserve_inference_queue_seconds:p50_5m{{{M}}}", "p50 {{model}}"),
            (f"max by (model) (zeroserve_model_queue_slo_seconds{{{M}}})", "SLO {{model}}")]),
        ("Compute per batch: broker's view and worker's own (p99)", "s", [
            (f"model:zeroserve_inference_compute_seconds:p99_5m{{{M}}}", "broker {{model}}"),
            ("histogram_quantile(0.99, sum by (model, le) "
             f"(rate(zeroserve_worker_batch_seconds_bucket{{{M}}}[{RATE}])))",
             "worker {{model}}")]),
    ]),
    ("Batching", [
        ("Batch size (mean, p99)", "short", [
            (f"sum by (model) (rate(zeroserve_inference_batch_size_sum{{{M}}}[{RATE}])) / "
             f"sum by (model) (rate(zeroserve_inference_batch_size_count{{{M}}}[{RATE}]))",
             "mean {{model}}"),
            ("histogram_quantile(0.99, sum by (model, le) "
             f"(rate(zeroserve_inference_batch_size_bucket{{{M}}}[{RATE}])))", "p99 {{model}}")]),
        ("Batches sent, by why", "ops", [
            (f"sum by (model, reason) (rate(zeroserve_batches_total{{{M}}}[{RATE}]))",
             "{{model}} {{reason}}")]),
        ("Queue depth", "short", [
            (f"sum by (model) (zeroserve_queue_depth{{{M}}})", "{{model}}")]),
    ]),
    ("Workers and memory", [
        ("Workers registered, models ready", "short", [
            ("max(zeroserve_workers_alive)", "workers"),
            (f"max by (model) (zeroserve_model_ready{{{M}}})", "ready {{model}}")]),
        ("Worker restarts, losses and recycles", "short", [
            (f"sum by (worker) (increase(zeroserve_worker_restarts_total[{RATE}]))",
             "restarts {{worker}}"),
            (f"sum by (worker, reason) (increase(zeroserve_worker_losses_total[{RATE}]))",
             "lost {{worker}} {{reason}}"),
            (f"sum by (worker) (increase(zeroserve_worker_recycles_total[{RATE}]))",
             "recycled {{worker}}")]),
        ("Worker resident memory", "bytes", [
            ("max by (instance) (zeroserve_worker_memory_bytes)", "{{instance}}")]),
        ("Memory available for models after the headroom", "bytes", [
            ("min by (worker, device) (zeroserve_worker_memory_available_bytes)",
             "{{worker}} {{device}}")]),
        ("Model versions' measured footprint", "bytes", [
            (f"max by (model, version, worker) (zeroserve_model_memory_measured_bytes{{{M}}})",
             "{{model}}/{{version}} on {{worker}}")]),
        # GPU workers with nvidia-ml-py only (GPU_ONLY): the driver's view of each device
        ("GPU busy and memory used, as the driver sees them", "percentunit", [
            ("max by (instance) (zeroserve_gpu_utilization_ratio)", "busy {{instance}}"),
            ('max by (instance) (zeroserve_gpu_driver_memory_bytes{kind="used"}) / '
             'max by (instance) (zeroserve_gpu_driver_memory_bytes{kind="total"})',
             "memory {{instance}}")]),
    ]),
    ("Tenants", [
        ("Admitted by tenant", "reqps", [
            (f"sum by (tenant) (rate(zeroserve_tenant_requests_total[{RATE}]))", "{{tenant}}")]),
        ("Refused by tenant and reason", "reqps", [
            (f"sum by (tenant, reason) (rate(zeroserve_tenant_rejections_total[{RATE}]))",
             "{{tenant}} {{reason}}")]),
        ("Share of attempts refused for quota", "percentunit", [
            ("tenant:zeroserve_quota_rejections:ratio5m", "{{tenant}}")]),
        ("Queue time by tenant (p99)", "s", [
            ("tenant:zeroserve_tenant_queue_seconds:p99_5m", "{{tenant}}")]),
    ]),
]

# series that only a GPU worker with nvidia-ml-py exports: a CPU host's scrape has none
GPU_ONLY = ("zeroserve_gpu_utilization_ratio", "zeroserve_gpu_driver_memory_bytes")

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def _panel(pid: int, title: str, unit: str, queries: list[tuple[str, str]],
           x: int, y: int) -> dict[str, Any]:
    return {
        "id": pid, "type": "timeseries", "title": title, "datasource": DATASOURCE,
        "gridPos": {"h": 8, "w": 8, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"},
                    "tooltip": {"mode": "multi"}},
        "targets": [{"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": expr,
                     "legendFormat": legend} for i, (expr, legend) in enumerate(queries)],
    }


def dashboard() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    y = 0
    for title, row in ROWS:
        panels.append({"id": len(panels) + 1, "type": "row", "title": title,
                       "collapsed": False, "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                       "panels": []})
        y += 1
        for i, (ptitle, unit, queries) in enumerate(row):
            panels.append(_panel(len(panels) + 1, ptitle, unit, queries, (i % 3) * 8,
                                 y + (i // 3) * 8))
        y += ((len(row) + 2) // 3) * 8
    return {
        "title": "zeroserve", "uid": "zeroserve", "tags": ["zeroserve"],
        "schemaVersion": 39, "version": 1, "editable": True, "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"}, "timezone": "",
        "annotations": {"list": []},
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus",
             "label": "Prometheus", "current": {}, "hide": 0},
            {"name": "model", "type": "query", "datasource": DATASOURCE, "label": "model",
             "query": {"query": "label_values(zeroserve_model_ready, model)",
                       "refId": "model"},
             "definition": "label_values(zeroserve_model_ready, model)",
             "refresh": 2, "multi": True, "includeAll": True, "allValue": ".*",
             "current": {"text": "All", "value": "$__all"}, "hide": 0, "sort": 1},
        ]},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    Path(__file__).with_name("zeroserve.json").write_text(render())
