"""The broker's own CPU per request, in-process: the real :class:`Broker` with no
sockets, so the figure is its Python alone (no polling, no wake-ups, no peers).

    .venv/bin/python -m tests.bench.bench_broker_cpu [--workers 1,64] [--bundle 1,64]
        [--timeout-ms 0,1000] [--profile [tottime|cumtime]] [--before REV] [--traced F]

Each cycle is what the socket loop does for one request at concurrency 1: the request
arrives (``on_frontend``), the loop ticks and asks when it is next due, the batch goes
to the worker; the result arrives (``on_backend``), the loop ticks again, the reply goes
out. ``--bundle N`` sends N requests in one REQUESTS message and answers them as one
batch (the closed loop at concurrency N). Prints microseconds per request; ``--profile``
prints the top of a cProfile of the same cycles; ``--before REV`` runs an older commit
beside this tree in the same run. ``--traced F`` gives that fraction of requests a
trace context (every 1/F-th), and the played worker answers their batches with its
stamps, as a real one does.
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import json
import pstats
import subprocess
import sys
import time
from typing import Any

import numpy as np

from tests.bench.bench_broker import Checkout
from tests.bench.simcluster import write_repo
from tests.conftest import ROOT
from zeroserve.broker import protocol as p
from zeroserve.broker.server.broker import Broker
from zeroserve.broker.tensors import from_numpy


# CPU time of this thread, not wall time: the host is shared, and a turn descheduled
# by another process's would count as the broker's own
_clock = time.thread_time
ROUNDS = 10

TRACE = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
WORKER_TRACE = {"boot": "sim", "ns": {"COMPUTE_START": 1, "COMPUTE_INPUT_END": 2,
                                      "COMPUTE_OUTPUT_START": 3, "COMPUTE_END": 4}}


class Bench:
    def __init__(self, workers: int, bundle: int, timeout_ms: float = 0.0,
                 traced: float = 0.0, config: dict[str, Any] | None = None) -> None:
        self.timeout_ms = timeout_ms
        self.every = round(1 / traced) if traced else 0
        self.repo = write_repo({"tiny": {"max_batch_size": max(16, bundle), **(config or {})}})
        self.to_worker: list[tuple[bytes, list[Any]]] = []
        self.loads: list[tuple[bytes, p.LoadModel]] = []
        self.replies = 0
        self.broker = Broker(self.repo, to_client=self._to_client, to_worker=self._to_worker,
                             to_controller=lambda c, f: True, clock=time.monotonic,
                             worker_expiry_s=1e9)  # played workers do not heartbeat
        self.broker.load_catalog()
        for i in range(workers):
            ident = f"w{i}".encode()
            self.broker.on_backend(ident, p.encode(p.WorkerReady(
                f"sim/{i}", credits=2, host="sim", device="sim")))
        while self.loads:
            identity, msg = self.loads.pop()
            self.broker.on_backend(identity, p.encode(p.ModelLoaded(
                msg.model, msg.version, True, sha256=msg.sha256, memory_bytes=1 << 20)))
        self._loop_turn()
        self.bundle = bundle
        self._x = [from_numpy("input", np.zeros((1, 4), np.float32))]
        self._out = [from_numpy("output", np.zeros((1, 1), np.float32))]
        self._n = 0
        self._client_s = 0.0

    def _to_worker(self, identity: bytes, frames: list[Any]) -> bool:
        if bytes(frames[0]) == p.Kind.BATCH.value:
            self.to_worker.append((identity, frames))
            return True
        kind, header, _ = p.unpack(frames)
        if kind is p.Kind.LOAD:
            self.loads.append((identity, p.decode(p.LoadModel, header)))
        return True

    def _to_client(self, client: bytes, frames: list[Any]) -> bool:
        t0 = _clock()
        kind, header, _ = p.unpack(frames)
        self.replies += len(header["replies"]) if kind is p.Kind.REPLIES else \
            int(kind is p.Kind.REPLY)
        self._client_s += _clock() - t0
        return True

    def _loop_turn(self) -> None:
        now = time.monotonic()
        self.broker.finished(now)
        self.broker.next_due(now)
        self.broker.tick(now)

    def cycle(self) -> float:
        """One request (or bundle) through; returns the seconds spent playing the
        peers (encoding requests and results, reading answers), which are not the
        broker's."""
        t0 = _clock()
        reqs = []
        for _ in range(self.bundle):
            self._n += 1
            if self.every and self._n % self.every == 0:
                reqs.append(p.InferRequest(str(self._n), "tiny", self._x,
                                           timeout_ms=self.timeout_ms, trace=TRACE))
            else:
                reqs.append(p.InferRequest(str(self._n), "tiny", self._x,
                                           timeout_ms=self.timeout_ms))
        frames = p.encode_request(reqs[0]) if self.bundle == 1 else p.encode_requests(reqs)
        peer = _clock() - t0
        self.broker.on_frontend(b"client", frames)
        self._loop_turn()
        while self.to_worker:
            t0 = _clock()
            identity, batch = self.to_worker.pop()
            _, header, _ = p.unpack(batch)
            result = p.BatchResult(header["id"], [
                p.InferReply(it[0], "tiny", header["version"], self._out)
                for it in header["items"]], compute_ms=0.1,
                **({"trace": WORKER_TRACE} if header.get("trace") else {}))
            frames = p.encode_result(result)
            peer += _clock() - t0
            self.broker.on_backend(identity, frames)
            self._loop_turn()
        return peer + self.peer_s()

    def peer_s(self) -> float:
        spent, self._client_s = self._client_s, 0.0
        return spent

