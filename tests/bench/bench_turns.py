"""What a turn of load on demand costs, before and after a change, in one run.

    .venv/bin/python -m tests.bench.bench_turns --before REV [--blocks 8] [--slices 8]

A turn is what a request for a model not loaded sets off when the budget is full: an
eviction, a LOAD (a move back from the worker's host-memory tier), the LOADED, the batch
and its result. Two parts, each with this tree and ``--before REV`` (a temp worktree) up
at once and the load alternating among their servers, because this host's speed swings
by half between minutes and a figure is only fair beside one taken in the same minute:

* **turns**: 5 models of 8 MB, C=1, asked in turn; one server with all 5 loaded, one
  with load on demand on a budget of 4 and the thrash bounds off, so that every request
  is a turn. Blocks of requests alternate among the servers; the CPU the broker and the
  worker spent per request (all their threads, from /proc) and the wall time, medians
  over blocks. Per turn: the on-demand server's figure less the all-loaded one's.
* **zipf**: the workload of ``bench_many_models``: Zipf(1.1) over 12 models of 8 MB at
  C=16, all loaded against on demand on a budget that holds 4, in slices that alternate
  among the servers; the ratio of each slice pair, and its median.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from tests.bench import bench_many_models as mm
from tests.bench.bench_broker import Checkout
from tests.bench.harness import evictions, usable_cores
from tests.conftest import Server
from zeroserve.broker.client import Client

TICKS = os.sysconf("SC_CLK_TCK")
THRASH_OFF = ["--load-on-demand-residency-factor", "0", "--load-on-demand-min-residency-s", "0"]


def cpu_s(pid: int) -> float:
    """The CPU seconds of every thread of ``pid`` (a thread gone meanwhile counts none)."""
    total = 0.0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / TICKS
    return total


class Fleet:
    """Servers by key, each from its checkout, stopped and cleaned together."""

    def __init__(self) -> None:
        self.servers: dict[tuple[str, str], Server] = {}
        self._repos: list[Path] = []

    def up(self, key: tuple[str, str], checkout: Checkout, models: int,
           extra: list[str]) -> Server:
        repo = mm.repo_of(models, mm.SIZES["8 MB"])
        self._repos.append(repo)
        args = ["--threads", str(max(1, usable_cores() - 1)), *extra]
        srv = self.servers[key] = Server(repo, extra=args, env=checkout.env).wait_ready(120)
        return srv

    def close(self) -> None:
        for srv in self.servers.values():
            srv.stop()
        for repo in self._repos:
            shutil.rmtree(repo, ignore_errors=True)


def turns(checkouts: dict[str, Checkout], blocks: int, per_block: int) -> dict[str, Any]:
    fleet = Fleet()
    try:
        budget = mm.budget_for(4.5, mm.SIZES["8 MB"], mm.context_bytes())
        for label, co in checkouts.items():
            fleet.up((label, "all"), co, 5, [])
            fleet.up((label, "turns"), co, 5, ["--load-on-demand", "--memory-budget",
                                               str(budget), *THRASH_OFF])
        clients = {k: Client(s.frontend, timeout_s=60) for k, s in fleet.servers.items()}
        pids = {k: [s.pids("broker")[0], s.pids("worker")[0]]
                for k, s in fleet.servers.items()}
        for c in clients.values():   # every model read from disk once, parked since
            for i in range(50):
                c.infer(f"m{i % 5}", {"input": mm.X})
        got: dict[tuple[str, str], dict[str, list[float]]] = {
            k: {"broker_us": [], "worker_us": [], "wall_ms": []} for k in fleet.servers}
        for _ in range(blocks):
            for key, c in clients.items():
                before = [cpu_s(p) for p in pids[key]]
                start = time.monotonic()
                for i in range(per_block):
                    c.infer(f"m{i % 5}", {"input": mm.X})
                got[key]["wall_ms"].append((time.monotonic() - start) / per_block * 1e3)
                for name, pid, was in zip(("broker_us", "worker_us"), pids[key], before):
                    got[key][name].append((cpu_s(pid) - was) / per_block * 1e6)
        for c in clients.values():
            c.close()
        turns_seen = {k[0]: evictions(s) for k, s in fleet.servers.items()
                      if k[1] == "turns"}
    finally:
        fleet.close()
    med = {k: {m: statistics.median(v) for m, v in d.items()} for k, d in got.items()}
    return {label: {"all": med[(label, "all")], "turns": med[(label, "turns")],
                    "per_turn": {m: med[(label, "turns")][m] - med[(label, "all")][m]
                                 for m in med[(label, "all")]},
                    "evictions": turns_seen[label]} for label in checkouts}


def zipf(checkouts: dict[str, Checkout], slices: int, seconds: float) -> dict[str, Any]:
    names = [f"m{i}" for i in range(12)]
    fleet = Fleet()
    try:
        for label, co in checkouts.items():
            srv = fleet.up((label, "all"), co, 12, [])
            with Client(srv.frontend, timeout_s=60) as c:
                for name in names:
                    c.infer(name, {"input": mm.X})
            asyncio.run(mm.zipf_load(srv.frontend, names, 1.1, 16, 0.5, 1))
            with Client(srv.control, timeout_s=10) as c:
                budget, _ = mm.budget_holding(c.control("status"), 4)
            fleet.up((label, "on demand"), co, 12, ["--load-on-demand", "--memory-budget",
                                                    str(budget)])
        rps: dict[tuple[str, str], list[float]] = {k: [] for k in fleet.servers}
        for i in range(slices):
            order = list(fleet.servers.items())
            for key, srv in order if i % 2 else order[::-1]:
                got = asyncio.run(mm.zipf_load(srv.frontend, names, 1.1, 16, 0.7, seconds))
                if got["errors"] or got["wrong"]:
                    raise SystemExit(f"{key}: {got}")
                rps[key].append(got["rps"])
    finally:
        fleet.close()
    out = {}
    for label in checkouts:
        ratios = [a / b for a, b in zip(rps[(label, "on demand")], rps[(label, "all")])]
        out[label] = {"on_demand_rps": statistics.median(rps[(label, "on demand")]),
                      "all_loaded_rps": statistics.median(rps[(label, "all")]),
                      "ratio": statistics.median(ratios), "ratio_min": min(ratios),
                      "ratio_max": max(ratios)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", default=None, help="also run this commit, side by side")
    ap.add_argument("--part", choices=("turns", "zipf", "both"), default="both")
    ap.add_argument("--blocks", type=int, default=8, help="turns: blocks per server")
    ap.add_argument("--per-block", type=int, default=300, help="turns: requests a block")
    ap.add_argument("--slices", type=int, default=8, help="zipf: slices per server")
    ap.add_argument("--seconds", type=float, default=3.0, help="zipf: each slice, measured")
    args = ap.parse_args()
    checkouts = {**({"before": Checkout(args.before)} if args.before else {}),
                 "this tree": Checkout(None)}
    try:
        if args.part in ("turns", "both"):
            got = turns(checkouts, args.blocks, args.per_block)
            print(f"turns: 5 models of 8 MB, C=1, a budget of 4, every request a turn; "
                  f"medians of {args.blocks} blocks of {args.per_block}")
            print(f"  {'checkout':<12} {'':<9} {'broker CPU us':>14} {'worker CPU us':>14} "
                  f"{'wall ms':>8}")
            for label, row in got.items():
                for part in ("all", "turns", "per_turn"):
                    r = row[part]
                    name = {"all": "all loaded", "turns": "on demand",
                            "per_turn": "per turn"}[part]
                    print(f"  {label:<12} {name:<9} {r['broker_us']:>14.0f} "
                          f"{r['worker_us']:>14.0f} {r['wall_ms']:>8.2f}")
                print(f"  {label:<12} {row['evictions']} evictions on demand")
        if args.part in ("zipf", "both"):
            got = zipf(checkouts, args.slices, args.seconds)
            print(f"zipf: Zipf(1.1) over 12 models of 8 MB, C=16, {args.slices} slices of "
                  f"{args.seconds:g} s per server, a budget that holds 4")
            for label, row in got.items():
                print(f"  {label:<12} on demand {row['on_demand_rps']:>6.0f} req/s, all "
                      f"loaded {row['all_loaded_rps']:>6.0f}: ratio median "
                      f"{100 * row['ratio']:.0f}% ({100 * row['ratio_min']:.0f}-"
                      f"{100 * row['ratio_max']:.0f}%)")
    finally:
        for co in checkouts.values():
            co.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
