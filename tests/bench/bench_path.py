"""The direct request path against its floor, before and after a change, in one run.

    .venv/bin/python -m tests.bench.bench_path [--before REV] [--repeats N]

Per checkout (this tree, and ``--before REV`` in a temp worktree), on the bundled `mlp`
with one worker; every server runs at once and they are measured in turn,
``--repeats`` times, so each sees the same (shared) machine; medians are reported:

* ping: the broker's PING round trip at concurrency 1 (p50, a plain DEALER) and its
  rate with 64 outstanding: the messaging floor no worker touches;
* direct: ``zeroserve bench --transport direct`` at C=1 (p50) and C=64 (req/s), with
  the CPU each process spent per request (process CPU time over requests answered);
* in-process: the model called directly (``--in-process``), batch 1 and the batch the
  C=64 level formed;
* the gateway's front ends at C=64: HTTP v2 JSON, HTTP v2 binary tensors and gRPC, with
  the CPU each process spent per request (the gateway's is the figure they move).

``--loads`` picks among ``c1,c64,http64,bin64,grpc64`` (default all).

The target: direct p50 at C=1 within 0.2 ms of ping p50 + in-process batch-1 time.
The load generator shares the machine's cores with the server.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.bench.bench_broker import Checkout, Running, cpu_s, ping_floor
from tests.bench.harness import example_repo
from tests.conftest import ROOT


def ping_p50_ms(endpoint: str, n: int = 2000) -> float:
    import zmq

    from zeroserve.broker import protocol as p

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    frames = p.encode(p.Ping())
    took = []
    try:
        for i in range(n + 200):
            t = time.perf_counter()
            sock.send_multipart(frames)
            if not sock.poll(2000):
                raise RuntimeError("no PONG within 2 s")
            sock.recv_multipart()
            if i >= 200:
                took.append(time.perf_counter() - t)
    finally:
        sock.close()
    return statistics.median(took) * 1000


def pids(srv: Running) -> dict[str, int]:
    out = subprocess.run(["ps", "-s", str(srv.proc.pid), "-o", "pid=,args="],
                         capture_output=True, text=True).stdout
    found = {}
    for line in out.splitlines():
        pid, _, cmd = line.strip().partition(" ")
        for name, pattern in (("broker", "broker.server.main"), ("broker", "cli broker"),
                              ("broker", " broker "), ("worker", " worker "),
                              ("worker", "workers.main"), ("gateway", "gateway.serve"),
                              ("gateway", " gateway ")):
            if pattern in f" {cmd} " and name not in found:
                found[name] = int(pid)
    return found


def direct(srv: Running, conc: int, warmup_s: float, duration_s: float,
           procs: dict[str, int], in_process: bool = False, transport: str = "direct"
           ) -> dict[str, Any]:
    out = Path(srv.runtime) / "bench.json"
    cmd = [sys.executable, str(ROOT / "bin" / "zeroserve"), "bench", "-m", "mlp",
           "--transport", transport, "--runtime-dir", str(srv.runtime),
           "--url", f"http://127.0.0.1:{srv.port}", "--grpc-url", f"127.0.0.1:{srv.grpc_port}",
           "--concurrency", str(conc), "--warmup-s", str(warmup_s),
           "--duration-s", str(duration_s), "--json", str(out), "--quiet"]
    if in_process:
        cmd += ["--in-process", "--in-process-threads", "1"]
    before = {k: cpu_s([pid]) for k, pid in procs.items()}
    subprocess.run(cmd, check=True)
    level = json.loads(out.read_text())
    row = level["levels"][0]
    n = row["requests"] * (warmup_s + duration_s + 0.3) / duration_s  # warm-up ran alike
    row["cpu_us"] = {k: (cpu_s([pid]) - before[k]) / n * 1e6 for k, pid in procs.items()}
    row["baseline"] = level.get("baseline")
    return row


FRONT_ENDS = {"http64": ("http-json", "HTTP JSON"), "bin64": ("http-binary", "HTTP binary"),
              "grpc64": ("grpc", "gRPC")}
LOADS = ("c1", "c64", *FRONT_ENDS)


def one_round(srv: Running, procs: dict[str, int], loads: tuple[str, ...]) -> dict[str, Any]:
    endpoint = f"ipc://{srv.runtime}/frontend"
    res: dict[str, Any] = {"ping_p50_ms": ping_p50_ms(endpoint, 1000),
                           "ping64_rps": ping_floor(endpoint, 64, 2.0)}
    if "c1" in loads:
        res["c1"] = direct(srv, 1, 0.5, 3.0, procs, in_process=True)
    if "c64" in loads:
        res["c64"] = direct(srv, 64, 1.0, 4.0, procs, in_process=True)
    for level, (transport, _) in FRONT_ENDS.items():
        if level in loads:
            res[level] = direct(srv, 64, 1.0, 4.0, procs, transport=transport)
    return res


def _all(rounds: list[dict[str, Any]], level: str, key: str, fmt: str) -> str:
    return ", ".join(format(r[level][key], fmt) for r in rounds)


def _cpu(rounds: list[dict[str, Any]], level: str) -> dict[str, int]:
    return {k: round(statistics.median(r[level]["cpu_us"][k] for r in rounds))
            for k in rounds[0][level]["cpu_us"]}


def summary(rev: str, rounds: list[dict[str, Any]]) -> list[str]:
    def med(f: Any) -> float:
        return statistics.median(f(r) for r in rounds)
    lines = []
    if "c1" in rounds[0]:
        lines.append(c1_line(rev, rounds))
    if "c64" in rounds[0]:
        lines.append(c64_line(rev, rounds))
    for level, (_, label) in FRONT_ENDS.items():
        if level in rounds[0]:
            lines.append(
                f"| {rev} | {label} C=64 | {med(lambda r: r[level]['throughput_rps']):.0f}"
                f" req/s (all: {_all(rounds, level, 'throughput_rps', '.0f')}), p99 "
                f"{med(lambda r: r[level]['p99_ms']):.2f} ms | | cpu/req µs "
                f"{json.dumps(_cpu(rounds, level))} |")
    return lines


def c1_line(rev: str, rounds: list[dict[str, Any]]) -> str:
    def med(f: Any) -> float:
        return statistics.median(f(r) for r in rounds)
    ping = med(lambda r: r["ping_p50_ms"])
    c1 = med(lambda r: r["c1"]["p50_ms"])
    ip = med(lambda r: r["c1"]["in_process_ms"])
    return (f"| {rev} | C=1 | p50 {c1:.3f} ms (all: "
            f"{_all(rounds, 'c1', 'p50_ms', '.3f')}) | ping p50 "
            f"{ping:.3f} ms + in-process {ip:.3f} ms = {ping + ip:.3f} ms, gap "
            f"{c1 - ping - ip:.3f} ms | cpu/req µs "
            f"{json.dumps(_cpu(rounds, 'c1'))} |")


def c64_line(rev: str, rounds: list[dict[str, Any]]) -> str:
    def med(f: Any) -> float:
        return statistics.median(f(r) for r in rounds)
    ping64 = med(lambda r: r["ping64_rps"])
    c64 = med(lambda r: r["c64"]["throughput_rps"])
    ips = [r["c64"]["in_process_samples_per_s"] for r in rounds]
    cpu = _cpu(rounds, "c64")
    return (f"| {rev} | C=64 | {c64:.0f} req/s (all: "
            f"{_all(rounds, 'c64', 'throughput_rps', '.0f')}), p99 "
            f"{med(lambda r: r['c64']['p99_ms']):.2f} ms, batch "
            f"{med(lambda r: r['c64']['server_batch_mean'] or 0):.1f} | ping C=64 "
            f"{ping64:.0f}/s, in-process {statistics.median(ips) if ips else 0:.0f}"
            f" samples/s | cpu/req µs {json.dumps(cpu)}, generator "
            f"{med(lambda r: r['c64']['generator_cpu_pct'] or 0):.0f}% |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", default=None, help="also run this commit, side by side")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None, help="write every round's figures here")
    ap.add_argument("--loads", default=",".join(LOADS),
                    help=f"which to measure, of {','.join(LOADS)}")
    args = ap.parse_args()
    loads = tuple(x.strip() for x in args.loads.split(",") if x.strip())
    if not loads or set(loads) - set(LOADS):
        ap.error(f"--loads {args.loads!r}: choose from {','.join(LOADS)}")
    checkouts = ([Checkout(args.before)] if args.before else []) + [Checkout(None)]
    repo = example_repo({"mlp": {}})
    rounds: dict[str, list[dict[str, Any]]] = {c.rev: [] for c in checkouts}
    servers: list[Running] = []
    try:
        # every server up at once, measured in turn: each sees the same (shared) machine
        servers = [Running(c, repo, workers=1) for c in checkouts]
        procs = [pids(srv) for srv in servers]
        for _ in range(args.repeats):
            for c, srv, pp in zip(checkouts, servers, procs):
                rounds[c.rev].append(one_round(srv, pp, loads))
        print("| code | load | direct client | floor | CPU |\n|---|---|---|---|---|")
        for c in checkouts:
            print("\n".join(summary(c.rev, rounds[c.rev])), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(rounds, indent=1))
    finally:
        for srv in servers:
            srv.stop()
        for c in checkouts:
            c.close()
        shutil.rmtree(repo, ignore_errors=True)


if __name__ == "__main__":
    main()
