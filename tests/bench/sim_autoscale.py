"""The replica autoscaler against a simulation: 64 simulated workers, one model whose
batches take ``a + c*b`` (20 ms + 1 ms a sample, max batch 8: about 285 samples/s per
replica at full batches), a bursty arrival trace, the real broker objects on a
simulated clock (tests/bench/simcluster.py).

    .venv/bin/python -m tests.bench.sim_autoscale [--png PATH] [--seed N]

Three runs of the same trace, in the same process:
  auto     instances min 1, max 64, the autoscaler on (queue SLO 25 ms; windows and
           cool-downs shortened for a 90 s trace: window 2 s, down window 8 s, up
           cool-down 2 s, down cool-down 8 s; loading a replica takes 2 s)
  fixed-N  N replicas fixed (count N), N = the auto run's mean replica count rounded
           up: the same replica-seconds, placed once
  all-64   (with --all-64) every worker holds the model: today's default, the most
           memory; slow to simulate, as the broker's per-request cost grows with holders
Printed per 5 s: offered load, goodput (answered within the 250 ms latency SLO) and
p99 per run, and replicas; then a summary. The PNG draws the same series.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from tests.bench.simcluster import SimCluster, write_repo
from zeroserve.broker.server import replicas as replicas_module

replicas_module.HISTORY = 100_000   # keep every decision of the run, not the last 20

A_S, C_S, MBS = 0.020, 0.001, 8
LOAD_S = 2.0
WARM_S = 5.0                 # replicas load before the trace starts
SLO_S = 0.25                 # latency SLO for goodput
TIMEOUT_MS = 1000.0          # each request's deadline
TUNING = {"queue_slo_ms": 25, "window_s": 2, "down_window_s": 8, "up_cooldown_s": 2,
          "down_cooldown_s": 8}
# (start s, end s, rate at start, rate at end) after the warm-up
TRACE = [(0, 15, 150, 150), (15, 27, 1800, 1800), (27, 45, 150, 150), (45, 55, 150, 1200),
         (55, 65, 1200, 1200), (65, 70, 2200, 2200), (70, 90, 80, 80)]
BUCKET_S = 1.0


def arrivals(seed: int) -> np.ndarray:
    """Poisson arrivals at a piecewise-linear rate, modulated every 100 ms by lognormal
    noise (sigma 0.4): bursty at both scales."""
    rng = np.random.default_rng(seed)
    out = []
    for start, end, r0, r1 in TRACE:
        for t in np.arange(start, end, 0.1):
            rate = (r0 + (r1 - r0) * (t - start) / (end - start)) * rng.lognormal(0, 0.4)
            n = rng.poisson(rate * 0.1)
            out.append(WARM_S + t + rng.uniform(0, 0.1, n))
    return np.sort(np.concatenate(out))


def run(label: str, instances: dict[str, int], times: np.ndarray) -> dict[str, Any]:
    cfg: dict[str, Any] = {"max_batch_size": MBS, "autoscaling": TUNING}
    if instances:
        cfg["instances"] = instances
    repo = write_repo({"m": cfg})
    sim = SimCluster(repo, 64, a_s=A_S, c_s=C_S, load_s=LOAD_S)
    replicas: list[tuple[float, int]] = []

    def probe(now: float) -> None:
        replicas.append((now - WARM_S, len(sim.broker.pool.holders("m"))))

    wall = time.perf_counter()
    end = WARM_S + TRACE[-1][1]
    sim.run(end + 2.0, times, "m", TIMEOUT_MS, every_s=0.5, probe=probe)
    wall = time.perf_counter() - wall
    decisions = list(sim.broker.replicas.history.get("m", ()))
    outcomes = list(sim.outcomes.values())
    sim.close(repo)
    return {"label": label, "outcomes": outcomes, "replicas": replicas, "wall_s": wall,
            "decisions": decisions}


def series(res: dict[str, Any]) -> dict[str, np.ndarray]:
    n = int(math.ceil(TRACE[-1][1] / BUCKET_S))
    offered, good = np.zeros(n), np.zeros(n)
    lat: list[list[float]] = [[] for _ in range(n)]
    for o in res["outcomes"]:
        b = int((o.sent_s - WARM_S) // BUCKET_S)
        if not 0 <= b < n:
            continue
        offered[b] += 1
        if not o.code and not math.isnan(o.done_s):
            lat[b].append(o.done_s - o.sent_s)
            good[b] += (o.done_s - o.sent_s) <= SLO_S
    p99 = np.array([np.percentile(x, 99) * 1000 if x else np.nan for x in lat])
    reps = np.array([np.mean([r for t, r in res["replicas"] if b <= t / BUCKET_S < b + 1]
                             or [np.nan]) for b in range(n)])
    return {"offered": offered / BUCKET_S, "good": good / BUCKET_S, "p99": p99,
            "replicas": reps}


def summary(res: dict[str, Any], s: dict[str, np.ndarray]) -> str:
    done = [o for o in res["outcomes"] if WARM_S <= o.sent_s]
    ok = [o.done_s - o.sent_s for o in done if not o.code and not math.isnan(o.done_s)]
    errors: dict[str, int] = {}
    for o in done:
        if o.code:
            errors[o.code] = errors.get(o.code, 0) + 1
    within = sum(x <= SLO_S for x in ok)
    rs = [r for t, r in res["replicas"] if t >= 0]
    return (f"{res['label']:<9} goodput {within / TRACE[-1][1]:7.0f} req/s "
            f"({100 * within / max(len(done), 1):5.1f} % of {len(done)}), p99 "
            f"{np.percentile(ok, 99) * 1000:7.1f} ms, p50 {np.percentile(ok, 50) * 1000:6.1f}"
            f" ms, replicas mean {np.mean(rs):5.2f} max {max(rs):2d}, replica-s "
            f"{np.sum(rs) * 0.5:6.0f}, errors {errors or 'none'}, sim wall {res['wall_s']:.1f} s")


def draw(path: Path, results: list[tuple[dict[str, Any], dict[str, np.ndarray]]]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    t = np.arange(len(results[0][1]["offered"])) * BUCKET_S
    for res, s in results:
        ax[0].plot(t, s["good"], lw=1.2, label=f"goodput {res['label']}")
        ax[1].plot(t, s["p99"], lw=1.2, label=res["label"])
        ax[2].step(t, s["replicas"], where="post", lw=1.2, label=res["label"])
    ax[0].plot(t, results[0][1]["offered"], color="black", lw=0.8, ls=":", label="offered")
    ax[0].set_ylabel("req/s")
    ax[0].set_title(f"64 simulated workers, latency {A_S * 1000:g} ms + {C_S * 1000:g} ms/"
                    f"sample, goodput = answered within {SLO_S * 1000:g} ms")
    ax[1].set_ylabel("p99 latency (ms)")
    ax[1].set_yscale("log")
    ax[1].axhline(SLO_S * 1000, color="grey", ls="--", lw=0.8)
    ax[2].set_ylabel("replicas")
    ax[2].set_yscale("log", base=2)
    ax[2].set_xlabel("trace time (s)")
    for a in ax:
        a.legend(fontsize=8, loc="upper right")
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--png", default="/tmp/sim_autoscale.png")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--all-64", action="store_true",
                    help="also every worker holding it (today's default; a minute more: "
                         "the broker's per-request cost grows with the holders)")
    args = ap.parse_args()
    times = arrivals(args.seed)
    print(f"trace: {len(times)} requests over {TRACE[-1][1]} s, peak "
          f"{max(r for *_, r in TRACE)} req/s nominal")
    auto = run("auto", {"min": 1, "max": 64}, times)
    s_auto = series(auto)
    fixed_n = int(math.ceil(np.mean([r for t, r in auto["replicas"] if t >= 0])))
    results = [(auto, s_auto)]
    baselines = [(f"fixed-{fixed_n}", {"count": fixed_n})]
    if args.all_64:
        baselines.append(("all-64", {}))
    for label, inst in baselines:
        res = run(label, inst, times)
        results.append((res, series(res)))
    print("\n  t  offered | " + " | ".join(f"{r['label']:>9} good  p99 rep"
                                           for r, _ in results))
    for b in range(0, len(s_auto["offered"]), 5):
        sl = slice(b, b + 5)
        row = [f"{b:3d} {np.mean(s_auto['offered'][sl]):8.0f}"]
        for _, s in results:
            row.append(f"{np.mean(s['good'][sl]):14.0f} {np.nanmax(s['p99'][sl]):5.0f} "
                       f"{np.nanmean(s['replicas'][sl]):3.0f}")
        print(" | ".join(row))
    print()
    for res, s in results:
        print(summary(res, s))
    print("\nauto's decisions:")
    for d in auto["decisions"]:
        print(f"  {d['action']:<4} {d['reason']:<16} at {d['replicas']:2d}  {d['signals']}")
    draw(Path(args.png), results)
    print(f"\nfigure: {args.png}")


if __name__ == "__main__":
    main()
