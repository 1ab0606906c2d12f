"""Requests/s against the number of gateway processes sharing the HTTP port, with
workers that answer at once, so the gateways and the broker are what is measured.

    .venv/bin/python -m tests.bench.bench_gateways [--gateways 1,2,4] [--duration-s 6]

One real broker (``zeroserve broker``) and two simulated workers (tests/bench/
bench_ceiling.py: READY, then a RESULT for every BATCH at once, no torch) serving a
model ``tiny`` (4 FP32 in, 3 out); N ``zeroserve gateway --reuse-port`` processes on
one port (SO_REUSEPORT: the kernel spreads the connections), each with its own DEALER
to the broker; ``zeroserve bench --transport http-json`` at C=64 from two processes.
For each N: requests/s, p99, and the CPU each role spent a request (the gateways
together, the broker, the simulated workers, the load generator). The broker is the
wall once its CPU a request times the rate nears one core; the gateways while theirs,
divided by N, does. Everything shares this host's cores: on a small host the load
generator takes its share, and the figures say how much.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from tests.bench.bench_ceiling import Setup
from tests.bench.harness import cpu_s
from tests.conftest import ROOT, free_port, wait_for

WARMUP_S = 1.0


def ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready",
                                    timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


class Gateways:
    def __init__(self, setup: Setup, n: int) -> None:
        self.port = free_port()
        prom = Path(tempfile.mkdtemp(prefix="prometheus-", dir=setup.rt))
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(prom)}
        self.log = open(prom / "gateways.log", "wb")
        self.procs = [subprocess.Popen(
            [sys.executable, str(ROOT / "bin" / "zeroserve"), "gateway", "--runtime-dir",
             str(setup.rt), "--http-port", str(self.port), "--grpc-port", "0",
             "--reuse-port", "--log-level", "warning"], env=env, stdout=self.log,
            stderr=subprocess.STDOUT, start_new_session=True) for _ in range(n)]
        wait_for(lambda: ready(self.port), 60, f"{n} gateway(s)")

    def close(self) -> None:
        for proc in self.procs:
            proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.log.close()


def measure(setup: Setup, n: int, duration_s: float) -> dict[str, Any]:
    gws = Gateways(setup, n)
    try:
        out = setup.rt / f"bench-{n}.json"
        roles = {"gateways": [p.pid for p in gws.procs], "broker": [setup.broker.pid],
                 "workers": [p.pid for p in setup.procs]}
        before = {r: cpu_s(pids) for r, pids in roles.items()}
        subprocess.run([sys.executable, str(ROOT / "bin" / "zeroserve"), "bench", "-m", "tiny",
                        "--transport", "http-json", "--url", f"http://127.0.0.1:{gws.port}",
                        "--runtime-dir", str(setup.rt), "--concurrency", "64",
                        "--processes", "2", "--warmup-s", str(WARMUP_S),
                        "--duration-s", str(duration_s), "--json", str(out), "--quiet"],
                       check=True, capture_output=True)
        level = json.loads(Path(out).read_text())["levels"][0]
        answered = level["requests"] * (1 + WARMUP_S / duration_s)
        row = {r: (cpu_s(pids) - before[r]) / max(answered, 1) * 1e6
               for r, pids in roles.items()}
        rps = level["throughput_rps"]
        row["generator"] = (level["generator_cpu_pct"] or 0) / 100 / rps * 1e6 if rps else 0.0
        return {"n": n, "rps": rps, "p99": level["p99_ms"], "cpu_us": row}
    finally:
        gws.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gateways", default="1,2,4")
    ap.add_argument("--duration-s", type=float, default=6.0)
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    counts = [int(x) for x in args.gateways.split(",")]
    setup = Setup(2)
    try:
        print(f"host: {len(os.sched_getaffinity(0))} usable cores\n"
              "| gateways | req/s | p99 | CPU a request, µs |\n|---|---|---|---|")
        for _ in range(args.rounds):
            for n in counts:
                got = measure(setup, n, args.duration_s)
                cpu = {k: round(v) for k, v in got["cpu_us"].items()}
                print(f"| {n} | {got['rps']:.0f} | {got['p99']:.1f} ms | {json.dumps(cpu)} |",
                      flush=True)
    finally:
        setup.close()


if __name__ == "__main__":
    main()
