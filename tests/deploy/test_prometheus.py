"""deploy/prometheus and deploy/grafana checked by a real Prometheus: promtool's syntax
check and the rules' unit tests, then a live run. ``zeroserve serve`` (2 workers, a
tenants file, a memory budget) is scraped every second by Prometheus with the rules at
test-time windows (tests/deploy/prom.py); a worker killed three times fires
ZeroserveWorkerRestarting, an open-loop load at twice the model's capacity fires
ZeroserveQueueTimeOverSLO within its ``for:``, and then every alert's measure, every
recorded series and every dashboard query must name at least one series."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections import Counter
from datetime import datetime
from typing import Any, Iterator

import numpy as np
import pytest
import yaml

from tests.conftest import Server, http, linear_config, short_tmpdir, wait_for
from tests.deploy import prom
from zeroserve.broker.client import AsyncClient, Client, InferError
from zeroserve.broker.server.tenants import new_key

needs_prometheus = pytest.mark.skipif(prom.PROMETHEUS is None or prom.PROMTOOL is None,
                                      reason=prom.MISSING)
DEPLOY = prom.ROOT / "deploy"
ALERTS_TEST = DEPLOY / "prometheus" / "tests" / "alerts_test.yml"
DASHBOARD = DEPLOY / "grafana" / "zeroserve.json"
RUNBOOK = "docs/metrics.md"   # each alert's runbook annotation: this page, its heading
CONCERNS = ["Traffic", "Latency by stage", "Batching", "Workers and memory", "Tenants"]

SERVICE_S = 0.05      # one request's run time; max_batch_size 1, so capacity 1/SERVICE_S
WORKERS = 2
CAPACITY_RPS = WORKERS / SERVICE_S
SLOW = f'''
import time


class Model:
    def load(self, version_dir, device):
        pass

    def predict(self, inputs):
        x = inputs["input"]
        if float(x[0, 0]) == -1.0:
            raise ValueError("the poison input")
        time.sleep({SERVICE_S})  # noqa: sleep-ok (a model with a known service time)
        return {{"output": x[:, :3] * 2.0}}
'''
LAZY = '''
class Model:
    def load(self, version_dir, device):
        pass

    def predict(self, inputs):
        return {"output": inputs["input"][:, :3]}
'''
X = np.ones((1, 4), np.float32)
POISON = np.full((1, 4), -1.0, np.float32)


def body(x: np.ndarray, **parameters: Any) -> bytes:
    return json.dumps({"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32",
                                   "data": x.ravel().tolist()}],
                       "parameters": parameters}).encode()


# -- no server needed -----------------------------------------------------------------
@needs_prometheus
def test_rules_pass_promtool_check() -> None:
    files = sorted(str(p) for p in prom.RULES.glob("*.yml"))
    out = subprocess.run([prom.PROMTOOL, "check", "rules", *files], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    config = subprocess.run([prom.PROMTOOL, "check", "config",
                             str(DEPLOY / "prometheus" / "prometheus.yml")],
                            capture_output=True, text=True)
    assert config.returncode == 0, config.stdout + config.stderr


@needs_prometheus
def test_rule_unit_tests_pass() -> None:
    out = subprocess.run([prom.PROMTOOL, "test", "rules", str(ALERTS_TEST)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_alert_has_a_unit_test_that_fires_it_and_one_that_does_not() -> None:
    tests = yaml.safe_load(ALERTS_TEST.read_text())["tests"]
    cases = [c for t in tests for c in t.get("alert_rule_test", [])]
    for rule in prom.rules("alert"):
        mine = [c for c in cases if c["alertname"] == rule["alert"]]
        assert any(c["exp_alerts"] for c in mine), f"{rule['alert']}: no test where it fires"
        assert any(not c["exp_alerts"] for c in mine), \
            f"{rule['alert']}: no test where it stays quiet"
        assert rule["annotations"]["runbook"] == f"{RUNBOOK}#{rule['alert'].lower()}"


def test_every_alert_has_its_heading_in_the_runbook_page() -> None:
    headings = re.findall(r"^#+ (\S+)$", (prom.ROOT / RUNBOOK).read_text(), re.M)
    missing = [r["alert"] for r in prom.rules("alert") if r["alert"] not in headings]
    assert not missing, f"alerts without a heading in {RUNBOOK}: {missing}"


def dashboard_script() -> Any:
    import importlib.util
    spec = importlib.util.spec_from_file_location("dashboard", DEPLOY / "grafana" / "dashboard.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dashboard_is_what_its_script_writes() -> None:
    module = dashboard_script()
    assert DASHBOARD.read_text() == module.render(), \
        "deploy/grafana/zeroserve.json is stale: run python deploy/grafana/dashboard.py"
    rows = [p["title"] for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] == "row"]
    assert rows == CONCERNS


def test_measures_split_at_the_top_level_comparison() -> None:
    assert prom.measures('a{x=~"y"} / on (m) group_left () b > 0.01') == \
        ['a{x=~"y"} / on (m) group_left () b']
    assert prom.measures("max by (model) (ready) == 0") == ["max by (model) (ready)"]
    assert prom.measures("p99 > max by (model) (slo)") == ["p99", "max by (model) (slo)"]
    assert prom.measures('sum (increase(r{a!="b"}[1m])) >= 3') == \
        ['sum (increase(r{a!="b"}[1m]))']
    with pytest.raises(AssertionError):
        prom.measures("sum(rate(x[1m]))")


def dashboard_queries() -> list[tuple[str, str]]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(p["title"], t["expr"].replace("$__rate_interval", prom.RATE_INTERVAL)
             .replace("$model", ".*")) for p in panels for t in p.get("targets", [])]


# -- the live run ---------------------------------------------------------------------
class OpenLoop:
    """Requests sent at a fixed rate from one asyncio client, whatever the answers."""

    def __init__(self, frontend: str, key: str, rate_rps: float) -> None:
        self.outcomes: Counter[str] = Counter()
        self._args = (frontend, key, rate_rps)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()))

    async def _one(self, client: AsyncClient) -> None:
        try:
            await client.infer("slow", {"input": X})
            self.outcomes["ok"] += 1
        except InferError as exc:
            self.outcomes[exc.code.value] += 1

    async def _main(self) -> None:
        frontend, key, rate = self._args
        async with AsyncClient(frontend, api_key=key) as client:
            assert await client.wait_connected(10)
            tasks: set[asyncio.Task[None]] = set()
            due = time.monotonic()
            while not self._stop.is_set():
                while due <= time.monotonic():
                    task = asyncio.ensure_future(self._one(client))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                    due += 1.0 / rate
                await asyncio.sleep(max(0.0, due - time.monotonic()))  # noqa: sleep-ok (pacing)
            await asyncio.gather(*tasks)

    def __enter__(self) -> "OpenLoop":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(60)


class Live:
    def __init__(self) -> None:
        self.repo = short_tmpdir("zsrepo")
        (self.repo / "slow" / "1").mkdir(parents=True)
        (self.repo / "slow" / "1" / "model.py").write_text(SLOW)
        (self.repo / "slow" / "config.json").write_text(json.dumps(
            {**linear_config("slow", mbs=1), "platform": "python",
             "dynamic_batching": {"max_queue_size": 16},
             "autoscaling": {"queue_slo_ms": 100}}))
        (self.repo / "lazy" / "1").mkdir(parents=True)   # loaded when first asked for
        (self.repo / "lazy" / "1" / "model.py").write_text(LAZY)
        (self.repo / "lazy" / "config.json").write_text(json.dumps(
            {**linear_config("lazy"), "platform": "python", "load_on_demand": True}))
        self.keys, hashes = {}, {}
        for name in ("ops", "tight"):
            self.keys[name], hashes[name] = new_key()
        self.tenants = self.repo.parent / f"{self.repo.name}.tenants.toml"
        self.tenants.write_text(
            f'[tenants.ops]\nkeys = ["{hashes["ops"]}"]\n\n'
            f'[tenants.tight]\nkeys = ["{hashes["tight"]}"]\nrate = 1\nburst = 1\n')
        self.server = Server(self.repo, workers=WORKERS, extra=[
            "--tenants", str(self.tenants), "--memory-budget", str(4 << 30)])
        self.prometheus = prom.Prometheus(self.server.port)
        self.results: dict[str, Any] = {}

    def headers(self, tenant: str = "ops") -> dict[str, str]:
        return {"Content-Type": "application/json",
                "Authorization": f"Bearer {self.keys[tenant]}"}

    def workers(self) -> dict[str, int]:
        with Client(self.server.control, timeout_s=5) as c:
            return {w["id"]: w["pid"] for w in c.control("status")["workers"]
                    if "slow/1" in w["models"]}

    def close(self) -> None:
        self.prometheus.stop()
        self.server.stop()
        shutil.rmtree(self.repo, ignore_errors=True)
        self.tenants.unlink(missing_ok=True)


def scrape_seen(live: Live) -> bool:
    return len(live.prometheus.query("zeroserve_model_ready")) > 0


def some_of_everything(live: Live) -> None:
    """Answers of each kind the rules count: ok, a model error (HTTP 500 and direct),
    refusals for a tenant's quota."""
    url = f"{live.server.url}/v2/models/slow/infer"
    for _ in range(3):
        assert http("POST", url, body(X), live.headers())[0] == 200
    assert http("POST", url, body(POISON), live.headers())[0] == 500
    with Client(live.server.frontend, api_key=live.keys["ops"]) as c:
        with pytest.raises(InferError):
            c.infer("slow", {"input": POISON})
    lazy = f"{live.server.url}/v2/models/lazy/infer"
    assert http("POST", lazy, body(X), live.headers())[0] == 200   # a load on demand
    codes = Counter(http("POST", url, body(X), live.headers("tight"))[0] for _ in range(6))
    assert codes[429] >= 3, codes


