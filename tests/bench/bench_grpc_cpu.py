"""Where a request's CPU goes, by transport: one ``zeroserve serve`` on the bundled
``mlp``, loaded in turn by ``zeroserve bench`` over each transport (``--rounds`` times,
each round starting with the next transport), and the CPU each process spent per
request: the gateway, the broker, the worker, and the load generator itself (the
bench's own figure, ``generator_cpu_pct``, over the counted window).

    .venv/bin/python -m tests.bench.bench_grpc_cpu [--rounds 3] [--concurrency 64]

On a host where the generator shares the cores with the server, what the generator
spends per request is taken from the server: a transport whose client costs more
serves less at saturation, whatever the server does. The server's figures count the
warm-up second too (requests answered in it estimated at the measured rate).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

from tests.bench.harness import cpu_s
from tests.conftest import ROLE_MODULES, ZEROSERVE, free_port, short_tmpdir, wait_for

WARMUP_S = 1.0



def pids(session: int, role: str) -> list[int]:
    out = subprocess.run(["pgrep", "-s", str(session), "-f", ROLE_MODULES[role]],
                         capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


def measure(bench: list[str], transport: str, roles: dict[str, list[int]],
            out: Path) -> dict[str, float]:
    before = {r: cpu_s(p) for r, p in roles.items()}
    subprocess.run([*bench, "--transport", transport, "--json", str(out)], check=True,
                   capture_output=True)
    level = json.loads(out.read_text())["levels"][0]
    rps = level["throughput_rps"]
    answered = level["ok"] * (1 + WARMUP_S / level["duration_s"])
    got = {r: (cpu_s(p) - before[r]) / answered * 1e6 for r, p in roles.items()}
    got["client"] = level["generator_cpu_pct"] / 100 / rps * 1e6 if rps else 0.0
    return {"rps": rps, "p50": level["p50_ms"], "batch": level["server_batch_mean"] or 0,
            **got}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--duration-s", type=float, default=6.0)
    ap.add_argument("--transports", default="http-binary,grpc,direct,http-json")
    args = ap.parse_args()
    runtime = short_tmpdir("zsrt")
    port, grpc_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(runtime / "serve.log", "wb")
    proc = subprocess.Popen([*ZEROSERVE, "serve", "--runtime-dir", str(runtime),
                             "--http-port", str(port), "--grpc-port", str(grpc_port),
                             "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    base = [*ZEROSERVE, "bench", "-m", "mlp", "--runtime-dir", str(runtime), "--url", url,
            "--grpc-url", f"127.0.0.1:{grpc_port}", "--quiet"]
    bench = [*base, "--concurrency", str(args.concurrency), "--warmup-s", str(WARMUP_S),
             "--duration-s", str(args.duration_s)]
    transports = args.transports.split(",")
    rows: dict[str, list[dict[str, float]]] = {t: [] for t in transports}
    try:
        # the first bench loads mlp; its worker is there once it answers
        wait_for(lambda: subprocess.run(["curl", "-sf", url + "/v2/health/ready"],
                                        capture_output=True).returncode == 0, 120, "serve")
        subprocess.run([*base, "--concurrency", "1", "--warmup-s", "0", "--duration-s", "1",
                        "--transport", "http-binary"], check=True, capture_output=True,
                       timeout=180)
        wait_for(lambda: bool(pids(proc.pid, "worker")), 30, "the worker")
        roles = {r: pids(proc.pid, r) for r in ("gateway", "broker", "worker")}
        out = Path(tempfile.mkdtemp(prefix="zsgrpccpu")) / "bench.json"
        for r in range(args.rounds):
            for t in transports[r % len(transports):] + transports[:r % len(transports)]:
                rows[t].append(measure(bench, t, roles, out))
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
        log.close()
        shutil.rmtree(runtime, ignore_errors=True)
    print(f"mlp, C={args.concurrency}, {args.rounds} rounds (ranges), µs of CPU per request\n"
          "| transport | req/s | p50 ms | batch | gateway | broker | worker | client |\n"
          "|---|---|---|---|---|---|---|---|")

    def span(t: str, key: str, fmt: str) -> str:
        vals = [row[key] for row in rows[t]]
        return f"{min(vals):{fmt}}-{max(vals):{fmt}}"

    for t in transports:
        print(f"| {t} | {span(t, 'rps', ',.0f')} | {span(t, 'p50', '.2f')} "
              f"| {span(t, 'batch', '.1f')} | {span(t, 'gateway', '.0f')} "
              f"| {span(t, 'broker', '.0f')} | {span(t, 'worker', '.0f')} "
              f"| {span(t, 'client', '.0f')} |")


if __name__ == "__main__":
    main()
