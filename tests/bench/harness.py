"""Shared pieces of the benchmark scripts (not tests: pytest collects no bench_* file).

Every benchmark prints its figures beside the in-process limit of the same model,
measured in the same run. The load generator shares the machine's cores with the
server; the figures say so.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from tests.conftest import Server, short_tmpdir
from zeroserve.broker.client import AsyncClient, Client, InferError
from zeroserve.broker.runtime import cache_dir
from zeroserve.workers.serve import usable_cores
from zeroserve.workers.supervisor import ensure_examples

ROOT = Path(__file__).resolve().parents[2]
POST_LUA = Path(__file__).with_name("post.lua")


TICKS = os.sysconf("SC_CLK_TCK")


def cpu_s(pids: Iterable[int]) -> float:
    """CPU seconds (user + system) the processes have used; one already gone counts 0."""
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / TICKS   # utime, stime
        except (OSError, IndexError):
            pass
    return total


def example_repo(models: dict[str, dict[str, Any]] | None = None) -> Path:
    """A temp copy of the example repository, with config fields overridden per model."""
    src = ensure_examples(cache_dir())
    dst = short_tmpdir("zsbench")
    for name in (models or {"mlp": {}, "cnn": {}}):
        shutil.copytree(src / name, dst / name)
        cfg_path = dst / name / "config.json"
        cfg = json.loads(cfg_path.read_text())
        for key, value in (models or {}).get(name, {}).items():
            if isinstance(value, dict):
                cfg.setdefault(key, {}).update(value)
            else:
                cfg[key] = value
        cfg_path.write_text(json.dumps(cfg))
    return dst


def start(repo: Path, workers: int = 1, threads: int = 0, extra: list[str] | None = None
          ) -> Server:
    # by default the torch threads `zeroserve serve` itself picks: the figures are its own
    args = ["--threads", str(threads or max(1, (usable_cores() - 1) // workers))]
    return Server(repo, workers=workers, extra=args + (extra or [])).wait_ready(120)


def sample(model: str, batch: int = 1) -> np.ndarray:
    shape = {"mlp": (256,), "cnn": (3, 64, 64)}[model]
    return np.random.default_rng(0).standard_normal((batch, *shape)).astype(np.float32)


@dataclass
class Run:
    label: str
    latencies_s: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    duration_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def rps(self) -> float:
        return len(self.latencies_s) / self.duration_s if self.duration_s else 0.0

    def pct(self, q: float) -> float:
        if not self.latencies_s:
            return float("nan")
        return float(np.percentile(self.latencies_s, q)) * 1000

    def row(self) -> str:
        errs = sum(self.errors.values())
        return (f"{self.label:<44} {self.rps:>9.0f} {self.pct(50):>8.2f} {self.pct(90):>8.2f} "
                f"{self.pct(99):>8.2f} {errs:>7}")


HEADER = f"{'':<44} {'req/s':>9} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'errors':>7}"


async def _closed_loop(frontend: str, model: str, x: np.ndarray, concurrency: int,
                       warmup_s: float, duration_s: float, label: str,
                       **kw: Any) -> Run:
    run = Run(label)
    async with AsyncClient(frontend) as client:
        await client.wait_connected(5)
        t_start = time.monotonic()
        t_count = t_start + warmup_s
        t_end = t_count + duration_s

        async def one() -> None:
            while (now := time.monotonic()) < t_end:
                try:
                    await client.infer(model, {"input": x}, **kw)
                    if now >= t_count:
                        run.latencies_s.append(time.monotonic() - now)
                except InferError as exc:
                    if now >= t_count:
                        run.errors[exc.code.value] = run.errors.get(exc.code.value, 0) + 1
        await asyncio.gather(*[one() for _ in range(concurrency)])
        run.duration_s = duration_s
    return run


def direct_load(frontend: str, model: str, concurrency: int, *, warmup_s: float = 3.0,
                duration_s: float = 20.0, label: str = "", **kw: Any) -> Run:
    """Closed loop through the asyncio client: ``concurrency`` requests in flight."""
    return asyncio.run(_closed_loop(frontend, model, sample(model), concurrency, warmup_s,
                                    duration_s, label or f"direct C={concurrency}", **kw))


def v2_body_file(model: str) -> Path:
    x = sample(model)
    body = {"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32",
                        "data": x.reshape(-1).tolist()}]}
    path = Path(tempfile.mkstemp(prefix=f"zs-{model}-", suffix=".json")[1])
    path.write_text(json.dumps(body))
    return path


def wrk_load(url: str, body: Path, concurrency: int, *, warmup_s: float = 3.0,
             duration_s: float = 20.0, label: str = "") -> Run:
    """Closed loop HTTP load from wrk (one thread), the shared post.lua script."""
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is not installed: apt-get install wrk")
    def go(seconds: float) -> dict[str, Any]:
        out = subprocess.run(["wrk", "-t1", f"-c{concurrency}", f"-d{max(1, round(seconds))}s",
                              "--timeout", "30s", "-s", str(POST_LUA), url, "--", str(body)],
                             capture_output=True, text=True, check=True).stdout
        m = re.search(r"WRKJSON (\{.*\})", out)
        assert m, out
        return json.loads(m.group(1))
    if warmup_s:
        go(warmup_s)
    s = go(duration_s)
    run = Run(label or f"http C={concurrency}")
    run.duration_s = s["duration_us"] / 1e6
    errs = s["err_status"] + s["err_timeout"] + s["err_connect"] + s["err_read"]
    if errs:
        run.errors["http"] = errs
    # wrk reports percentiles, not samples: keep them as a three-point distribution
    run.extra = {"p50": s["p50_us"] / 1000, "p90": s["p90_us"] / 1000, "p99": s["p99_us"] / 1000,
                 "rps": (s["requests"] - errs) / run.duration_s}
    return run


def wrk_row(run: Run) -> str:
    e = run.extra
    return (f"{run.label:<44} {e['rps']:>9.0f} {e['p50']:>8.2f} {e['p90']:>8.2f} "
            f"{e['p99']:>8.2f} {sum(run.errors.values()):>7}")


def in_process(model: str, batch_sizes: list[int], threads: int, seconds: float = 2.0
               ) -> dict[int, float]:
    """ms per call of the model called directly (no server), batching off or at ``b``.
    Runs in a child process so this one never holds torch."""
    code = f"""
