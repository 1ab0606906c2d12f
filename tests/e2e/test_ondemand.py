"""Load on demand in a real server: 12 models of 8 MB on one worker whose memory budget
holds about 4, every model available and none loaded at start; requests round-robin,
then skewed (Zipf), each answered with its own model's numbers while models are loaded
and evicted under them; a deadline shorter than the predicted load refused at once;
SIGKILL of the worker while it loads a model answers each waiting request once; two
remote workers over CurveZMQ (one in a network namespace of its own where the host
allows) loading on demand within their own budgets; and nothing of any request left in
the broker afterwards."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest

from tests.conftest import ZEROSERVE, Server, http, linear_config, short_tmpdir, \
    wait_for, write_model
from tests.e2e.test_curve import Cluster
from zeroserve.broker.client import AsyncClient, Client, ErrorCode, InferError

pytestmark = pytest.mark.timeout(180)

MODELS = 12
# 8.06 MB of weights each; the worker's context (about 14 MB here) and 4 of them fit
BUDGET = 52_000_000
X = np.ones((1, 4), np.float32)


def factory(ident: int) -> str:
    """A model whose every output is its own number, with 8 MB of weights to place."""
    return (f"(lambda s: (nn.init.zeros_(s[-1].weight), nn.init.constant_(s[-1].bias, "
            f"{ident}.0), s)[-1])(nn.Sequential(nn.Linear(4, 2000), nn.Linear(2000, 1000), "
            "nn.Linear(1000, 3)))")


SLOW_LOAD = '''
import time
import torch


class Model:
    def load(self, version_dir, device):
        time.sleep(4)  # noqa: sleep-ok (a load long enough to kill its worker during it)

    def predict(self, inputs):
        return {"output": inputs["input"][:, :3] * 0 + 99}
'''


@pytest.fixture
def repo() -> Iterator[Path]:
    repo = short_tmpdir("zsrepo")
    for i in range(MODELS):
        write_model(repo, f"m{i}", 1, factory(i), linear_config(f"m{i}"))
    (repo / "slow" / "1").mkdir(parents=True)
    (repo / "slow" / "1" / "model.py").write_text(SLOW_LOAD)
    (repo / "slow" / "config.json").write_text(json.dumps(
        {**linear_config("slow"), "platform": "python", "warmup": {"batch_sizes": [1]}}))
    yield repo
    shutil.rmtree(repo, ignore_errors=True)


def control(srv: Server, verb: str, **args: Any) -> Any:
    with Client(srv.control, timeout_s=10) as c:
        return c.control(verb, **args)


def states(srv: Server) -> dict[str, str]:
    return {n: m.get("state", "") for n, m in control(srv, "models")["models"].items()}


async def drive(srv: Server, names: list[str], concurrency: int) -> list[tuple[str, Any]]:
    """Each name asked once, ``concurrency`` at a time: (name, its output or error)."""
    return await drive_at(AsyncClient(srv.frontend), names, concurrency)


async def drive_at(client: AsyncClient, names: list[str],
                   concurrency: int) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    todo = iter(names)
    async with client:
        assert await client.wait_connected(10)

        async def lane() -> None:
            for name in todo:
                try:
                    res = await client.infer(name, {"input": X}, timeout_ms=60_000)
                    out.append((name, res.outputs["output"].tolist()))
                except InferError as exc:
                    out.append((name, exc))
        await asyncio.gather(*(lane() for _ in range(concurrency)))
    return out


def zipf(n: int, s: float, count: int, seed: int) -> list[str]:
    weights = 1.0 / np.arange(1, n + 1) ** s
    picks = np.random.default_rng(seed).choice(n, size=count, p=weights / weights.sum())
    return [f"m{i}" for i in picks]


def test_twelve_models_on_a_budget_of_four_each_answer_their_own(
        repo: Path, serve: Callable[..., Server]) -> None:
    srv = serve(repo, extra=["--memory-budget", str(BUDGET), "--load-on-demand",
                             "--load-on-demand-min-residency-s", "0.2"])
    assert set(states(srv).values()) == {"available"}, states(srv)
    code, _, body = http("POST", srv.url + "/v2/repository/index", b"{}")
    assert code == 200 and {e["state"] for e in json.loads(body)} == {"AVAILABLE"}, body
    assert http("GET", srv.url + "/v2/models/m3/ready")[0] == 503, "available: not ready"
    assert http("GET", srv.url + "/v2/models/m3")[0] == 200, "but listed, metadata served"
    out = subprocess.run([*ZEROSERVE, "models", "--runtime-dir", str(srv.runtime)],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.count(" available ") == MODELS + 1, out.stdout

    names = [f"m{i % MODELS}" for i in range(2 * MODELS)] + zipf(MODELS, 1.1, 200, 7)
    for lot, concurrency in ((names[:2 * MODELS], 4), (names[2 * MODELS:], 8)):
        answers = asyncio.run(drive(srv, lot, concurrency))
        assert len(answers) == len(lot)
        wrong = [(n, a) for n, a in answers if a != [[float(n[1:])] * 3]]
        assert not wrong, (wrong[:5], srv.log()[-3000:])

    seen = states(srv)
    assert {"ready", "evicted"} <= set(seen.values()), seen
    held = control(srv, "status")["workers"][0]["models"]
    assert 2 <= len(held) <= 5, f"the budget holds about 4: {held}"
    metrics = http("GET", srv.url + "/metrics")[2].decode()
    evictions = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                    if line.startswith("zeroserve_model_evictions_total{"))
    assert evictions >= MODELS - 5, metrics
    assert "zeroserve_load_wait_seconds_count{" in metrics
    census = control(srv, "census")
    assert not any(census.values()), census

    cold = next(n for n, s in states(srv).items() if s in ("available", "evicted"))
    start = time.monotonic()
    with Client(srv.frontend, timeout_s=10) as c:
        with pytest.raises(InferError) as err:
            c.infer(cold, {"input": X}, timeout_ms=2)
    assert err.value.code is ErrorCode.DEADLINE and "loading model" in str(err.value)
    assert time.monotonic() - start < 1.0, "refused at once, not after waiting"
    code, _, body = http("POST", srv.url + f"/v2/models/{cold}/infer", json.dumps(
        {"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32",
                     "data": [1, 1, 1, 1]}], "parameters": {"timeout": 2000}}).encode())
    assert code == 504 or code == 200, body   # 2 ms over HTTP: refused; 2 s: may load


def test_sigkill_of_the_worker_while_it_loads_answers_each_waiting_request_once(
        repo: Path, serve: Callable[..., Server]) -> None:
    srv = serve(repo, extra=["--memory-budget", str(BUDGET), "--load-on-demand"])
    [worker_pid] = srv.pids("worker")

    async def ask_slow() -> list[Any]:
        async with AsyncClient(srv.frontend) as client:
            assert await client.wait_connected(10)
            tasks = [asyncio.ensure_future(client.infer("slow", {"input": X},
                                                        timeout_ms=60_000)) for _ in range(3)]
            await asyncio.to_thread(wait_for, lambda: states(srv)["slow"] == "loading", 20,
                                    "slow to be loading")
            os.kill(worker_pid, signal.SIGKILL)
            return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(ask_slow())
    assert len(results) == 3
    for res in results:
        assert isinstance(res, InferError), res
        assert res.code is ErrorCode.WORKER_LOST and "lost while loading model 'slow'" \
            in str(res), res
    census = control(srv, "census")
    assert not any(census.values()), census
    assert states(srv)["slow"] in ("available", "loading", "ready"), states(srv)
    wait_for(lambda: srv.pids("worker") and srv.pids("worker") != [worker_pid], 60,
             "the worker to be restarted")
    with Client(srv.frontend, timeout_s=60) as c:
        wait_for(lambda: control(srv, "status")["workers"], 60, "the worker back")
        res = c.infer("m5", {"input": X}, timeout_ms=30_000)
    assert res.outputs["output"].tolist() == [[5.0] * 3]


def test_remote_workers_load_on_demand_within_their_own_budgets(repo: Path) -> None:
    """Placement, eviction and the load's LOADED over tcp:// and CurveZMQ: both workers
    hold models they were asked for, within their budgets, and every answer is its own
    model's."""
    c = Cluster.create(short_tmpdir("zsodc"), ("w0", "w1", "client"))
    runtime = c.runtime
    try:
        c.start_broker(repo, ["--load-on-demand", "--load-on-demand-min-residency-s", "0.05"])
        for index in (0, 1):
            c.start_worker(index, f"w{index}", in_netns=index == 1,
                           extra=["--memory-budget", str(BUDGET)])
        wait_for(lambda: os.path.exists(runtime / "control") and len(c.worker_ids()) == 2,
                 90, "both remote workers registered")
        names = [f"m{i % MODELS}" for i in range(2 * MODELS)] + zipf(MODELS, 1.1, 200, 11)
        client = AsyncClient(c.frontend(), curve_keys=c.client_keys("client"))
        answers = asyncio.run(drive_at(client, names, 8))
        assert len(answers) == len(names)
        wrong = [(n, a) for n, a in answers if a != [[float(n[1:])] * 3]]
        assert not wrong, wrong[:5]
        plans = c.call("status")["memory_plan"]
        assert len(plans) == 2 and all(p["models"] for p in plans.values()), \
            "both workers loaded models on demand"
        for wid, plan in plans.items():
            assert plan["planned_bytes"] <= plan["budget_bytes"], (wid, plan)
        assert any(s == "evicted" for s in
                   (m.get("state") for m in c.call("models")["models"].values())), \
            "12 models on two budgets of about 4: some were evicted"
        census = c.call("census")
        assert not any(census.values()), census
    except AssertionError:
        c.print_logs(4000)
        raise
    finally:
        c.close()