def kill_a_worker_three_times(live: Live) -> None:
    worker_id = sorted(live.workers())[0]
    for _ in range(3):
        pid = live.workers()[worker_id]
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: live.workers().get(worker_id, pid) != pid, 60,
                 f"worker {worker_id} to come back")
    start = time.monotonic()
    wait_for(lambda: live.prometheus.alerts("ZeroserveWorkerRestarting"), 30,
             "ZeroserveWorkerRestarting to fire")
    live.results["restart"] = (worker_id, time.monotonic() - start)


def overload(live: Live) -> None:
    """Twice the capacity from the direct client, and over HTTP requests whose timeout the
    queue cannot meet (504)."""
    url = f"{live.server.url}/v2/models/slow/infer"
    with OpenLoop(live.server.frontend, live.keys["ops"], 2 * CAPACITY_RPS) as load:
        start = time.monotonic()
        statuses: Counter[int] = Counter()

        def fired() -> list[dict[str, Any]]:
            statuses[http("POST", url, body(X, timeout=20_000), live.headers())[0]] += 1
            return live.prometheus.alerts("ZeroserveQueueTimeOverSLO")
        alerts = wait_for(fired, 60, "ZeroserveQueueTimeOverSLO to fire")
        live.results["slo"] = (time.monotonic() - start, time.time(), alerts, statuses)
    live.results["overload"] = load.outcomes


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    if prom.PROMETHEUS is None:
        pytest.skip(prom.MISSING)
    world = Live()
    try:
        world.server.wait_ready()
        world.prometheus.wait_ready()
        wait_for(lambda: len(world.workers()) == WORKERS, 60, "both workers to hold slow")
        wait_for(lambda: scrape_seen(world), 30, "Prometheus to scrape zeroserve")
        some_of_everything(world)
        kill_a_worker_three_times(world)
        overload(world)
        yield world
    finally:
        world.close()