import json, time, torch
torch.set_num_threads({threads})
m = torch.jit.load({str(ensure_examples(cache_dir()) / model / '1' / 'model.pt')!r})
shape = {{"mlp": (256,), "cnn": (3, 64, 64)}}[{model!r}]
out = {{}}
with torch.inference_mode():
    for b in {batch_sizes!r}:
        x = torch.randn(b, *shape)
        for _ in range(3): m(x)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < {seconds}:
            m(x); n += 1
        out[b] = (time.perf_counter() - t0) / n * 1000
print(json.dumps(out))
"""
    out = subprocess.run([os.sys.executable, "-W", "ignore", "-c", code], capture_output=True,
                         text=True, check=True).stdout
    return {int(k): v for k, v in json.loads(out.strip().splitlines()[-1]).items()}


def broker_metric(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    """Sum of a metric's samples whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        m = re.match(r"([a-zA-Z_:]+)(\{[^}]*\})? ([0-9.e+-]+|NaN)", line)
        if not m or m.group(1) != name:
            continue
        lab = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(lab.get(k) == v for k, v in (labels or {}).items()):
            total += float(m.group(3))
    return total


def evictions(srv: Any) -> int:
    """Models the broker evicted since it started (its metric: the log says one a second)."""
    with Client(srv.control) as ctl:
        text = ctl.control("metrics")["broker"]
    return int(broker_metric(text, "zeroserve_model_evictions_total"))
