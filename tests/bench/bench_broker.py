"""The broker under overload, and its routing cost, before and after a change.

    .venv/bin/python -m tests.bench.bench_broker [--before REV]

1. Memory: `cnn` with its default queue (1024) and no deadlines, open loop (Poisson,
   `zeroserve bench --rate`, direct client) at 1x, 2x and 4x its capacity measured in
   the same run (closed loop, C=16). The broker's RSS is sampled every 100 ms: at the
   start, its peak during each level, and 5 s after the load.
2. Routing: `mlp`-sized requests to a tiny model on 2 workers, direct client at C=64
   over 2 processes: requests/s and broker CPU per request, beside the same run's
   broker ping floor (PING round trips with 64 outstanding, which no worker touches).

With ``--before REV`` both run against that commit too (checked out into a temp
worktree and imported from there), side by side. The load generator shares the
machine's cores with the server.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from tests.bench.harness import cpu_s, example_repo
from tests.conftest import ROOT, free_port, linear_config, short_tmpdir, wait_for, write_model

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * PAGE / 1e6



class Checkout:
    """A zeroserve source tree to run: this one, or an older commit in a worktree."""

    broker_pattern = "zeroserve.broker.server.main"

    def __init__(self, rev: str | None) -> None:
        self.rev = rev or "HEAD (working tree)"
        self.tmp: Path | None = None
        self.env = dict(os.environ)
        if rev is None:
            self.serve = [sys.executable, str(ROOT / "bin" / "zeroserve"), "serve"]
            return
        self.tmp = Path(tempfile.mkdtemp(prefix="zsbefore"))
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach",
                        str(self.tmp / "zeroserve"), rev], check=True, capture_output=True)
        self.env["PYTHONPATH"] = str(self.tmp)  # ahead of the editable install's finder
        old_cli = self.tmp / "zeroserve" / "broker" / "cli.py"
        self.serve = ([sys.executable, "-m", "zeroserve.broker.cli", "serve"]
                      if old_cli.exists() else
                      [sys.executable, str(self.tmp / "zeroserve" / "bin" / "zeroserve"),
                       "serve"])
        if old_cli.exists():  # before the broker process had its own module
            self.broker_pattern = "cli broker"

    def close(self) -> None:
        if self.tmp is not None:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                            str(self.tmp / "zeroserve")], capture_output=True)
            shutil.rmtree(self.tmp, ignore_errors=True)


class Running:
    def __init__(self, checkout: Checkout, repo: Path, workers: int,
                 extra: list[str] | None = None) -> None:
        self.runtime = short_tmpdir("zsrt")
        self.broker_pattern = checkout.broker_pattern
        self.port = free_port()
        # its own gRPC port: two servers side by side (and other users of the host)
        # must not both want 8001
        self.grpc_port = free_port()
        self.log = open(self.runtime / "serve.log", "wb")
        self.proc = subprocess.Popen(
            [*checkout.serve, "--model-dir", str(repo), "--runtime-dir", str(self.runtime),
             "--http-port", str(self.port), "--workers", str(workers), "--threads", "1",
             "--grpc-port", str(self.grpc_port), "--log-level", "warning", *(extra or [])],
            env=checkout.env, stdout=self.log,
            stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(lambda: self._ready(), 120, "the server")

    def _ready(self) -> bool:
        import urllib.request
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v2/health/ready",
                                        timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def broker_pid(self) -> int:
        out = subprocess.run(["pgrep", "-s", str(self.proc.pid), "-f", self.broker_pattern],
                             capture_output=True, text=True)
        (pid,) = [int(x) for x in out.stdout.split()]
        return pid

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(40)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.log.close()
        shutil.rmtree(self.runtime, ignore_errors=True)


def bench(srv: Running, *argv: str) -> dict[str, Any]:
    out = Path(srv.runtime) / "bench.json"
    subprocess.run([sys.executable, str(ROOT / "bin" / "zeroserve"), "bench",
                    "--transport", "direct", "--runtime-dir", str(srv.runtime),
                    "--json", str(out), "--quiet", *argv], check=True, capture_output=True)
    return json.loads(out.read_text())["levels"]  # type: ignore[no-any-return]


class Sampler(threading.Thread):
    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak, self.stop = pid, 0.0, threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.1):
            self.peak = max(self.peak, rss_mb(self.pid))


def memory(checkout: Checkout) -> list[str]:
    repo = example_repo({"cnn": {}})
    srv = Running(checkout, repo, workers=1)
    try:
        broker = srv.broker_pid()
        start = rss_mb(broker)
        cap = bench(srv, "-m", "cnn", "--concurrency", "16", "--warmup-s", "2",
                    "--duration-s", "8")[0]["throughput_rps"]
        rows = [f"| {checkout.rev} | capacity (C=16) | {cap:.0f} req/s | start {start:.0f} MB |"]
        for mult in (1, 2, 4):
            sampler = Sampler(broker)
            sampler.start()
            level = bench(srv, "-m", "cnn", "--rate", str(int(cap * mult)), "--warmup-s", "1",
                          "--duration-s", "10", "--processes", "2",
                          "--client-timeout-s", "60")[0]
            sampler.stop.set()
            sampler.join()
            errors = ", ".join(f"{k} {v}" for k, v in level["errors"].items()) or "none"
            rows.append(f"| {checkout.rev} | {mult}x ({int(cap * mult)} req/s offered) | "
                        f"{level['throughput_rps']:.0f} req/s ok, p99 {level['p99_ms']:.0f} ms,"
                        f" errors: {errors} | peak {sampler.peak:.0f} MB |")
        time.sleep(5)  # noqa: sleep-ok (the measurement: RSS a fixed time after the load)
        rows.append(f"| {checkout.rev} | 5 s after the load | | {rss_mb(broker):.0f} MB |")
        return rows
    finally:
        srv.stop()
        shutil.rmtree(repo, ignore_errors=True)


def routing(checkout: Checkout) -> list[str]:
    repo = short_tmpdir("zsbench")
    write_model(repo, "tiny", 1, "nn.Linear(4, 3)", linear_config("tiny", mbs=64))
    srv = Running(checkout, repo, workers=2)
    try:
        broker = srv.broker_pid()
        before = cpu_s([broker])
        level = bench(srv, "-m", "tiny", "--concurrency", "64", "--processes", "2",
                      "--warmup-s", "2", "--duration-s", "10")[0]
        used = cpu_s([broker]) - before
        n = level["requests"] * 1.2  # the 2 s warm-up ran at about the same rate
        pings = ping_floor(f"ipc://{srv.runtime}/frontend")
        return [f"| {checkout.rev} | {level['throughput_rps']:.0f} req/s | p50 "
                f"{level['p50_ms']:.2f} ms, p99 {level['p99_ms']:.2f} ms | broker about "
                f"{used / max(n, 1) * 1e6:.0f} µs CPU a request | ping floor {pings:.0f}/s |"]
    finally:
        srv.stop()
        shutil.rmtree(repo, ignore_errors=True)


def ping_floor(endpoint: str, inflight: int = 64, seconds: float = 5.0) -> float:
    """PING round trips per second with ``inflight`` outstanding: the broker's messaging
    floor, which no worker touches."""
    import zmq

    from zeroserve.broker import protocol as p

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    frames = p.encode(p.Ping())
    for _ in range(inflight):
        sock.send_multipart(frames)
    n, end = 0, time.monotonic() + seconds
    start = time.monotonic()
    while time.monotonic() < end and sock.poll(1000):
        sock.recv_multipart()
        n += 1
        sock.send_multipart(frames)
    sock.close()
    return n / (time.monotonic() - start)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", default=None, help="also run this commit, side by side")
    ap.add_argument("--only", choices=["memory", "routing"], default=None)
    args = ap.parse_args()
    checkouts = [Checkout(args.before)] if args.before else []
    checkouts.append(Checkout(None))
    try:
        if args.only in (None, "memory"):
            print("| code | load | answered | broker RSS |\n|---|---|---|---|")
            for c in checkouts:
                print("\n".join(memory(c)), flush=True)
        if args.only in (None, "routing"):
            print("\n| code | direct C=64, 2 processes | latency | cost |\n|---|---|---|---|")
            for c in checkouts:
                print("\n".join(routing(c)), flush=True)
    finally:
        for c in checkouts:
            c.close()


if __name__ == "__main__":
    main()
