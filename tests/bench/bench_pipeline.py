"""A Triton ensemble run by the broker against the same three models chained by the
client, and against one Python handler doing all three in-process, in one run.

    .venv/bin/python -m tests.bench.bench_pipeline [--seconds S] [--levels 1,64]

One ``zeroserve serve`` (one worker) holds ``pre`` (Python: x*2+1), ``mlp`` (the bundled
TorchScript MLP), ``post`` (Python: softmax), ``pipe`` (the ensemble of the three) and
``whole`` (one Python handler doing the three in-process). At each concurrency, closed
loops over keep-alive HTTP (v2 JSON) run, one after the other:

- ``ensemble``: one request to ``pipe``;
- ``client-chained``: ``pre``, then ``mlp``, then ``post``, each answer decoded and sent
  on by the client;
- ``one handler``: one request to ``whole``;
- at C=1 also each model alone (``direct``), to compare what a step adds with what a
  direct request adds over its model's in-process time.

Printed beside them: the models' in-process times (batch 1, this process) and the
broker's CPU per request and per step (at C=1 mostly the broker's idle loop, spread over
few requests; at C=64 beside a direct request to ``mlp`` at the same concurrency).
The goals (issue 31): the ensemble's throughput at C=64 at least the client-chained
one's; at C=1 each step adding no more than one direct request adds over its model. The
client shares the machine's cores with the server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from zeroserve.broker.bench.http import HttpConnection, Url, request_bytes
from tests.bench.harness import HEADER, Run, cpu_s, example_repo, start

PRE = '''
class Model:
    def load(self, version_dir, device):
        pass

    def predict(self, inputs):
        return {"y": inputs["x"] * 2 + 1}
'''
POST = '''
import torch


class Model:
    def load(self, version_dir, device):
        pass

    def predict(self, inputs):
        return {"probs": torch.softmax(inputs["logits"], dim=1)}
'''
WHOLE = '''
from pathlib import Path

import torch


class Model:
    def load(self, version_dir, device):
        self.net = torch.jit.load(str(Path(version_dir) / "net.pt"), map_location=device)

    def predict(self, inputs):
        return {"OUT": torch.softmax(self.net(inputs["RAW"] * 2 + 1), dim=1)}
'''


def tensors(pairs: dict[str, int]) -> list[dict[str, Any]]:
    return [{"name": n, "datatype": "FP32", "shape": [d]} for n, d in pairs.items()]


def handler(repo: Path, name: str, code: str, ins: dict[str, int], outs: dict[str, int]
            ) -> Path:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(code)
    (repo / name / "config.json").write_text(json.dumps({
        "name": name, "platform": "python", "max_batch_size": 64,
        "inputs": tensors(ins), "outputs": tensors(outs)}))
    return repo / name / "1"


def make_repo() -> Path:
    repo = example_repo({"mlp": {}})
    handler(repo, "pre", PRE, {"x": 256}, {"y": 256})
    handler(repo, "post", POST, {"logits": 10}, {"probs": 10})
    vdir = handler(repo, "whole", WHOLE, {"RAW": 256}, {"OUT": 10})
    shutil.copy(repo / "mlp" / "1" / "model.pt", vdir / "net.pt")
    steps = [{"model_name": "pre", "model_version": -1, "input_map": {"x": "RAW"},
              "output_map": {"y": "pre_out"}},
             {"model_name": "mlp", "model_version": -1, "input_map": {"input": "pre_out"},
              "output_map": {"output": "logits"}},
             {"model_name": "post", "model_version": -1, "input_map": {"logits": "logits"},
              "output_map": {"probs": "OUT"}}]
    (repo / "pipe" / "1").mkdir(parents=True)
    (repo / "pipe" / "config.json").write_text(json.dumps({
        "name": "pipe", "platform": "ensemble", "max_batch_size": 64,
        "inputs": tensors({"RAW": 256}), "outputs": tensors({"OUT": 10}),
        "ensemble_scheduling": {"step": steps}}))
    return repo


def body(name: str, x: list[float]) -> bytes:
    return json.dumps({"inputs": [{"name": name, "shape": [1, len(x)], "datatype": "FP32",
                                   "data": x}]}).encode()


CHAIN = [("pre", "x", "y"), ("mlp", "input", "output"), ("post", "logits", "probs")]


async def _one_chain(conn: HttpConnection, url: Url, x: list[float]) -> None:
    data = x
    for model, inp, _ in CHAIN:
        resp = await conn.send(request_bytes(url, "POST", f"/v2/models/{model}/infer",
                                             body(inp, data),
                                             {"Content-Type": "application/json"}))
        if resp.status != 200:
            raise RuntimeError(f"{model}: {resp.status} {resp.body[:200]!r}")
        data = json.loads(resp.body)["outputs"][0]["data"]


async def _closed(url: Url, label: str, concurrency: int, warmup_s: float, seconds: float,
                  model: str | None, x: list[float], input_name: str = "RAW") -> Run:
    run = Run(label)
    conns = [await HttpConnection.open(url) for _ in range(concurrency)]
    raw = request_bytes(url, "POST", f"/v2/models/{model}/infer", body(input_name, x),
                        {"Content-Type": "application/json"}) if model else b""
    t_count = time.monotonic() + warmup_s
    t_end = t_count + seconds

    async def loop(conn: HttpConnection) -> None:
        while (now := time.monotonic()) < t_end:
            if model is None:
                await _one_chain(conn, url, x)
            else:
                resp = await conn.send(raw)
                if resp.status != 200:
                    raise RuntimeError(f"{model}: {resp.status} {resp.body[:200]!r}")
            if now >= t_count:
                run.latencies_s.append(time.monotonic() - now)
    await asyncio.gather(*[loop(c) for c in conns])
    for c in conns:
        c.close()
    run.duration_s = seconds
    return run


def in_process_ms(repo: Path, n: int = 2000) -> dict[str, float]:
    import torch

    torch.set_num_threads(1)
    net = torch.jit.load(str(repo / "mlp" / "1" / "model.pt"))
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((1, 256)).astype(np.float32))
    fns = {"pre": lambda: x * 2 + 1, "mlp": lambda: net(x),
           "post": lambda: torch.softmax(net(x), dim=1)}
    out = {}
    with torch.inference_mode():
        for name, fn in fns.items():
            took = []
            for i in range(n + 200):
                t = time.perf_counter()
                fn()
                if i >= 200:
                    took.append((time.perf_counter() - t) * 1000)
            out[name] = statistics.median(took)
    out["post"] = max(0.0, out["post"] - out["mlp"])   # softmax alone
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=4.0, help="per mode and level")
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--levels", default="1,64")
    ap.add_argument("--json", default=None, help="write the figures to this file")
    args = ap.parse_args()
    levels = [int(c) for c in args.levels.split(",")]

    repo = make_repo()
    srv = start(repo)
    url = Url.parse(srv.url)
    x = np.random.default_rng(0).standard_normal(256).astype(np.float32).tolist()
    broker = srv.pids("broker")
    rows: list[Run] = []
    try:
        for c in levels:
            modes: list[tuple[str, str | None, str]] = [
                ("ensemble", "pipe", "RAW"), ("client-chained", None, "RAW"),
                ("one handler", "whole", "RAW")]
            # each model alone at C=1 (what a direct request adds); the model at every
            # level (the broker's CPU for a direct request beside one for a step)
            modes += [(f"direct {m}", m, inp) for m, inp, _ in CHAIN if c == 1 or m == "mlp"]
            for label, model, inp in modes:
                data = x if model != "post" else x[:10]
                before = cpu_s(broker)
                run = asyncio.run(_closed(url, f"{label} C={c}", c, args.warmup, args.seconds,
                                          model, data, inp))
                spent = cpu_s(broker) - before
                total = run.rps * args.seconds + run.rps * args.warmup   # about
                run.extra["broker_cpu_us_per_request"] = spent / max(total, 1) * 1e6
                rows.append(run)
    finally:
        srv.stop()
    local = in_process_ms(repo)
    shutil.rmtree(repo, ignore_errors=True)

    print(f"{HEADER} {'broker us/req':>14}")
    for run in rows:
        print(f"{run.row()} {run.extra['broker_cpu_us_per_request']:>14.1f}")
    print("in-process, batch 1, one thread: " + ", ".join(
        f"{k} {v:.3f} ms" for k, v in local.items()))
    by = {r.label: r for r in rows}
    figures: dict[str, Any] = {r.label: {"rps": r.rps, "p50_ms": r.pct(50),
                                         "p99_ms": r.pct(99), **r.extra} for r in rows}
    figures["in_process_ms"] = local
    if "ensemble C=1" in by:
        models_ms = sum(local.values())
        step_ms = (by["ensemble C=1"].pct(50) - models_ms) / len(CHAIN)
        direct_ms = statistics.mean(by[f"direct {m} C=1"].pct(50) - local[m]
                                    for m, _, _ in CHAIN)
        per_step_cpu = by["ensemble C=1"].extra["broker_cpu_us_per_request"] / len(CHAIN)
        print(f"C=1: the ensemble adds {step_ms:.3f} ms a step over its models; a direct "
              f"request adds {direct_ms:.3f} ms over its model (goal: the first <= the "
              f"second); broker CPU {per_step_cpu:.1f} us a step")
        figures.update(step_overhead_ms=step_ms, direct_overhead_ms=direct_ms,
                       broker_cpu_us_per_step=per_step_cpu)
    for c in levels:
        if c > 1:
            ratio = by[f"ensemble C={c}"].rps / max(by[f"client-chained C={c}"].rps, 1e-9)
            step_us = by[f"ensemble C={c}"].extra["broker_cpu_us_per_request"] / len(CHAIN)
            direct_us = by[f"direct mlp C={c}"].extra["broker_cpu_us_per_request"]
            print(f"C={c}: ensemble / client-chained throughput {ratio:.2f} (goal >= 1); "
                  f"broker CPU {step_us:.1f} us a step, {direct_us:.1f} us a direct request")
            figures[f"ensemble_over_chained_C{c}"] = ratio
            figures[f"broker_cpu_us_per_step_C{c}"] = step_us
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