def measure(workers: int, bundle: int, timeout_ms: float, requests: int,
            profile: str | None, traced: float = 0.0) -> float:
    """Broker microseconds a request, the least of ten rounds (the peers' part taken out):
    on a shared host a round only ever comes out slower than the code is."""
    b = Bench(workers, bundle, timeout_ms, traced)
    try:
        cycles = max(5, requests // bundle)
        for _ in range(min(200, cycles)):
            b.cycle()
        rounds = []
        for _ in range(ROUNDS):
            t, peer = _clock(), 0.0
            for _ in range(cycles // ROUNDS):
                peer += b.cycle()
            rounds.append((_clock() - t - peer) / (cycles // ROUNDS * bundle))
        answered = min(200, cycles) + cycles // ROUNDS * ROUNDS
        assert b.replies == answered * bundle, (b.replies, answered * bundle)
        if profile:
            prof = cProfile.Profile()
            prof.runcall(lambda: [b.cycle() for _ in range(cycles // ROUNDS)])
            pstats.Stats(prof).sort_stats(profile).print_stats(40)
        return min(rounds) * 1e6
    finally:
        b.broker.close()


def rows(args: argparse.Namespace) -> list[tuple[int, int, float]]:
    return list(itertools.product(
        [int(w) for w in args.workers.split(",")], [int(b) for b in args.bundle.split(",")],
        [float(t) for t in args.timeout_ms.split(",")]))


def side_by_side(args: argparse.Namespace) -> None:
    """This tree and ``--before REV`` in turn, ``--repeat`` times each (the lowest kept, as
    the least disturbed), in child processes importing each tree's zeroserve."""
    argv = ["--workers", args.workers, "--bundle", args.bundle, "--timeout-ms",
            args.timeout_ms, "--requests", str(args.requests), "--json"]
    checkouts = [Checkout(args.before), Checkout(None)]
    best: list[list[float]] = [[], []]
    try:
        for _ in range(args.repeat):
            for i, co in enumerate(checkouts):
                out = subprocess.run([sys.executable, "-m", "tests.bench.bench_broker_cpu",
                                      *argv], env=co.env, cwd=ROOT, check=True,
                                     capture_output=True, text=True).stdout
                got = json.loads(out)
                best[i] = [min(a, b) for a, b in zip(best[i], got)] if best[i] else got
    finally:
        for co in checkouts:
            co.close()
    print(f"| workers | requests a message | deadline | before ({args.before}) | now |\n"
          "|---|---|---|---|---|")
    for (workers, bundle, timeout_ms), old, new in zip(rows(args), *best):
        print(f"| {workers} | {bundle} | {f'{timeout_ms:g} ms' if timeout_ms else 'none'} "
              f"| {old:.1f} µs | {new:.1f} µs |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", default="1,64")
    ap.add_argument("--bundle", default="1,64")
    ap.add_argument("--timeout-ms", default="0,1000",
                    help="each request's deadline (0: none), a row each")
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--profile", nargs="?", const="tottime", default=None,
                    help="print a cProfile, in this order (tottime, cumtime)")
    ap.add_argument("--before", default=None, help="a commit to measure beside this tree")
    ap.add_argument("--repeat", type=int, default=2,
                    help="with --before: runs of each tree, interleaved")
    ap.add_argument("--json", action="store_true", help="print the figures as a JSON list")
    ap.add_argument("--traced", type=float, default=0.0,
                    help="fraction of requests traced (0.01: every 100th; 1: all)")
    args = ap.parse_args()
    try:
        from zeroserve.broker.process import tune_gc
        tune_gc()   # as the broker's process does (options.run_component)
    except ImportError:
        pass   # a --before commit older than it
    if args.before:
        side_by_side(args)
        return
    if not args.json:
        print("| workers | requests a message | deadline | broker µs a request |\n"
              "|---|---|---|---|")
    figures = []
    for workers, bundle, timeout_ms in rows(args):
        us = measure(workers, bundle, timeout_ms, args.requests, args.profile, args.traced)
        figures.append(us)
        if not args.json:
            print(f"| {workers} | {bundle} | {f'{timeout_ms:g} ms' if timeout_ms else 'none'} "
                  f"| {us:.1f} |", flush=True)
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
