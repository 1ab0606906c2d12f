"""One real worker process, played by a broker of our own: batches of one request, one
at a time, so the figure is the worker's own hop (its socket, threads and per-batch
Python) and the model, with no broker, client or gateway beside it.

    .venv/bin/python -m tests.bench.bench_worker [--model mlp] [--batches 2000]
        [--rounds 5] [--before REV]

Prints, per round, the round trip (the batch sent to its result received) p50 and p99,
and the worker's CPU and context switches (every thread's, ZeroMQ's included) per
batch. ``--before REV`` starts an older commit's worker beside this tree's, and the
rounds alternate between the two, so both meet the same load from the rest of the host.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from tests.bench.bench_broker import Checkout
from tests.conftest import short_tmpdir
from zeroserve.broker import protocol as p
from zeroserve.broker.runtime import cache_dir
from zeroserve.workers.supervisor import ensure_examples


def _proc_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _switches(pid: int) -> int:
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if "ctxt_switches" in line:   # voluntary and not
                total += int(line.split()[1])
    return total


class PlayedBroker:
    """A ROUTER that registers one worker, has it load the model, and sends batches."""

    def __init__(self, checkout: Checkout, model_dir: Path, model: str) -> None:
        self.model = model
        self.runtime = short_tmpdir("zswb")
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        endpoint = f"ipc://{self.runtime}/backend"
        self.sock.bind(endpoint)
        self.log = open(self.runtime / "worker.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "zeroserve.workers.main", "--backend", endpoint,
             "--threads", "1", "--index", "0", "--log-level", "warning"],
            env=checkout.env, stdout=self.log, stderr=subprocess.STDOUT)
        self.ident = self._expect(p.Kind.READY, 60)[0]
        config = json.loads((model_dir / model / "config.json").read_text())
        # a long expiry: the worker of the other tree waits out this one's rounds
        self._send(p.encode(p.BrokerHeartbeat(0.5, 3600.0)))
        self._send(p.encode(p.LoadModel(model, 1, str(model_dir / model / "1"), config)))
        loaded = p.decode(p.ModelLoaded, self._expect(p.Kind.LOADED, 120)[1])
        if not loaded.ok:
            raise SystemExit(f"the worker did not load {model}: {loaded.error}")
        self.next_beat = time.monotonic() + 0.5
        self.ids = 0

    def _send(self, frames: list[Any]) -> None:
        self.sock.send_multipart([self.ident, *frames], copy=False)

    def _expect(self, kind: p.Kind, timeout_s: float) -> tuple[bytes, dict[str, Any]]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.sock.poll(int((deadline - time.monotonic()) * 1000) + 1):
                break
            frames = self.sock.recv_multipart()
            got, header, _ = p.unpack(frames[1:])
            if got is kind:
                return frames[0], header
        raise SystemExit(f"no {kind.name} from the worker within {timeout_s:g} s; its log:\n"
                         + (self.runtime / "worker.log").read_text()[-2000:])

    def round(self, batches: int, x: np.ndarray) -> dict[str, float]:
        tensors = [p.from_numpy("input", x)]
        cpu0, cs0 = _proc_cpu_s(self.proc.pid), _switches(self.proc.pid)
        took = []
        for _ in range(batches):
            now = time.monotonic()
            if now >= self.next_beat:   # as the broker does: else the worker reconnects
                self._send(p.encode(p.BrokerHeartbeat(0.5, 3600.0)))
                self.next_beat = now + 0.5
            self.ids += 1
            t0 = time.perf_counter()
            self._send(p.encode_batch(p.Batch(self.ids, self.model, 1,
                                              [p.BatchItem(str(self.ids), tensors)])))
            self._expect(p.Kind.RESULT, 10)
            took.append(time.perf_counter() - t0)
        cpu, cs = _proc_cpu_s(self.proc.pid) - cpu0, _switches(self.proc.pid) - cs0
        took.sort()
        return {"p50_ms": took[len(took) // 2] * 1e3, "p99_ms": took[int(len(took) * .99)] * 1e3,
                "cpu_us": cpu / batches * 1e6, "switches": cs / batches}

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.sock.close(linger=0)
        self.ctx.term()
        self.log.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="mlp", help="a bundled example")
    ap.add_argument("--batches", type=int, default=2000, help="per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--before", default=None, help="an older commit to run beside this tree")
    args = ap.parse_args(argv)
    model_dir = ensure_examples(cache_dir())
    checkouts = [Checkout(None)] + ([Checkout(args.before)] if args.before else [])
    played = [PlayedBroker(c, model_dir, args.model) for c in checkouts]
    shape = json.loads((model_dir / args.model / "config.json").read_text())["inputs"][0]
    x = np.random.default_rng(0).random((1, *shape["shape"]), np.float32)
    try:
        for pb in played:
            pb.round(200, x)   # warm
        print(f"{'tree':24s} {'p50 ms':>7s} {'p99 ms':>7s} {'cpu us':>7s} {'cs':>6s}   "
              f"(batches of 1 request, {args.batches} a round; load {os.getloadavg()[0]:.1f})")
        for _ in range(args.rounds):
            for c, pb in zip(checkouts, played):
                r = pb.round(args.batches, x)
                print(f"{c.rev[:24]:24s} {r['p50_ms']:7.3f} {r['p99_ms']:7.3f} "
                      f"{r['cpu_us']:7.1f} {r['switches']:6.2f}", flush=True)
    finally:
        for pb in played:
            pb.close()
        for c in checkouts:
            c.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
