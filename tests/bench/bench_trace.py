"""What tracing costs over HTTP: one server per setting, all running at once and
measured in turn (A B C ... A B C ...), ``--rounds`` times, with ``zeroserve bench`` at
one concurrency. The settings: tracing off; Triton mode 1% and 100% sampled (records
written every 100 traces); opentelemetry mode off (the SDK loaded, level OFF), 1% and
100% sampled, exporting over OTLP/HTTP to a receiver in this process
(tests/otlp.py, which counts what arrives).

    .venv/bin/python -m tests.bench.bench_trace [--rounds 3] [--concurrency 16] \
        [--duration-s 6] [--modes triton,opentelemetry]

Prints req/s (best round) and the CPU each process spent per request (gateway, broker,
worker: process CPU time over requests answered, the warm-up second included) as the
range over the rounds, and the spans the receiver got.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
from pathlib import Path

from tests.bench.harness import cpu_s
from tests.conftest import ZEROSERVE, Server, linear_config, short_tmpdir, write_model

SAMPLED = {"1%": ["level=TIMESTAMPS", "rate=100"], "100%": ["level=TIMESTAMPS", "rate=1"]}
ROLES = ("gateway", "broker", "worker")


def settings(modes: list[str], traces: Path, otlp_port: int) -> dict[str, list[str]]:
    """Each setting's --trace-config entries."""
    out: dict[str, list[str]] = {"off": []}
    if "triton" in modes:
        for name, entries in SAMPLED.items():
            out[f"triton {name}"] = [*entries, f"triton,file={traces / name}",
                                     "triton,log-frequency=100"]
    if "opentelemetry" in modes:
        otel = ["mode=opentelemetry",
                f"opentelemetry,url=127.0.0.1:{otlp_port}/v1/traces"]
        out["otel off"] = otel
        for name, entries in SAMPLED.items():
            out[f"otel {name}"] = [*otel, *entries]
    return out


def measure(srv: Server, args: argparse.Namespace, out: Path) -> dict[str, float]:
    roles = {r: srv.pids(r) for r in ("gateway", "broker", "worker")}
    before = {r: cpu_s(p) for r, p in roles.items()}
    subprocess.run([*ZEROSERVE, "bench", "-m", "linear", "--transport", "http-json",
                    "--url", srv.url, "--concurrency", str(args.concurrency),
                    "--duration-s", str(args.duration_s), "--warmup-s", "1", "--quiet",
                    "--json", str(out)], check=True, capture_output=True)
    level = json.loads(out.read_text())["levels"][0]
    answered = level["ok"]
    got = {r: (cpu_s(p) - before[r]) / answered * 1e6 for r, p in roles.items()}
    return {"rps": level["throughput_rps"], **got}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--duration-s", type=float, default=6.0)
    ap.add_argument("--modes", default="triton,opentelemetry",
                    help="comma-separated: triton, opentelemetry")
    args = ap.parse_args()
    modes = args.modes.split(",")
    receiver = None
    if "opentelemetry" in modes:
        from tests.otlp import Receiver

        receiver = Receiver(keep=False)
    repo = short_tmpdir("zsrepo")
    traces = Path(tempfile.mkdtemp(prefix="zstraces"))
    write_model(repo, "linear", 1, "nn.Linear(4, 3)", linear_config("linear", mbs=64))
    servers: dict[str, Server] = {}
    runs: dict[str, list[dict[str, float]]] = {}
    try:
        for name, entries in settings(modes, traces, receiver.port if receiver else 0).items():
            extra = [a for e in entries for a in ("--trace-config", e)]
            servers[name] = Server(repo, extra=extra).wait_ready()
        names = list(servers)
        for r in range(args.rounds):   # each round starts with the next setting
            for name in names[r % len(names):] + names[:r % len(names)]:
                runs.setdefault(name, []).append(
                    measure(servers[name], args, traces / "bench.json"))
    finally:
        for srv in servers.values():
            srv.stop()
        shutil.rmtree(repo, ignore_errors=True)
        written = sum(1 for _ in traces.glob("*.*")) - 1
        shutil.rmtree(traces, ignore_errors=True)
        if receiver is not None:
            receiver.close()
    spans = f", {receiver.count:,} spans received" if receiver else ""
    print(f"linear over HTTP JSON, C={args.concurrency}, {args.rounds} rounds "
          f"({written} trace files written{spans}); req/s: the best round, "
          "CPU: the range over the rounds\n"
          "| tracing | req/s | gateway µs/req | broker µs/req | worker µs/req |\n"
          "|---|---|---|---|---|")
    for name, got in runs.items():
        cells = [f"{min(g[r] for g in got):.0f}-{max(g[r] for g in got):.0f}" for r in ROLES]
        print(f"| {name} | {max(g['rps'] for g in got):,.0f} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
