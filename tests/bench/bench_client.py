#!/usr/bin/env python3
"""Benchmark: the direct ZeroMQ client against HTTP (wrk) on ``mlp``, at concurrency 1
and 64 in one run, beside the in-process call of the same model.

    python tests/bench/bench_client.py [--warmup-s 3] [--duration-s 10] [--workers 1]

It starts ``zeroserve serve`` (the example models are built into $ZEROSERVE_CACHE_DIR
on first use), measures, stops the server and prints one table and one JSON line.
The load generators share the host's cores with the server: say so beside figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from tests.bench import harness
from zeroserve.broker.client import AsyncClient, Client, InferError
from zeroserve.broker.runtime import cache_dir

POST_LUA = Path(__file__).resolve().parent / "post.lua"
X = np.random.default_rng(0).standard_normal((1, 256)).astype(np.float32)


def summary(lat_s: list[float], seconds: float, errors: int) -> dict[str, Any]:
    a = np.asarray(lat_s) * 1000.0 if lat_s else np.zeros(1)
    return {"rps": round(len(lat_s) / seconds, 1), "p50_ms": round(float(np.percentile(a, 50)), 3),
            "p99_ms": round(float(np.percentile(a, 99)), 3), "errors": errors}


def in_process(model_file: Path, batch: int, seconds: float = 2.0) -> dict[str, Any]:
    import torch
    torch.set_num_threads(1)
    module = torch.jit.load(str(model_file)).eval()
    x = torch.from_numpy(np.repeat(X, batch, axis=0))
    with torch.inference_mode():
        for _ in range(20):
            module(x)
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            module(x)
            n += 1
        took = time.perf_counter() - start
    return {"batch": batch, "ms_per_call": round(took / n * 1000, 3),
            "samples_per_s": round(n * batch / took, 1)}


def direct_c1(frontend: str, warmup_s: float, duration_s: float) -> dict[str, Any]:
    lat: list[float] = []
    errors = 0
    with Client(frontend, timeout_s=30) as c:
        end_warm = time.perf_counter() + warmup_s
        while time.perf_counter() < end_warm:
            c.infer("mlp", {"input": X})
        start = time.perf_counter()
        while (t0 := time.perf_counter()) - start < duration_s:
            try:
                c.infer("mlp", {"input": X})
                lat.append(time.perf_counter() - t0)
            except InferError:
                errors += 1
        return summary(lat, time.perf_counter() - start, errors)


def ping_c1(frontend: str, duration_s: float) -> dict[str, Any]:
    """The messaging floor: PING -> PONG through the broker's frontend, no model work."""
    import zmq

    from zeroserve.broker import protocol as p
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(frontend)
    lat: list[float] = []
    try:
        start = time.perf_counter()
        while (t0 := time.perf_counter()) - start < duration_s:
            sock.send_multipart(p.encode(p.Ping()))
            if not sock.poll(5000):
                raise SystemExit("no PONG from the broker")
            sock.recv_multipart()
            lat.append(time.perf_counter() - t0)
        return summary(lat, time.perf_counter() - start, 0)
    finally:
        sock.close(linger=0)


def _direct_part(frontend: str, concurrency: int, warmup_s: float,
                 duration_s: float) -> tuple[list[float], int]:
    return asyncio.run(direct_many(frontend, concurrency, warmup_s, duration_s))


