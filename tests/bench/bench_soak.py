"""Soak: minutes of steady load with swaps and worker kills, every process's memory sampled.

    python -m tests.bench.bench_soak --minutes 30 --rate 300 --plot soak.png

`zeroserve serve --workers 2` on a copy of the bundled mlp; a paced load (half over HTTP
v2 JSON, half through the asyncio client) at ``--rate`` requests/s; a new mlp version
published every ``--swap-s`` (a perturbed copy, by atomic rename: the watcher's path), the
version before the previous deleted then (``--keep-all`` keeps them), and a worker
SIGKILLed every ``--kill-s`` (0: never). Every ``--sample-s`` the resident memory of the
broker, the gateway and each worker is read from /proc. At the end it prints the memory
of each role at the first sample after warm-up (``--settle-min``), at the end and at its
peak, the broker's growth in each quarter after it, beside the
requests answered, their outcomes, and the broker's census (every structure that holds a
request: all 0 once the load stopped). The broker's pid must never change.

The load generator shares the machine's cores with the server; this measures memory and
correctness over time, not speed.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import shutil
import signal
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from tests.bench.harness import example_repo, sample, start
from zeroserve.broker.server import memtrace
from zeroserve.broker.client import AsyncClient, Client, InferError

ROLES = ("broker", "gateway", "worker")


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


class Paced:
    """``rate`` requests/s over ``lanes`` lanes, each one request at a time, on a schedule
    (a late lane does not catch up with a burst)."""

    def __init__(self, rate: float, lanes: int) -> None:
        self.interval_s = lanes / rate
        self.outcomes: Counter[str] = Counter()
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def record(self, what: str) -> None:
        with self.lock:
            self.outcomes[what] += 1

    def wait_turn(self, next_s: float) -> float:
        delay = next_s - time.monotonic()
        if delay > 0:
            self.stop.wait(delay)
        return max(next_s + self.interval_s, time.monotonic())


def http_lane(pace: Paced, port: int, body: bytes) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    next_s = time.monotonic()
    while not pace.stop.is_set():
        next_s = pace.wait_turn(next_s)
        try:
            conn.request("POST", "/v2/models/mlp/infer", body,
                         {"Content-Type": "application/json"})
            resp = conn.getresponse()
            answer = resp.read()
            if resp.status == 200:
                pace.record("ok")
            else:   # the error's own words, so a count says why
                pace.record(f"http {resp.status}: {json.loads(answer).get('error', '')[:60]}")
        except OSError as exc:
            pace.record(f"http {type(exc).__name__}")
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.close()


def direct_lanes(pace: Paced, frontend: str, lanes: int) -> None:
    x = sample("mlp")

    async def lane(client: AsyncClient) -> None:
        next_s = time.monotonic()
        while not pace.stop.is_set():
            delay = next_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)  # noqa: sleep-ok (pacing to the rate)
            next_s = max(next_s + pace.interval_s, time.monotonic())
            try:
                await client.infer("mlp", {"input": x}, timeout_ms=10_000)
                pace.record("ok")
            except InferError as exc:
                pace.record(f"direct {exc.code.value}")

    async def main() -> None:
        async with AsyncClient(frontend) as client:
            await client.wait_connected(10)
            await asyncio.gather(*[lane(client) for _ in range(lanes)])
            left = client.census()
            assert not any(left.values()), left
    asyncio.run(main())


def publish(repo: Path, version: int) -> None:
    """A new mlp version: version 1 with one bias nudged, so its content differs."""
    import torch

    model = torch.jit.load(str(repo / "mlp" / "1" / "model.pt"))
    with torch.no_grad():
        next(iter(model.parameters())).add_(1e-4 * version)
    tmp = repo / "mlp" / f".tmp-{version}"
    tmp.mkdir()
    torch.jit.save(model, str(tmp / "model.pt"))
    os.rename(tmp, repo / "mlp" / str(version))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--rate", type=float, default=300.0, help="requests/s, all lanes")
    ap.add_argument("--swap-s", type=float, default=30.0)
    ap.add_argument("--kill-s", type=float, default=60.0)
    ap.add_argument("--sample-s", type=float, default=10.0)
    ap.add_argument("--settle-min", type=float, default=3.0,
                    help="minutes before the RSS is expected flat (the first samples warm up)")
    ap.add_argument("--keep-all", action="store_true",
                    help="never delete a published version (the default deletes the one "
                    "before the previous, as issue 48's soak did)")
    ap.add_argument("--plot", default="", help="write the memory plot to this PNG")
    ap.add_argument("--trace-memory", type=int, default=0, metavar="FRAMES",
                    help="start the broker with ZEROSERVE_TRACEMALLOC=FRAMES, mark its "
                    "memory once settled, and print what grew since at the end (it slows "
                    "the broker: not for the RSS figures)")
    args = ap.parse_args()
    if args.trace_memory:
        os.environ[memtrace.ENV] = str(args.trace_memory)

    repo = example_repo({"mlp": {}})
    srv = start(repo, workers=2)
    (broker_pid,) = srv.pids("broker")
    body = json.dumps({"inputs": [{"name": "input", "shape": [1, 256], "datatype": "FP32",
                                   "data": sample("mlp").reshape(-1).tolist()}]}).encode()
    pace = Paced(args.rate, lanes=16)
    threads = [threading.Thread(target=http_lane, args=(pace, srv.port, body))
               for _ in range(8)]
    threads.append(threading.Thread(target=direct_lanes, args=(pace, srv.frontend, 8)))
    for t in threads:
        t.start()
    samples: list[tuple[float, dict[str, list[float]]]] = []
    version, swaps, kills = 1, 0, 0
    t0 = time.monotonic()
    next_swap, next_kill, next_sample = t0 + args.swap_s, t0 + args.kill_s, t0
    mark = t0 + args.settle_min * 60 if args.trace_memory else float("inf")
    end = t0 + args.minutes * 60
    print(f"soak: {args.minutes:g} min at {args.rate:g} req/s, a swap every {args.swap_s:g} s, "
          f"a worker SIGKILL every {args.kill_s:g} s (2 cores shared with the load)")
    print(f"{'min':>6} {'answered':>9} {'broker MB':>10} {'gateway MB':>11} {'workers MB':>16}")
    try:   # the server stopped whatever goes wrong: none of its processes outlive the bench
        try:
            while (now := time.monotonic()) < end:
                if now >= next_sample:
                    next_sample += args.sample_s
                    mem = {role: [rss_mb(pid) for pid in srv.pids(role)] for role in ROLES}
                    samples.append((now - t0, mem))
                    if len(samples) % max(1, int(60 / args.sample_s)) == 1:
                        with pace.lock:
                            done = sum(pace.outcomes.values())
                        print(f"{(now - t0) / 60:>6.1f} {done:>9} {sum(mem['broker']):>10.1f} "
                              f"{sum(mem['gateway']):>11.1f} "
                              f"{' '.join(f'{m:.0f}' for m in mem['worker']):>16}", flush=True)
                if now >= mark:
                    mark = float("inf")
                    with Client(srv.control, timeout_s=30) as c:
                        c.control("memory", mark=True, top=1)
                if now >= next_swap:
                    next_swap += args.swap_s
                    version += 1
                    publish(repo, version)
                    swaps += 1
                    if not args.keep_all and version > 3:
                        shutil.rmtree(repo / "mlp" / str(version - 2), ignore_errors=True)
                if args.kill_s > 0 and now >= next_kill:
                    next_kill += args.kill_s
                    pids = srv.pids("worker")
                    if pids:
                        os.kill(pids[kills % len(pids)], signal.SIGKILL)
                        kills += 1
                time.sleep(0.2)  # noqa: sleep-ok (the driver's own tick; the load runs on threads)
        finally:
            pace.stop.set()
            for t in threads:
                t.join(60)
        with Client(srv.control, timeout_s=60) as c:   # the memory walk takes seconds
            census = c.control("census")
            served = c.control("models")["models"]["mlp"]["ready"]
            grown = c.control("memory", top=15) if args.trace_memory else None
        broker_same = srv.pids("broker") == [broker_pid]
    finally:
        srv.stop()
    report(samples, pace.outcomes, census, swaps, kills, served, broker_same, args)
    if grown is not None:
        print_grown(grown)


def print_grown(grown: dict[str, Any]) -> None:
    """The broker's memory verb's answer: what grew since the mark, largest first."""
    print(f"\nbroker traced: {grown['traced_kb']:.0f} KB; grown since settled, by traceback:")
    for a in grown["allocations"]:
        own = [f.rsplit("/", 1)[-1] for f in a["traceback"] if "zeroserve" in f
               or "/broker/" in f or "/models/" in f or "/workers/" in f]
        print(f"  {a['grown_kb']:+9.1f} KB {a['grown_blocks']:+7d} blocks  "
              f"{' > '.join(own[-5:]) or a['traceback'][-1]}")
    print("objects grown since settled, by type: " + ", ".join(
        f"{o['type']} {o['grown']:+d}" for o in grown["objects"] if o["grown"]))


def report(samples: list[tuple[float, dict[str, list[float]]]], outcomes: Counter[str],
           census: dict[str, int], swaps: int, kills: int, served: list[int],
           broker_same: bool, args: Any) -> None:
    warm = next((i for i, (t, _) in enumerate(samples) if t >= args.settle_min * 60), 0)
    print(f"\nrequests answered: {sum(outcomes.values())} ({dict(outcomes)})")
    print(f"swaps published: {swaps} (serving version {served} at the end), "
          f"workers killed: {kills}, broker pid unchanged: {broker_same}")
    print(f"broker census after the load: {census}")
    print(f"\n{'resident MB':<12} {f'at {args.settle_min:g} min':>9} {'at the end':>11} "
          f"{'peak':>8} {'growth':>8}")
    for role in ROLES:
        series = [sum(m[role]) / max(len(m[role]), 1) for _, m in samples]
        first, last = series[warm], series[-1]
        print(f"{role + (' (each)' if role == 'worker' else ''):<12} {first:>9.1f} "
              f"{last:>11.1f} {max(series[warm:]):>8.1f} {last - first:>+8.1f}")
    broker = [(t, sum(m["broker"])) for t, m in samples[warm:]]
    if len(broker) >= 5:   # where it grew: a creep shows in every quarter, a step in one
        q = len(broker) // 4
        marks = [broker[0], broker[q], broker[2 * q], broker[3 * q], broker[-1]]
        print("broker RSS by quarter after settling: " + ", ".join(
            f"{t / 60:.1f} min {mb:.2f} MB" for t, mb in marks))
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4))
        ts = np.array([t for t, _ in samples]) / 60
        for role in ROLES:
            ax.plot(ts, [sum(m[role]) / max(len(m[role]), 1) for _, m in samples],
                    label=role + (" (mean of 2)" if role == "worker" else ""))
        ax.set_xlabel("minutes")
        ax.set_ylabel("resident MB")
        ax.set_ylim(bottom=0)
        ax.set_title(f"zeroserve soak: {sum(outcomes.values()):,} requests, {swaps} swaps, "
                     f"{kills} worker kills")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
