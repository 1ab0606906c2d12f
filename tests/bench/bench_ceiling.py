"""The broker's own ceiling in routed requests/s with 64 workers.

    .venv/bin/python -m tests.bench.bench_ceiling [--workers 64] [--duration-s 8]

A real broker process (``zeroserve broker``); 64 simulated workers speaking the real
protocol on DEALER sockets (no torch: each batch is answered at once, so the broker is
the bottleneck), 32 to a process; direct clients (``zeroserve bench --transport direct``,
C=64 over 2 processes). Reported beside the same broker's ping floor (PING round trips
with 64 outstanding, which no worker touches) and a 2-worker run of the same setup, in
the same run. Everything shares the machine's cores: the load generator and the
simulated workers take CPU from the broker, so this is a floor on the ceiling.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

import numpy as np
import zmq

from tests.bench.bench_broker import cpu_s, ping_floor
from tests.conftest import ROOT, short_tmpdir, wait_for
from zeroserve.broker import protocol as p
from zeroserve.broker.client import Client
from zeroserve.broker.tensors import from_numpy

PER_PROCESS = 32


def workers_main(backend: str, first: int, count: int) -> None:
    """A process playing ``count`` workers: READY, then LOADED for every LOAD and a
    RESULT for every BATCH at once, heartbeats every 0.5 s; exits when the broker
    stops or its parent goes."""
    ctx: zmq.Context[Any] = zmq.Context()
    socks = []
    poller = zmq.Poller()
    for i in range(first, first + count):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.IDENTITY, f"sim/{i}".encode())
        s.setsockopt(zmq.SNDHWM, 0)
        s.setsockopt(zmq.RCVHWM, 0)
        s.connect(backend)
        s.send_multipart(p.encode(p.WorkerReady(f"sim/{i}", credits=2, pid=os.getpid(),
                                                host="sim", device="sim")))
        poller.register(s, zmq.POLLIN)
        socks.append(s)
    out = [from_numpy("output", np.zeros((1, 3), np.float32))]
    beat = p.encode(p.WorkerHeartbeat())
    parent, next_beat = os.getppid(), time.monotonic()
    while os.getppid() == parent:
        for s, _ in poller.poll(100):
            while s.poll(0):
                if not answer(s, s.recv_multipart(), out):
                    return
        if time.monotonic() >= next_beat:
            next_beat = time.monotonic() + 0.5
            for s in socks:
                s.send_multipart(beat)


def answer(sock: zmq.Socket[Any], frames: list[bytes], out: list[Any]) -> bool:
    kind, header, _ = p.unpack(frames)
    if kind is p.Kind.BATCH:
        sock.send_multipart(p.encode_result(p.BatchResult(header["id"], [
            p.InferReply(it[0], header["model"], header["version"], out)
            for it in header["items"]])))
    elif kind is p.Kind.LOAD:
        msg = p.decode(p.LoadModel, header)
        sock.send_multipart(p.encode(p.ModelLoaded(msg.model, msg.version, True,
                                                   sha256=msg.sha256)))
    elif kind is p.Kind.DISCONNECT:
        return False
    return True


class Setup:
    def __init__(self, workers: int) -> None:
        self.rt = short_tmpdir("zsrt")
        self.repo = short_tmpdir("zsrepo")
        (self.repo / "tiny" / "1").mkdir(parents=True)
        (self.repo / "tiny" / "1" / "model.py").write_text("class Model:\n    pass\n")
        (self.repo / "tiny" / "config.json").write_text(json.dumps({
            "name": "tiny", "platform": "python", "max_batch_size": 64,
            "inputs": [{"name": "input", "datatype": "FP32", "shape": [4]}],
            "outputs": [{"name": "output", "datatype": "FP32", "shape": [3]}]}))
        self.log = open(self.rt / "broker.log", "wb")
        self.broker = subprocess.Popen(
            [sys.executable, str(ROOT / "bin" / "zeroserve"), "broker", "--model-dir",
             str(self.repo), "--runtime-dir", str(self.rt), "--log-level", "warning"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.control = f"ipc://{self.rt}/control"
        self.frontend = f"ipc://{self.rt}/frontend"
        wait_for(lambda: (self.rt / "control").exists(), 30, "the broker")
        self.procs = [subprocess.Popen(
            [sys.executable, "-m", "tests.bench.bench_ceiling", "--play-workers",
             f"ipc://{self.rt}/backend", str(first), str(min(PER_PROCESS, workers - first))],
            cwd=ROOT) for first in range(0, workers, PER_PROCESS)]
        wait_for(lambda: len(self._holders()) == workers, 60, f"{workers} workers")

    def _holders(self) -> list[str]:
        with Client(self.control, timeout_s=5) as c:
            return c.control("models")["models"]["tiny"]["workers"]  # type: ignore[no-any-return]

    def bench(self, duration_s: float) -> dict[str, Any]:
        out = self.rt / "bench.json"
        subprocess.run([sys.executable, str(ROOT / "bin" / "zeroserve"), "bench",
                        "--transport", "direct", "--runtime-dir", str(self.rt), "-m", "tiny",
                        "--concurrency", "64", "--processes", "2", "--warmup-s", "2",
                        "--duration-s", str(duration_s), "--json", str(out), "--quiet"],
                       check=True, capture_output=True)
        return json.loads(out.read_text())["levels"][0]  # type: ignore[no-any-return]

    def close(self) -> None:
        self.broker.send_signal(signal.SIGTERM)
        try:
            self.broker.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(self.broker.pid, signal.SIGKILL)
            self.broker.wait()
        for proc in self.procs:
            proc.terminate()
            proc.wait(10)
        self.log.close()
        shutil.rmtree(self.rt, ignore_errors=True)
        shutil.rmtree(self.repo, ignore_errors=True)


def measure(workers: int, duration_s: float) -> str:
    setup = Setup(workers)
    try:
        pings = ping_floor(setup.frontend, seconds=4.0)
        before = cpu_s([setup.broker.pid])
        level = setup.bench(duration_s)
        used = cpu_s([setup.broker.pid]) - before
        n = level["requests"] * (duration_s + 2) / duration_s   # the warm-up, about
        return (f"| {workers:>2} workers | {level['throughput_rps']:>6.0f} req/s | p50 "
                f"{level['p50_ms']:.2f} ms, p99 {level['p99_ms']:.2f} ms | "
                f"{used / max(n, 1) * 1e6:.0f} µs broker CPU a request | ping floor "
                f"{pings:.0f}/s |")
    finally:
        setup.close()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--play-workers":
        workers_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--duration-s", type=float, default=8.0)
    args = ap.parse_args()
    print("| setup | routed | latency | cost | same broker, idle |\n|---|---|---|---|---|")
    for n in (args.workers, 2):
        print(measure(n, args.duration_s), flush=True)


if __name__ == "__main__":
    main()
