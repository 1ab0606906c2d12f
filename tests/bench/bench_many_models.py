"""Load on demand, in one run: the wait of a request for a model that is not loaded, per
model size, beside the model's load in this process; and requests/s for a Zipf workload
over 12 models on a budget that holds 4, beside the same workload with all 12 loaded.

    .venv/bin/python -m tests.bench.bench_many_models [--cold N] [--seconds S]

Cold loads: per size, one ``zeroserve serve`` (one worker, ``--load-on-demand``) on a
budget that holds one or two models of that size, asked in turn for three of them at
C=1, so every request waits for a load (the previous model is evicted for it); its
latency is the cold-load wait. Beside it: ``torch.jit.load`` and a first batch of the
same file in this process.

Zipf: 12 models of 8 MB, each request's model drawn from Zipf(``--zipf``) (model k with
weight 1/k^s) at C=``--concurrency`` through the direct client, for ``--seconds`` after
a warm-up: first with no budget and all 12 loaded, then with ``--load-on-demand`` on a
budget that holds 4 of them as that first run's worker measured them (its context, the
4 largest footprints, and half the median: never a fifth; on a CPU a footprint is the
resident memory a load added, 8.3-10.9 MB for these 8 MB of weights, so a budget from
the weights alone held 3 or 4). The goal (issue 33): at least 80% of the all-loaded
throughput with Zipf(1.1) at C=16.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from tests.bench import harness
from tests.bench.harness import start
from tests.conftest import Server, linear_config, short_tmpdir, write_model
from zeroserve.broker.client import AsyncClient, Client, InferError

X = np.ones((1, 4), np.float32)
OVERHEAD_BYTES = 600_000      # what a loaded model holds beyond its weights, measured
# hidden width -> weights: 4 x h + h x h/2 + h/2 x 3 floats
SIZES = {"2 MB": 1000, "8 MB": 2000, "32 MB": 4000}


def factory(ident: int, hidden: int) -> str:
    """A model whose every output is its own number, with weights to place."""
    return (f"(lambda s: (nn.init.zeros_(s[-1].weight), nn.init.constant_(s[-1].bias, "
            f"{ident}.0), s)[-1])(nn.Sequential(nn.Linear(4, {hidden}), "
            f"nn.Linear({hidden}, {hidden // 2}), nn.Linear({hidden // 2}, 3)))")


def weights_bytes(hidden: int) -> int:
    return 4 * (4 * hidden + hidden + hidden * (hidden // 2) + hidden // 2
                + (hidden // 2) * 3 + 3)


def repo_of(count: int, hidden: int) -> Path:
    repo = short_tmpdir("zsbench")
    for i in range(count):
        write_model(repo, f"m{i}", 1, factory(i, hidden), linear_config(f"m{i}"))
    return repo


def worker_device() -> str:
    """Where a ``zeroserve serve`` worker on this host runs when not told."""
    import torch

    return "cuda:0" if torch.cuda.is_available() else "cpu"


def in_process_load_ms(path: Path, n: int = 5) -> float:
    import torch

    torch.set_num_threads(1)
    device = worker_device()
    took = []
    for _ in range(n):
        t = time.perf_counter()
        module = torch.jit.load(str(path), map_location=device)
        with torch.inference_mode():
            module(torch.from_numpy(X).to(device)).cpu()
        took.append((time.perf_counter() - t) * 1000)
    return statistics.median(took)


def context_bytes() -> int:
    """A worker's context on this host's device, measured here the way its worker does."""
    import torch

    from zeroserve.workers.memory import context_cost

    torch.set_num_threads(1)
    return int(context_cost(worker_device())["context_bytes"])


def budget_for(models: float, hidden: int, context: int) -> int:
    return context + int(models * (weights_bytes(hidden) + OVERHEAD_BYTES))


def cold_waits(label: str, hidden: int, count: int, context: int) -> dict[str, Any]:
    repo = repo_of(3, hidden)
    budget = budget_for(1.5, hidden, context)
    # the thrash bounds off: this is the wait for a load, not for a residency to end (the
    # first loads, from disk, would hold each model 5 times their 25-80 ms)
    srv = start(repo, threads=1, extra=["--load-on-demand", "--memory-budget", str(budget),
                                        "--load-on-demand-min-residency-s", "0",
                                        "--load-on-demand-residency-factor", "0"])
    waits: list[float] = []
    try:
        with Client(srv.frontend, timeout_s=60) as c:
            for i in range(count + 3):
                name = f"m{i % 3}"
                t = time.perf_counter()
                res = c.infer(name, {"input": X}, timeout_ms=60_000)
                if i >= 3:   # the first three are the first loads of each file
                    waits.append((time.perf_counter() - t) * 1000)
                assert res.outputs["output"][0, 0] == float(name[1:])
            log = srv.log()
            evictions = harness.evictions(srv)
            # the worker's own load and warm-up, as its log says: the rest of the wait
            # is the broker's, the messages' and the unload of the model evicted for it
            worker_s = [float(s) for s in re.findall(r"loaded m\d/1 \(sha256 \w+, "
                                                     r"[\d.]+ MB, ([\d.]+)s\)", log)]
    finally:
        srv.stop()
    local = in_process_load_ms(repo / "m0" / "1" / "model.pt")
    shutil.rmtree(repo, ignore_errors=True)
    waits.sort()
    return {"size": label, "weights_bytes": weights_bytes(hidden),
            "wait_p50_ms": statistics.median(waits),
            "wait_p99_ms": waits[min(len(waits) - 1, int(len(waits) * 0.99))],
            "in_process_load_ms": local, "cold_requests": len(waits),
            "worker_load_p50_ms": 1000 * statistics.median(worker_s) if worker_s else None,
            "evictions": evictions}


async def zipf_load(frontend: str, names: list[str], s: float, concurrency: int,
                    warmup_s: float, seconds: float) -> dict[str, Any]:
    weights = 1.0 / np.arange(1, len(names) + 1) ** s
    weights /= weights.sum()
    done, errors, wrong = 0, 0, 0
    why: dict[str, str] = {}
    async with AsyncClient(frontend) as client:
        assert await client.wait_connected(10)
        start_s = time.monotonic()
        count_from, end = start_s + warmup_s, start_s + warmup_s + seconds

        async def lane(seed: int) -> None:
            nonlocal done, errors, wrong
            rng = np.random.default_rng(seed)
            while (now := time.monotonic()) < end:
                name = names[int(rng.choice(len(names), p=weights))]
                try:
                    res = await client.infer(name, {"input": X}, timeout_ms=60_000)
                    ok = res.outputs["output"][0, 0] == float(name[1:])
                    if now >= count_from:
                        done += 1
                        wrong += int(not ok)
                except InferError as exc:
                    why.setdefault(exc.code.value, str(exc)[:300])
                    if now >= count_from:
                        errors += 1
        await asyncio.gather(*(lane(i) for i in range(concurrency)))
    return {"rps": done / seconds, "requests": done, "errors": errors, "wrong": wrong,
            "error_kinds": why}


def budget_holding(status: dict[str, Any], models: int) -> tuple[int, list[int]]:
    """A budget that holds ``models`` of the models the status's worker measured, never
    one more: its context, the largest footprints, and half the median."""
    [plan] = status["memory_plan"].values()
    sizes = sorted((int(m["measured_bytes"]) for m in plan["models"].values()), reverse=True)
    return (int(plan["context_bytes"]) + sum(sizes[:models]) + int(statistics.median(sizes))
            // 2, sizes)


def zipf_run(budget: int, args: argparse.Namespace) -> dict[str, Any]:
    """``budget``: load on demand within it; 0: every model loaded, no budget."""
    on_demand = bool(budget)
    repo = repo_of(12, SIZES["8 MB"])
    extra = ["--load-on-demand", "--memory-budget", str(budget)] if on_demand else []
    if on_demand and args.min_residency_s is not None:
        extra += ["--load-on-demand-min-residency-s", str(args.min_residency_s)]
    if on_demand and args.residency_factor is not None:
        extra += ["--load-on-demand-residency-factor", str(args.residency_factor)]
    if on_demand and args.max_load_share is not None:
        extra += ["--load-on-demand-max-load-share", str(args.max_load_share)]
    srv: Server = start(repo, extra=extra)
    try:
        names = [f"m{i}" for i in range(12)]
        if not on_demand:   # every model warm before the clock starts
            with Client(srv.frontend, timeout_s=60) as c:
                for name in names:
                    c.infer(name, {"input": X})
        got = asyncio.run(zipf_load(srv.frontend, names, args.zipf, args.concurrency,
                                    args.warmup_s, args.seconds))
        with Client(srv.control, timeout_s=10) as c:
            status = c.control("status")
        got["status"] = status
        got["held_at_end"] = len(status["workers"][0]["models"])
        od = status.get("load_on_demand") or {}
        got["loads_last_minute"] = od.get("loads_last_minute", 0)
        got["load_s_last_minute"] = od.get("load_s_last_minute", 0.0)
    finally:
        srv.stop()
    shutil.rmtree(repo, ignore_errors=True)
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cold", type=int, default=20, help="cold requests per model size")
    ap.add_argument("--seconds", type=float, default=20.0, help="each Zipf run, measured")
    ap.add_argument("--rounds", type=int, default=3,
                    help="Zipf rounds, each all loaded then on demand; the median ratio")
    ap.add_argument("--warmup-s", type=float, default=3.0)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--budget-models", type=int, default=4,
                    help="how many of the 12 the on-demand run's budget holds")
    ap.add_argument("--skip-cold", action="store_true", help="the Zipf runs only")
    ap.add_argument("--min-residency-s", type=float, default=None,
                    help="--load-on-demand-min-residency-s of the on-demand Zipf run "
                         "(default: the server's)")
    ap.add_argument("--residency-factor", type=float, default=None,
                    help="--load-on-demand-residency-factor of the on-demand Zipf run "
                         "(default: the server's)")
    ap.add_argument("--max-load-share", type=float, default=None,
                    help="--load-on-demand-max-load-share of the on-demand Zipf run "
                         "(default: the server's)")
    ap.add_argument("--json", default=None, help="write the figures to this file")
    args = ap.parse_args()

    context = context_bytes()
    cold = [] if args.skip_cold else [cold_waits(label, hidden, args.cold, context)
                                      for label, hidden in SIZES.items()]
    print(f"cold-load wait, C=1, {args.cold} requests per size, each one waiting a load")
    print(f"  {'size':<7} {'p50 ms':>8} {'p99 ms':>8} {'worker load p50 ms':>19} "
          f"{'in-process load ms':>19}")
    for row in cold:
        print(f"  {row['size']:<7} {row['wait_p50_ms']:>8.1f} {row['wait_p99_ms']:>8.1f} "
              f"{row['worker_load_p50_ms'] or float('nan'):>19.1f} "
              f"{row['in_process_load_ms']:>19.1f}")
    rounds = []   # all loaded then on demand, back to back: this host's speed swings by
    # half between minutes, so a ratio is only fair within a round
    for _ in range(args.rounds):
        loaded = zipf_run(0, args)
        budget, sizes = budget_holding(loaded.pop("status"), args.budget_models)
        lazy = zipf_run(budget, args)
        lazy.pop("status")
        rounds.append((lazy, loaded, budget, sizes))
    print(f"Zipf({args.zipf}) over 12 models of 8 MB, C={args.concurrency}, "
          f"{args.seconds:g} s each, {args.rounds} round(s)")
    ratios = []
    for i, (lazy, loaded, budget, sizes) in enumerate(rounds, 1):
        ratio = lazy["rps"] / loaded["rps"] if loaded["rps"] else 0.0
        ratios.append(ratio)
        print(f" round {i}: footprints measured {sizes[-1] / 1e6:.1f}-{sizes[0] / 1e6:.1f} "
              f"MB, a budget of {budget / 1e6:.1f} MB holds {args.budget_models}")
        for label, got in ((f"{args.budget_models}-model budget, on demand", lazy),
                           ("all 12 loaded", loaded)):
            print(f"  {label:<26} {got['rps']:>8.0f} req/s  errors {got['errors']}  "
                  f"wrong {got['wrong']}  held at end {got['held_at_end']}  "
                  f"loads in the last minute {got['loads_last_minute']} "
                  f"({got['load_s_last_minute']:g} s predicted)")
            for code, text in got["error_kinds"].items():
                print(f"    {code}: {text}")
        print(f"  on demand / all loaded     {100 * ratio:.0f}%")
    print(f"on demand / all loaded: median {100 * statistics.median(ratios):.0f}% "
          f"({100 * min(ratios):.0f}-{100 * max(ratios):.0f}%) (goal: >= 80%)")
    if args.json:
        Path(args.json).write_text(json.dumps({"cold": cold, "rounds": [
            {"zipf_on_demand": lazy, "zipf_all_loaded": loaded, "budget": budget,
             "footprints": sizes, "ratio": lazy["rps"] / loaded["rps"]}
            for lazy, loaded, budget, sizes in rounds]}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
