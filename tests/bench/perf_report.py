"""The measured tables of docs/performance.md, regenerated from ``zeroserve bench`` runs.

    python -m tests.bench.perf_report --write-docs

One ``zeroserve serve --workers 1`` on the bundled examples, then:
  * the request path on ``mlp``: the broker's ping (the messaging floor), the direct
    client, HTTP v2 JSON and binary, at C = 1, 16, 64, with the in-process baseline of
    the same run and the PNG of latency and throughput against load;
  * overload on ``cnn``: its capacity measured closed loop over HTTP, then an open
    loop at twice that (Poisson), 30% priority 1 and 70% priority 2, every request with
    a 50 ms deadline, each priority from its own ``zeroserve bench`` process.
The tables go to tests/bench/results/performance.md and, with --write-docs, between
the ``perf-report`` markers of docs/performance.md; the PNG goes to docs/img/.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from tests.bench.harness import ROOT, example_repo, start
from tests.conftest import Server

RESULTS = ROOT / "tests" / "bench" / "results"
PAGE = ROOT / "docs" / "performance.md"
IMAGES = ROOT / "docs" / "img"
BEGIN, END = "<!-- perf-report:begin -->", "<!-- perf-report:end -->"
TRANSPORT_NAMES = {"ping": "broker ping (the floor)", "direct": "direct client",
                   "http-json": "HTTP, v2 JSON", "http-binary": "HTTP, v2 binary"}


def bench(server: Server, *argv: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    out = Path(tempfile.mkstemp(suffix=".json")[1])
    cmd = [sys.executable, "-m", "zeroserve.broker.bench", "--url", server.url,
           "--runtime-dir", str(server.runtime), "--quiet", "--json", str(out), *argv]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr}")
    data = json.loads(out.read_text())
    out.unlink()
    return data["levels"], data["run"]


def ms(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def metric(server: Server, name: str) -> float:
    with urllib.request.urlopen(server.url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text,
                                                       re.MULTILINE))


def request_path(server: Server, args: argparse.Namespace) -> str:
    png = IMAGES / "request-path.png"
    rows, settings = bench(server, "-m", "mlp", "--transport", "ping,direct,http-json,http-binary",
                           "--concurrency", "1,16,64", "--warmup-s", str(args.warmup_s),
                           "--duration-s", str(args.duration_s), "--in-process",
                           "--plot", str(png))
    lines = ["| path | C | req/s | p50 ms | p99 ms | server batch (mean) | generator |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        batch = r.get("server_batch_mean")
        lines.append(f"| {TRANSPORT_NAMES[r['transport']]} | {int(r['load'])} | "
                     f"{r['throughput_rps']:,.0f} | {ms(r['p50_ms'])} | {ms(r['p99_ms'])} | "
                     f"{f'{batch:.1f}' if batch else ''} | "
                     f"{r.get('bottleneck') or 'not limiting'} |")
    base = settings.get("in_process") or {}
    calls = ", ".join(f"batch {b['batch']}: {b['ms_per_call']:.3f} ms a call "
                      f"({b['samples_per_s']:,.0f} samples/s)" for b in base.get("results", []))
    lines.append(f"\nIn-process `mlp`, same run, {base.get('threads', '?')} thread(s): {calls}.")
    lines.append(f"\n![latency and throughput against load](img/{png.name})")
    return "\n".join(lines)


def overload(server: Server, args: argparse.Namespace, transport: str) -> str:
    cap_rows, _ = bench(server, "-m", "cnn", "--transport", transport, "--concurrency", "16",
                        "--warmup-s", "3", "--duration-s", str(min(args.duration_s, 10)))
    capacity = cap_rows[0]["throughput_rps"]
    offered = 2 * capacity
    expired_before = metric(server, "zeroserve_worker_expired_requests_total")
    procs = []
    for share, priority, seed in ((0.3, 1, 1), (0.7, 2, 2)):
        out = Path(tempfile.mkstemp(suffix=".json")[1])
        cmd = [sys.executable, "-m", "zeroserve.broker.bench", "--url", server.url, "-m", "cnn",
               "--runtime-dir", str(server.runtime), "--transport", transport,
               "--rate", f"{offered * share:.1f}", "--priority", str(priority),
               "--timeout-ms", "50", "--warmup-s", "3", "--duration-s", str(args.duration_s),
               "--seed", str(seed), "--quiet", "--json", str(out)]
        procs.append((priority, out, subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True,
                                                      stdout=subprocess.DEVNULL)))
    lines = [f"**{TRANSPORT_NAMES[transport]}**: `cnn` capacity, closed loop C=16: "
             f"{capacity:,.0f} req/s; offered {offered:,.0f} req/s (open loop, Poisson), every "
             "request with a 50 ms deadline, each priority from its own process.\n",
             "| priority | share | sent | answered in 50 ms | goodput | errors | p50 of 200s |",
             "|---|---|---|---|---|---|---|"]
    for priority, out, proc in procs:
        _, err = proc.communicate()
        if proc.returncode != 0:
            raise SystemExit(f"overload bench failed: {err}")
        r = json.loads(out.read_text())["levels"][0]
        out.unlink()
        errors = ", ".join(f"{n:,} × {k}" for k, n in sorted(r["errors"].items())) or "none"
        lines.append(f"| {priority} | {30 if priority == 1 else 70}% | {r['requests']:,} | "
                     f"{100 * r['goodput_rps'] / max(r['requests'] / r['duration_s'], 1e-9):.1f}"
                     "% | "
                     f"{r['goodput_rps']:,.0f} req/s | {errors} | {ms(r['p50_ms'])} ms |")
    expired = metric(server, "zeroserve_worker_expired_requests_total") - expired_before
    lines.append(f"\nBatches a worker refused to start because their deadline had passed: "
                 f"{expired:,.0f} requests; none is ever executed after its deadline.")
    return "\n".join(lines)


def write_docs(text: str) -> None:
    body = PAGE.read_text()
    if BEGIN not in body or END not in body:
        raise SystemExit(f"{PAGE} has no {BEGIN} … {END} markers")
    head, rest = body.split(BEGIN, 1)
    PAGE.write_text(f"{head}{BEGIN}\n{text}\n{END}{rest.split(END, 1)[1]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--warmup-s", type=float, default=3.0)
    ap.add_argument("--duration-s", type=float, default=20.0)
    ap.add_argument("--write-docs", action="store_true",
                    help="replace the tables between the markers of docs/performance.md")
    ap.add_argument("--overload-transports", default="direct,http-binary")
    ap.add_argument("--skip-request-path", action="store_true")
    args = ap.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    server = start(example_repo())
    try:
        text = "\n\n".join([
            f"Regenerated by `python -m tests.bench.perf_report`: {os.cpu_count()} cores "
            f"shared by the load generator and the server, `zeroserve serve --workers 1`, "
            f"{args.warmup_s:g} s warm-up then {args.duration_s:g} s counted per level, one "
            "sample per request.",
            "" if args.skip_request_path else
            "**The request path, `mlp`**\n\n" + request_path(server, args),
            "**Deadlines under overload, `cnn`**\n\n" + "\n\n".join(
                overload(server, args, t) for t in args.overload_transports.split(","))])
    finally:
        server.stop()
    (RESULTS / "performance.md").write_text(text + "\n")
    print(text)
    if args.write_docs:
        write_docs(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
