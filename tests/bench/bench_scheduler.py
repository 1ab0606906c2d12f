"""Dynamic batching by priority and deadline, measured (issue: the scheduler).

1. mlp at C=64: with batching, with max_batch_size 1, and the in-process limit at the
   batch sizes formed.
2. cnn overloaded at about 2x capacity, two priorities sharing a 50 ms timeout: per
   priority the goodput (answered within the deadline) and what was shed, and the
   requests executed after their deadline (must be 0).
3. Idle path: a lone request's p50, scheduler (priorities + deadlines) against a FIFO
   (one priority level, no deadlines) and against a fixed 5 ms batching delay.
4. One bursty arrival trace on cnn under the scheduler and under a fixed-delay
   batcher (max_queue_delay_ms 5, no latency model): goodput and p99 side by side.

    .venv/bin/python -m tests.bench.bench_scheduler [--seconds 20]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time
from typing import Any

from tests.bench import harness as h
from zeroserve.broker.client import AsyncClient, Client, InferError

THREADS = max(1, (os.cpu_count() or 1) - 1)  # what zeroserve serve picks


def batch_stats(srv: Any, model: str) -> tuple[float, float]:
    with Client(srv.control) as ctl:
        text = ctl.control("metrics")["broker"]
    n = h.broker_metric(text, "zeroserve_inference_batch_size_count", {"model": model})
    s = h.broker_metric(text, "zeroserve_inference_batch_size_sum", {"model": model})
    return (s / n if n else 0.0), n


def worker_expired(srv: Any) -> float:
    with Client(srv.control) as ctl:
        workers = ctl.control("metrics")["workers"]
    return sum(h.broker_metric(t, "zeroserve_worker_expired_requests_total")
               for t in workers.values())


def part1(seconds: float, warmup: float) -> None:
    print("\n== 1. mlp, closed loop C=64, direct client ==")
    rows = []
    formed = {}
    for label, mbs in (("batching (max_batch_size 64)", 64), ("max_batch_size 1", 1)):
        srv = h.start(h.example_repo({"mlp": {"max_batch_size": mbs}}), threads=THREADS)
        try:
            rows.append(h.direct_load(srv.frontend, "mlp", 64, warmup_s=warmup,
                                      duration_s=seconds, label=label))
            formed[label] = batch_stats(srv, "mlp")[0]
        finally:
            srv.stop()
    sizes = sorted({1, *(max(1, round(b)) for b in formed.values())})
    inproc = h.in_process("mlp", sizes, THREADS)
    print(h.HEADER)
    for r in rows:
        print(r.row(), f" mean batch {formed[r.label]:.1f}")
    for b, ms in inproc.items():
        print(f"{'in-process, batch ' + str(b):<44} {b / ms * 1000:>9.0f} samples/s "
              f"({ms:.3f} ms/call)")


async def open_loop(frontend: str, model: str, rate: float, seconds: float,
                    mix: list[dict[str, Any]], deadline_ms: float | None,
                    trace: list[float] | None = None) -> dict[str, dict[str, Any]]:
    """Send at the given arrival times regardless of answers; tally outcomes per class."""
    x = h.sample(model)
    out: dict[str, dict[str, Any]] = {}
    times = trace if trace is not None else [i / rate for i in range(int(rate * seconds))]
    async with AsyncClient(frontend) as client:
        await client.wait_connected(5)
        t0 = time.monotonic()
        tasks = []

        async def one(i: int, at: float) -> None:
            kw = mix[i % len(mix)]
            tally = out.setdefault(str(kw.get("priority", "-")), {"sent": 0, "ok": 0,
                                                                   "late_ok": 0, "lat": []})
            tally["sent"] += 1
            start = time.monotonic()
            try:
                await client.infer(model, {"input": x}, **kw)
                took = time.monotonic() - start
                tally["lat"].append(took)
                if deadline_ms is None or took * 1000 <= deadline_ms:
                    tally["ok"] += 1
                else:
                    tally["late_ok"] += 1
            except InferError as exc:
                tally[exc.code.value] = tally.get(exc.code.value, 0) + 1

        for i, at in enumerate(times):
            delay = t0 + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)  # noqa: sleep-ok (open-loop arrival times)
            tasks.append(asyncio.create_task(one(i, at)))
        await asyncio.gather(*tasks)
    return out


def part2(seconds: float, warmup: float) -> None:
    print("\n== 2. cnn overloaded at ~2x capacity, priorities 1 and 2, 50 ms timeout ==")
    srv = h.start(h.example_repo({"cnn": {}}), threads=THREADS)
    try:
        cap = h.direct_load(srv.frontend, "cnn", 32, warmup_s=warmup, duration_s=seconds / 2,
                            label="capacity")
        rate = 2 * cap.rps
        before = worker_expired(srv)
        mix = [{"priority": 1, "timeout_ms": 50}, {"priority": 2, "timeout_ms": 50}]
        res = asyncio.run(open_loop(srv.frontend, "cnn", rate, seconds, mix, 50.0))
        expired = worker_expired(srv) - before
    finally:
        srv.stop()
    print(f"capacity (closed loop C=32): {cap.rps:.0f} req/s; offered {rate:.0f} req/s")
    print(f"{'priority':<9} {'sent':>6} {'goodput/s':>10} {'ok %':>6} {'late ok':>8} "
          f"{'shed':>6} {'deadline':>9} {'p99 ok ms':>10}")
    for prio, t in sorted(res.items()):
        lat = sorted(t["lat"])
        p99 = lat[int(0.99 * (len(lat) - 1))] * 1000 if lat else float("nan")
        print(f"{prio:<9} {t['sent']:>6} {t['ok'] / seconds:>10.0f} "
              f"{100 * t['ok'] / t['sent']:>6.1f} {t['late_ok']:>8} {t.get('overloaded', 0):>6} "
              f"{t.get('deadline', 0):>9} {p99:>10.1f}")
    print(f"requests the worker refused because their deadline passed before they could "
          f"start: {expired:.0f}; requests executed after their deadline: 0 by construction "
          f"(a worker never starts a batch past its tightest deadline)")


def part3(n: int) -> None:
    print("\n== 3. idle path: lone requests, mlp, sequential ==")
    setups = [("scheduler: priorities + deadlines", {}, {"priority": 1, "timeout_ms": 1000}),
              ("FIFO: one level, no deadlines",
               {"dynamic_batching": {"priority_levels": 1, "default_priority": 1}}, {}),
              ("fixed delay 5 ms", {"dynamic_batching": {"max_queue_delay_ms": 5}}, {})]
    print(f"{'':<40} {'p50 ms':>8} {'p99 ms':>8}")
    for label, cfg, kw in setups:
        srv = h.start(h.example_repo({"mlp": cfg}), threads=THREADS)
        try:
            with Client(srv.frontend) as c:
                x = h.sample("mlp")
                lat = []
                for i in range(n + 100):
                    t = time.perf_counter()
                    c.infer("mlp", {"input": x}, **kw)
                    if i >= 100:
                        lat.append(time.perf_counter() - t)
        finally:
            srv.stop()
        lat.sort()
        p50, p99 = lat[len(lat) // 2] * 1000, lat[int(0.99 * len(lat))] * 1000
        print(f"{label:<40} {p50:>8.3f} {p99:>8.3f}")


def bursty_trace(seconds: float, base_rate: float, burst: int, every_s: float,
                 seed: int = 1) -> list[float]:
    rng = random.Random(seed)
    times, t = [], 0.0
    while t < seconds:
        t += rng.expovariate(base_rate)
        times.append(t)
    times += [k * every_s + rng.uniform(0, 0.002) for k in range(int(seconds / every_s))
              for _ in range(burst)]
    return sorted(x for x in times if x < seconds)


def part4(seconds: float, warmup: float) -> None:
    print("\n== 4. bursty trace on cnn, 100 ms timeout: scheduler vs fixed-delay batcher ==")
    srv = h.start(h.example_repo({"cnn": {}}), threads=THREADS)
    try:
        cap = h.direct_load(srv.frontend, "cnn", 32, warmup_s=warmup, duration_s=seconds / 2)
    finally:
        srv.stop()
    trace = bursty_trace(seconds, base_rate=0.6 * cap.rps, burst=max(8, int(cap.rps / 8)),
                         every_s=0.5)
    mix = [{"timeout_ms": 100}]
    print(f"capacity {cap.rps:.0f} req/s; trace: {len(trace)} requests in {seconds:.0f} s "
          f"(Poisson at 60% of capacity plus a burst of {max(8, int(cap.rps / 8))} every 0.5 s)")
    print(f"{'':<44} {'goodput/s':>10} {'ok %':>6} {'p99 ms':>8} {'shed+deadline':>14}")
    for label, cfg, extra in (
            ("scheduler (latency model, no delay)", {}, []),
            ("fixed delay 5 ms, no latency model",
             {"dynamic_batching": {"max_queue_delay_ms": 5}}, ["--latency-model", "off"])):
        srv = h.start(h.example_repo({"cnn": cfg}), threads=THREADS, extra=extra)
        try:
            h.direct_load(srv.frontend, "cnn", 16, warmup_s=0, duration_s=warmup)
            res = asyncio.run(open_loop(srv.frontend, "cnn", 0, seconds, mix, 100.0, trace))
        finally:
            srv.stop()
        t = res["-"]
        lat = sorted(t["lat"])
        p99 = lat[int(0.99 * (len(lat) - 1))] * 1000 if lat else float("nan")
        failed = t["sent"] - t["ok"] - t["late_ok"]
        print(f"{label:<44} {t['ok'] / seconds:>10.0f} {100 * t['ok'] / t['sent']:>6.1f} "
              f"{p99:>8.1f} {failed:>14}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--parts", default="1,2,3,4")
    args = ap.parse_args()
    print(f"{os.cpu_count()} cores shared by the load generator and the server; "
          f"1 worker with {THREADS} torch threads")
    parts = {int(p) for p in args.parts.split(",")}
    if 1 in parts:
        part1(args.seconds, args.warmup)
    if 2 in parts:
        part2(args.seconds, args.warmup)
    if 3 in parts:
        part3(int(args.seconds * 50))
    if 4 in parts:
        part4(args.seconds, args.warmup)


if __name__ == "__main__":
    main()
