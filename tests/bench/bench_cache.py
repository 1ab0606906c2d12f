"""A response cache hit against a computed answer, over HTTP at C=1, in one run.

    .venv/bin/python -m tests.bench.bench_cache [--requests N] [--rounds R]

One ``zeroserve serve`` (one worker) holds two copies of the bundled `mlp`: ``mlp``
computes every request, ``mlp_cached`` enables ``response_cache``. One client (a
keep-alive connection, Triton's JSON body, the same input every time) sends requests
one at a time, in rounds that alternate between the two, so both see the same (shared)
machine; the p50 of each over all rounds is printed beside the model's in-process time
(batch 1, one thread) and the statistics' ``cache_hit`` / ``cache_miss`` counts.

The goal (issue 33): a hit answered at least 2x faster than a computed answer of mlp at
C=1 over HTTP. The client shares the machine's cores with the server.
"""

from __future__ import annotations

import argparse
import http.client
import json
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from tests.bench.harness import example_repo, sample, start
from tests.conftest import Server


def cached_copy(repo: Path) -> None:
    """``mlp_cached``: mlp's files under another name, with the response cache on."""
    shutil.copytree(repo / "mlp", repo / "mlp_cached")
    path = repo / "mlp_cached" / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(name="mlp_cached", response_cache={"enable": True})
    path.write_text(json.dumps(cfg))


def round_ms(conn: http.client.HTTPConnection, model: str, body: bytes, n: int
             ) -> list[float]:
    took = []
    for _ in range(n):
        t = time.perf_counter()
        conn.request("POST", f"/v2/models/{model}/infer", body,
                      {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        took.append((time.perf_counter() - t) * 1000)
        if resp.status != 200:
            raise RuntimeError(f"{model}: {resp.status} {data[:200]!r}")
    return took


def in_process_ms(repo: Path, n: int = 2000) -> float:
    import torch

    torch.set_num_threads(1)
    module = torch.jit.load(str(repo / "mlp" / "1" / "model.pt"))
    x = torch.from_numpy(sample("mlp"))
    took = []
    with torch.inference_mode():
        for i in range(n + 200):
            t = time.perf_counter()
            module(x)
            if i >= 200:
                took.append((time.perf_counter() - t) * 1000)
    return statistics.median(took)


def statistics_of(srv: Server, model: str) -> dict[str, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
    conn.request("GET", f"/v2/models/{model}/stats")
    doc = json.loads(conn.getresponse().read())
    conn.close()
    st = doc["model_stats"][0]
    return {"cache_hit": st["inference_stats"]["cache_hit"]["count"],
            "cache_miss": st["inference_stats"]["cache_miss"]["count"],
            "execution_count": st["execution_count"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=500, help="per model and round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=200, help="per model, not counted")
    ap.add_argument("--json", default=None, help="write the figures to this file")
    args = ap.parse_args()

    repo = example_repo({"mlp": {}})
    cached_copy(repo)
    srv = start(repo)
    try:
        x = sample("mlp")
        body = json.dumps({"inputs": [{"name": "input", "shape": list(x.shape),
                                       "datatype": "FP32",
                                       "data": x.reshape(-1).tolist()}]}).encode()
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
        for model in ("mlp", "mlp_cached"):
            round_ms(conn, model, body, args.warmup)
        times: dict[str, list[float]] = {"mlp": [], "mlp_cached": []}
        for r in range(args.rounds):
            for model in (("mlp", "mlp_cached") if r % 2 == 0 else ("mlp_cached", "mlp")):
                times[model] += round_ms(conn, model, body, args.requests)
        conn.close()
        counts = {m: statistics_of(srv, m) for m in times}
    finally:
        srv.stop()
    local_ms = in_process_ms(repo)
    shutil.rmtree(repo, ignore_errors=True)

    p50 = {m: statistics.median(t) for m, t in times.items()}
    p99 = {m: sorted(t)[int(len(t) * 0.99)] for m, t in times.items()}
    figures = {"computed_p50_ms": p50["mlp"], "computed_p99_ms": p99["mlp"],
               "hit_p50_ms": p50["mlp_cached"], "hit_p99_ms": p99["mlp_cached"],
               "speedup_p50": p50["mlp"] / p50["mlp_cached"],
               "in_process_batch1_ms": local_ms, "requests_each": len(times["mlp"]),
               "statistics": counts}
    print(f"mlp over HTTP, C=1, {len(times['mlp'])} requests each, {args.rounds} rounds")
    print(f"  computed (mlp)           p50 {p50['mlp']:.3f} ms   p99 {p99['mlp']:.3f} ms")
    print(f"  cache hit (mlp_cached)   p50 {p50['mlp_cached']:.3f} ms   "
          f"p99 {p99['mlp_cached']:.3f} ms")
    print(f"  hit speedup at p50       {figures['speedup_p50']:.2f}x (goal: >= 2x)")
    print(f"  in-process mlp, batch 1  {local_ms:.3f} ms")
    print(f"  statistics               {json.dumps(counts)}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