def direct_procs(frontend: str, concurrency: int, procs: int, warmup_s: float,
                 duration_s: float) -> dict[str, Any]:
    """``concurrency`` tasks spread over ``procs`` client processes (one Python client
    process saturates a core before the server does)."""
    import multiprocessing
    share = [concurrency // procs + (i < concurrency % procs) for i in range(procs)]
    with multiprocessing.get_context("spawn").Pool(procs) as pool:
        parts = pool.starmap(_direct_part, [(frontend, n, warmup_s, duration_s)
                                            for n in share])
    lat = [x for part, _ in parts for x in part]
    return {**summary(lat, duration_s, sum(e for _, e in parts)), "procs": procs}


async def direct_many(frontend: str, concurrency: int, warmup_s: float,
                      duration_s: float) -> tuple[list[float], int]:
    lat: list[float] = []
    errors = 0
    async with AsyncClient(frontend) as ac:
        assert await ac.wait_connected(5)
        t_warm = time.perf_counter() + warmup_s
        t_end = t_warm + duration_s

        async def loop() -> None:
            nonlocal errors
            while (t0 := time.perf_counter()) < t_end:
                try:
                    await ac.infer("mlp", {"input": X})
                except InferError:
                    errors += t0 >= t_warm
                    continue
                if t0 >= t_warm:
                    lat.append(time.perf_counter() - t0)

        await asyncio.gather(*[loop() for _ in range(concurrency)])
    return lat, errors


def wrk(url: str, concurrency: int, seconds: float, body: Path) -> dict[str, Any]:
    out = subprocess.run(["wrk", "-t1", f"-c{concurrency}", f"-d{max(1, round(seconds))}s",
                          "--timeout", "30s", "-s", str(POST_LUA), url, "--", str(body)],
                         capture_output=True, text=True, check=True)
    line = next(x for x in out.stdout.splitlines() if x.startswith("WRKJSON "))
    doc = json.loads(line[len("WRKJSON "):])
    errors = sum(doc[k] for k in doc if k.startswith("err_"))
    return {"rps": round(doc["requests"] / (doc["duration_us"] / 1e6), 1),
            "p50_ms": doc["p50_us"] / 1000.0, "p99_ms": doc["p99_us"] / 1000.0,
            "errors": errors}


def http(url: str, concurrency: int, warmup_s: float, duration_s: float,
         body: Path) -> dict[str, Any]:
    wrk(url, concurrency, warmup_s, body)
    return wrk(url, concurrency, duration_s, body)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--warmup-s", type=float, default=3.0)
    ap.add_argument("--duration-s", type=float, default=10.0)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--procs", type=int, default=2,
                    help="client processes for the direct client above C=1")
    args = ap.parse_args()
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is not installed (Debian: apt-get install wrk)")
    levels = [int(c) for c in args.concurrency.split(",")]
    srv = harness.start(harness.example_repo({"mlp": {}}), workers=args.workers)
    results: dict[str, Any] = {"cores": os.cpu_count(), "workers": args.workers}
    try:
        frontend = srv.frontend
        body = srv.runtime / "mlp.json"
        body.write_text(json.dumps({"inputs": [{"name": "input", "shape": [1, 256],
                                                "datatype": "FP32",
                                                "data": X.ravel().tolist()}]}))
        url = f"{srv.url}/v2/models/mlp/infer"
        results["ping_c1"] = ping_c1(frontend, min(3.0, args.duration_s))
        for c in levels:
            results[f"direct_c{c}"] = (direct_c1(frontend, args.warmup_s, args.duration_s)
                                       if c == 1 else direct_procs(
                                           frontend, c, args.procs, args.warmup_s,
                                           args.duration_s))
            results[f"http_c{c}"] = http(url, c, args.warmup_s, args.duration_s, body)
    finally:
        srv.stop()
    model_file = cache_dir() / "examples" / "mlp" / "1" / "model.pt"
    results["in_process"] = [in_process(model_file, b) for b in (1, 64)]
    print_table(results, levels)
    print("BENCHJSON " + json.dumps(results, sort_keys=True))
    return 0


def print_table(results: dict[str, Any], levels: list[int]) -> None:
    print(f"mlp, {results['workers']} worker(s), {results['cores']} cores shared by server "
          "and load generators")
    print(f"{'path':<18} {'rps':>9} {'p50 ms':>8} {'p99 ms':>8} {'errors':>7}")
    r = results["ping_c1"]
    print(f"{'ping C=1 (floor)':<18} {r['rps']:>9.1f} {r['p50_ms']:>8.3f} {r['p99_ms']:>8.3f}")
    for c in levels:
        for path in ("direct", "http"):
            r = results[f"{path}_c{c}"]
            print(f"{f'{path} C={c}':<18} {r['rps']:>9.1f} {r['p50_ms']:>8.3f} "
                  f"{r['p99_ms']:>8.3f} {r['errors']:>7}")
    for r in results["in_process"]:
        print(f"{'in-process b=' + str(r['batch']):<18} {r['samples_per_s']:>9.1f} "
              f"{r['ms_per_call']:>8.3f} {'(samples/s, ms/call)':>17}")


if __name__ == "__main__":
    sys.exit(main())
