"""Binary against JSON request encoding for ``cnn`` (3x64x64 floats, one sample a
request) at concurrency 16, through HTTP, in one run: throughput, p50 and p99 side by
side, with the in-process limit of the same model.

    .venv/bin/python tests/bench/bench_encoding.py [--warmup-s 3] [--measure-s 10]

Starts ``zeroserve serve`` on the bundled examples (built once into
$ZEROSERVE_CACHE_DIR, else ~/.cache/zeroserve) and drives it with wrk
(/usr/bin/wrk) and tests/bench/post.lua. wrk and the server share the machine's cores.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

from tests.bench import harness

HERE = Path(__file__).resolve().parent
LUA = HERE / "post.lua"


def bodies(folder: Path) -> dict[str, tuple[Path, list[str]]]:
    x = np.random.default_rng(0).standard_normal((1, 3, 64, 64)).astype(np.float32)
    meta = {"name": "input", "shape": list(x.shape), "datatype": "FP32"}
    as_json = json.dumps({"inputs": [{**meta, "data": x.reshape(-1).tolist()}]}).encode()
    head = json.dumps({"inputs": [{**meta, "parameters": {
        "binary_data_size": x.nbytes}}]}).encode()
    out = {"json": (folder / "json.body", []),
           "binary": (folder / "binary.body",
                      [f"Inference-Header-Content-Length: {len(head)}"])}
    out["json"][0].write_bytes(as_json)
    out["binary"][0].write_bytes(head + x.tobytes())
    return out


def post(url: str, body: bytes, headers: list[str]) -> dict:
    hdrs = dict(h.split(": ", 1) for h in headers)
    req = urllib.request.Request(url, data=body, method="POST", headers=hdrs)
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def wrk(url: str, body: Path, headers: list[str], seconds: float, conns: int) -> dict:
    cmd = ["wrk", "-t1", f"-c{conns}", f"-d{seconds:g}s", "--timeout", "30s", "-s", str(LUA),
           url, "--", str(body), *headers]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    found = re.search(r"WRKJSON (\{.*\})", out)
    if not found:
        raise RuntimeError(f"no summary from wrk:\n{out}")
    return json.loads(found.group(1))


def in_process(model_dir: Path, threads: int) -> dict[int, float]:
    import torch

    torch.set_num_threads(threads)
    module = torch.jit.load(str(model_dir / "cnn" / "1" / "model.pt")).eval()
    ms = {}
    with torch.inference_mode():
        for batch in (1, 16):
            x = torch.randn(batch, 3, 64, 64)
            for _ in range(3):
                module(x)
            n, start = 0, time.perf_counter()
            while time.perf_counter() - start < 2.0:
                module(x)
                n += 1
            ms[batch] = (time.perf_counter() - start) / n * 1000
    return ms


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warmup-s", type=float, default=3.0)
    ap.add_argument("--measure-s", type=float, default=10.0)
    ap.add_argument("--concurrency", type=int, default=16)
    args = ap.parse_args()
    if not shutil.which("wrk"):
        print("wrk is not installed (Debian package wrk)", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="zsbench", dir="/tmp"))
    srv = harness.start(harness.example_repo({"cnn": {}}))
    url = f"{srv.url}/v2/models/cnn/infer"
    results = {}
    try:
        cases = bodies(work)
        answers = [post(url, path.read_bytes(), headers)["outputs"][0]["data"]
                   for path, headers in cases.values()]
        assert np.allclose(answers[0], answers[1], atol=1e-5), "encodings disagree"
        for name, (path, headers) in cases.items():
            wrk(url, path, headers, args.warmup_s, args.concurrency)
            results[name] = wrk(url, path, headers, args.measure_s, args.concurrency)
            results[name]["body_bytes"] = path.stat().st_size
    finally:
        srv.stop()
    from zeroserve.broker.runtime import cache_dir

    limits = {n: in_process(cache_dir() / "examples", threads=n)
              for n in sorted({1, os.cpu_count() or 1})}
    print(f"cnn, one 3x64x64 FP32 sample per request, HTTP v2 infer, C={args.concurrency}, "
          f"{args.measure_s:g} s after {args.warmup_s:g} s warm-up; wrk and the server "
          f"share {os.cpu_count()} cores (load average {os.getloadavg()[0]:.1f} at the end)")
    print(f"{'encoding':<8} {'body':>9} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'errors':>7}")
    for name, r in results.items():
        errors = sum(v for k, v in r.items() if k.startswith("err_"))
        rps = r["requests"] / (r["duration_us"] / 1e6)
        print(f"{name:<8} {r['body_bytes']:>9} {rps:>8.1f} {r['p50_us'] / 1000:>8.1f} "
              f"{r['p99_us'] / 1000:>8.1f} {errors:>7}")
    for threads, limit in limits.items():
        print(f"in-process limit, {threads} torch thread(s): batch 1 {limit[1]:.1f} ms "
              f"({1000 / limit[1]:.0f} samples/s), batch 16 {limit[16]:.1f} ms "
              f"({16000 / limit[16]:.0f} samples/s)")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