@pytest.mark.timeout(240)
def test_killing_a_worker_in_a_loop_fires_the_restart_alert(live: Live) -> None:
    worker_id, took_s = live.results["restart"]
    firing = live.prometheus.alerts("ZeroserveWorkerRestarting")
    assert [a["labels"]["worker"] for a in firing] == [worker_id]
    assert took_s < 10, f"fired {took_s:.1f}s after the third restart"


@pytest.mark.timeout(240)
def test_twice_the_capacity_fires_the_queue_slo_alert_within_its_for(live: Live) -> None:
    took_s, seen_at, alerts, statuses = live.results["slo"]
    assert [a["labels"]["model"] for a in alerts] == ["slow"]
    outcomes = live.results["overload"]
    assert outcomes["overloaded"] > 0 and outcomes["ok"] > 0, outcomes  # really over capacity
    assert statuses[504] > 0, statuses
    # the condition needs a window of queued requests, then holds for `for:`
    window_s = float(prom.WINDOWS["5m"].rstrip("s"))
    assert prom.FOR_S <= took_s < window_s + prom.FOR_S + 5, \
        f"fired after {took_s:.1f}s of overload"
    # pending from activeAt; firing once `for:` held (seen within a poll and an evaluation)
    active = datetime.fromisoformat(alerts[0]["activeAt"][:26].rstrip("Z") + "+00:00")
    pending_s = seen_at - active.timestamp()
    assert prom.FOR_S <= pending_s < prom.FOR_S + 4, f"pending {pending_s:.1f}s before firing"


@pytest.mark.timeout(240)
def test_every_alert_recording_and_dashboard_query_names_a_series(live: Live) -> None:
    queries = [(f"alert {r['alert']}", prom.shorten(side)) for r in prom.rules("alert")
               for side in prom.measures(r["expr"])]
    queries += [(f"record {r['record']}", r["record"]) for r in prom.rules("record")]
    queries += [(f"panel {title}", expr) for title, expr in dashboard_queries()]
    # each query runs (a wrong one is an error); a GPU worker's series cannot exist here
    gpu_only = dashboard_script().GPU_ONLY
    empty = [f"{what}: {expr}" for what, expr in queries if not live.prometheus.query(expr)
             and not any(name in expr for name in gpu_only)]
    assert not empty, "queries that name no series:\n" + "\n".join(empty)
    assert len(queries) > 40
    assert live.prometheus.query('zeroserve_model_ready{model="slow"} == 1')
    assert live.prometheus.query("zeroserve_gateway_broker_up == 1")