def test_a_model_that_can_never_fit_is_a_non_retryable_error_everywhere(repo: Path) -> None:
    """A budget smaller than the model: every request answers 507 at once (no Retry-After:
    waiting never helps), and `zeroserve models`, the index and readiness say so."""
    write_model(repo, "opt", 1, factory(0), linear_config("opt", optional=True))
    srv = Server(repo, extra=["--load-on-demand", "--memory-budget", "20000000"])
    try:
        def connected() -> bool:
            try:
                return bool(control(srv, "models")["workers_connected"])
            except InferError:   # the broker not listening yet
                return False
        wait_for(connected, 30, "a worker to connect")
        x = json.dumps({"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32",
                                    "data": [1, 2, 3, 4]}]}).encode()
        status, headers, out = http("POST", srv.url + "/v2/models/m0/infer", x)
        assert status == 507, (status, out)
        assert "retry-after" not in {k.lower() for k in headers}
        assert b"can never be loaded here" in out and b"--memory-budget" in out, out
        with pytest.raises(InferError) as err:
            with Client(srv.frontend, timeout_s=10) as c:
                c.infer("m0", {"input": X})
        assert err.value.code is ErrorCode.TOO_BIG and not err.value.code.retryable
        assert states(srv)["m0"] == "too_big"
        listed = subprocess.run([*ZEROSERVE, "models", "--runtime-dir", str(srv.runtime)],
                                capture_output=True, text=True, timeout=30).stdout
        assert "too_big" in listed and "m0: model 'm0' can never be loaded here" in listed
        status, _, out = http("POST", srv.url + "/v2/repository/index", b"{}")
        index = {e["name"]: e for e in json.loads(out)}
        assert index["m0"]["state"] == "TOO_BIG" and "--memory-budget" in index["m0"]["reason"]
        status, _, out = http("GET", srv.url + "/v2/health/ready")
        assert status == 503 and b"model 'm0' is too big" in out, out
        assert b"'opt'" not in out   # optional: exempt, as any other optional model
    finally:
        srv.stop()
