"""How the broker's CPU a request grows with the workers it routes to and with the
requests queued ahead: two curves, printed and plotted.

    .venv/bin/python -m tests.bench.bench_broker_growth [--workers 2,4,...,256]
        [--queued 1,10,100,1000,10000] [--plot docs/img/broker-growth.png]

Both run the real :class:`Broker` in-process with no sockets (as bench_broker_cpu,
whose cycle they reuse), timed on this thread's CPU clock, the least of ten rounds:

- **workers**: W simulated workers hold the model, each with two credits; one request
  at a time (a REQUEST, its batch, its result, its REPLY), and 64 at a time (a
  REQUESTS message answered as one batch, the closed loop at concurrency 64).
- **queued**: one worker with two batches in flight always, and Q requests queued
  behind them, each with a deadline out of arrival order (so admission predicts the
  wait ahead of it, and the queue's deadline order is not its arrival order):
  16 requests arrive, the oldest batch returns, the next 16 leave the queue's head, so
  the queue stays at Q. Every request is answered; the census is checked empty after.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from tests.bench.bench_broker_cpu import ROUNDS, Bench, _clock
from zeroserve.broker import protocol as p

BATCH = 16   # the model's max_batch_size in the queued curve: one batch per cycle


def per_request_us(bench: Any, cycles: int, per_cycle: int) -> float:
    """The least, over ROUNDS rounds, of the broker's CPU a request (peers' part out)."""
    for _ in range(min(100, cycles)):
        bench.cycle()
    best = float("inf")
    for _ in range(ROUNDS):
        t, peer = _clock(), 0.0
        for _ in range(max(1, cycles // ROUNDS)):
            peer += bench.cycle()
        best = min(best, (_clock() - t - peer) / (max(1, cycles // ROUNDS) * per_cycle))
    return best * 1e6


class QueuedBench(Bench):
    """A broker whose one worker is never idle and whose queue stays at ``queued``."""

    def __init__(self, queued: int) -> None:
        super().__init__(1, BATCH, timeout_ms=600_000.0,
                         config={"dynamic_batching": {
                             "max_queue_size": queued + 4 * BATCH,
                             # making 10,000 requests takes seconds here; with the default
                             # (1 s) they would all be served oldest first, by the aging rule
                             "aging_ms": 600_000}})
        self.held: list[tuple[bytes, list[Any]]] = []   # batches at the worker, oldest first
        # queued while the worker is drained, so no batch sits at it longer than the stall
        # rule allows (a second) while 10,000 requests are made; then two batches go out
        self.broker.pool.set_draining("sim/0", True)
        self._arrive(2 * BATCH + queued)
        self.broker.pool.set_draining("sim/0", False)
        self._loop_turn()
        self.held.extend(self.to_worker)
        self.to_worker.clear()
        assert self.broker.scheduler.depth("tiny") == queued, \
            self.broker.scheduler.depth("tiny")

    def _arrive(self, n: int) -> float:
        peer, t0 = 0.0, _clock()
        for start in range(0, n, p.MAX_BUNDLE):
            reqs = []
            for _ in range(min(p.MAX_BUNDLE, n - start)):
                self._n += 1
                # deadlines out of arrival order, as mixed clients' are: the queue's
                # deadline order is then no longer its arrival order
                reqs.append(p.InferRequest(str(self._n), "tiny", self._x,
                                           timeout_ms=self.timeout_ms + self._n * 7919 % 1000))
            frames = p.encode_requests(reqs)
            peer += _clock() - t0
            self.broker.on_frontend(b"client", frames)
            self._loop_turn()
            self.held.extend(self.to_worker)
            self.to_worker.clear()
            t0 = _clock()
        return peer

    def cycle(self) -> float:
        peer = self._arrive(BATCH)
        t0 = _clock()
        identity, batch = self.held.pop(0)
        _, header, _ = p.unpack(batch)
        frames = p.encode_result(p.BatchResult(header["id"], [
            p.InferReply(it[0], "tiny", header["version"], self._out)
            for it in header["items"]], compute_ms=0.1))
        peer += _clock() - t0
        self.broker.on_backend(identity, frames)
        self._loop_turn()
        self.held.extend(self.to_worker)
        self.to_worker.clear()
        return peer + self.peer_s()

    def finish(self) -> None:
        """Answer everything left, then check that nothing of any request remains."""
        while self.held:
            identity, batch = self.held.pop(0)
            _, header, _ = p.unpack(batch)
            self.broker.on_backend(identity, p.encode_result(p.BatchResult(header["id"], [
                p.InferReply(it[0], "tiny", header["version"], self._out)
                for it in header["items"]], compute_ms=0.1)))
            self._loop_turn()
            self.held.extend(self.to_worker)
            self.to_worker.clear()
        census = self.broker.census()
        assert not any(census.values()), census
        assert self.replies == self._n, (self.replies, self._n)


def workers_curve(counts: list[int], requests: int) -> list[tuple[int, float, float]]:
    out = []
    for w in counts:
        row = []
        for bundle in (1, 64):
            b = Bench(w, bundle)
            try:
                row.append(per_request_us(b, max(ROUNDS, requests // bundle), bundle))
            finally:
                b.broker.close()
        out.append((w, row[0], row[1]))
        print(f"| {w} | {row[0]:.1f} | {row[1]:.1f} |", flush=True)
    return out


def queued_curve(depths: list[int], requests: int) -> list[tuple[int, float]]:
    out = []
    for q in depths:
        b = QueuedBench(q)
        try:
            us = per_request_us(b, max(ROUNDS, requests // BATCH), BATCH)
            b.finish()
        finally:
            b.broker.close()
        out.append((q, us))
        print(f"| {q} | {us:.1f} |", flush=True)
    return out


def plot(path: str, workers: list[tuple[int, float, float]],
         queued: list[tuple[int, float]]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    xs = [w for w, _, _ in workers]
    left.plot(xs, [a for _, a, _ in workers], "o-", label="one request at a time")
    left.plot(xs, [b for _, _, b in workers], "s-", label="64 at a time (one batch)")
    left.set_xscale("log", base=2)
    left.set_xticks(xs, [str(x) for x in xs])
    left.set_xlabel("workers holding the model")
    left.set_ylabel("broker CPU µs a request")
    left.set_ylim(bottom=0)
    left.set_title("against workers")
    left.legend()
    qs = [q for q, _ in queued]
    right.plot(qs, [us for _, us in queued], "o-", color="C2",
               label=f"batches of {BATCH}, deadlines on")
    right.set_xscale("log")
    right.set_xlabel("requests queued ahead")
    right.set_ylim(bottom=0)
    right.set_title("against queue depth")
    right.legend()
    fig.suptitle("zeroserve broker: CPU a request (in-process, least of ten rounds)")
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot: {path}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", default="2,4,8,16,32,64,128,256")
    ap.add_argument("--queued", default="1,10,100,1000,10000")
    ap.add_argument("--requests", type=int, default=20000, help="requests a point")
    ap.add_argument("--plot", default=None, help="write the two curves to this PNG")
    args = ap.parse_args()
    from zeroserve.broker.process import tune_gc
    tune_gc()   # as the broker's process does
    started = time.monotonic()
    print("| workers | µs a request, one at a time | 64 at a time |\n|---|---|---|")
    workers = workers_curve([int(w) for w in args.workers.split(",")], args.requests)
    print("\n| requests queued ahead | µs a request |\n|---|---|")
    queued = queued_curve([int(q) for q in args.queued.split(",")], args.requests)
    print(f"\n({time.monotonic() - started:.0f} s)")
    if args.plot:
        plot(args.plot, workers, queued)


if __name__ == "__main__":
    main()
