"""Fairness under a flooding tenant, and the cost of admission with many tenants.

    .venv/bin/python -m tests.bench.bench_tenants [--rate 40] [--seconds 10]

1. Fairness: two tenants of one class and weight on the example ``mlp``, each with a
   quota of RATE requests/s (burst RATE/4). ``polite`` sends at its quota (evenly
   spaced, direct client); in the same run it does so first alone, then while ``flood``
   sends at 5x its quota. Printed: polite's success rate and p50/p99 in both phases,
   and what flood got (ok, 429).
2. Admission cost: identify + admit + release per request in process, with 1,000
   tenants configured beside none (the anonymous tenant), same run.
The load generator shares the machine's cores with the server.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry

from tests.bench.harness import example_repo, sample, start
from zeroserve.broker import protocol as p
from zeroserve.broker.client import AsyncClient, InferError
from zeroserve.broker.server.tenancy import Tenancy
from zeroserve.broker.server.tenants import Tenant, new_key


async def paced(frontend: str, key: str, rate: float, seconds: float, x: np.ndarray
                ) -> dict[str, Any]:
    """Evenly spaced sends at ``rate``/s for ``seconds``; outcome and latency of each."""
    lat: list[float] = []
    codes: dict[str, int] = {}
    tasks = []
    async with AsyncClient(frontend, api_key=key) as c:
        assert await c.wait_connected(10), "broker not reachable"

        async def one() -> None:
            t0 = time.perf_counter()
            try:
                await c.infer("mlp", {"input": x}, timeout_ms=2000)
                lat.append(time.perf_counter() - t0)
                codes["ok"] = codes.get("ok", 0) + 1
            except InferError as exc:
                codes[exc.code.value] = codes.get(exc.code.value, 0) + 1
        start_t = time.perf_counter()
        n = int(rate * seconds)
        for i in range(n):
            delay = start_t + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)  # noqa: sleep-ok - the pacing of an open loop
            tasks.append(asyncio.ensure_future(one()))
        await asyncio.gather(*tasks)
    lat.sort()

    def pct(q: float) -> float:
        return lat[min(len(lat) - 1, int(q * len(lat)))] * 1000 if lat else float("nan")
    return {"sent": n, "codes": codes, "ok_rate": codes.get("ok", 0) / max(n, 1),
            "p50_ms": pct(0.5), "p99_ms": pct(0.99)}


def fairness(rate: float, seconds: float) -> None:
    keys = {name: new_key() for name in ("polite", "flood")}
    repo = example_repo({"mlp": {}})
    tenants = Path(f"{repo}-tenants.toml")
    tenants.write_text("".join(
        f'[tenants.{n}]\nkeys = ["{h}"]\nqos = "burstable"\nrate = {rate}\n'
        f"burst = {max(1.0, rate / 4)}\n" for n, (_, h) in keys.items()))
    srv = start(repo, extra=["--tenants", str(tenants)])
    x = sample("mlp")
    try:
        alone = asyncio.run(paced(srv.frontend, keys["polite"][0], rate, seconds, x))

        async def both() -> list[dict[str, Any]]:
            return list(await asyncio.gather(
                paced(srv.frontend, keys["polite"][0], rate, seconds, x),
                paced(srv.frontend, keys["flood"][0], 5 * rate, seconds, x)))
        polite, flood = asyncio.run(both())
    finally:
        srv.stop()
        tenants.unlink(missing_ok=True)
    print(f"fairness: mlp, quota {rate:g}/s each, {seconds:g} s per phase, same run")
    for label, r in (("polite alone", alone), ("polite + flood", polite),
                     ("flood (5x quota)", flood)):
        print(f"  {label:<18} sent {r['sent']:>5}  ok {r['ok_rate'] * 100:6.2f}%  "
              f"p50 {r['p50_ms']:7.2f} ms  p99 {r['p99_ms']:7.2f} ms  {r['codes']}")


def admission_cost(n_tenants: int = 1000, n: int = 50_000) -> None:
    def per_request(t: Tenancy, key: str) -> float:
        reqs = [p.InferRequest(str(i), "mlp", [], api_key=key) for i in range(n)]
        t0 = time.perf_counter()
        for i, r in enumerate(reqs):
            who = t.identify(r)
            assert isinstance(who, Tenant)
            t.admit(who, i, r, 1, 0.0)
            t.release(i)
        return (time.perf_counter() - t0) / n * 1e6

    path = Path("/tmp") / f"zs-bench-tenants-{time.time_ns()}.toml"
    keys = [new_key() for _ in range(n_tenants)]
    path.write_text("".join(f'[tenants.t{i}]\nkeys = ["{h}"]\nqos = "burstable"\n'
                            f"rate = 1e9\nmax_inflight = 100\n" for i, (_, h) in enumerate(keys)))
    try:
        many = per_request(Tenancy(path, CollectorRegistry(), time.monotonic), keys[-1][0])
    finally:
        path.unlink()
    none = per_request(Tenancy(None, CollectorRegistry(), time.monotonic), "")
    print(f"admission: {none:.2f} us/request without tenants, {many:.2f} us/request with "
          f"{n_tenants} tenants (identify + admit + release, in process, same run)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=40.0, help="each tenant's quota, requests/s")
    ap.add_argument("--seconds", type=float, default=10.0, help="per phase")
    args = ap.parse_args()
    admission_cost()
    fairness(args.rate, args.seconds)


if __name__ == "__main__":
    main()
