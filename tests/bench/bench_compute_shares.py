"""Two tenants of equal shares on one worker, one sending 16-token texts and one 512-token
texts to a BERT (issue 48), under each share mode in turn, in rounds:

    .venv/bin/python -m tests.bench.bench_compute_shares [--rounds 2] [--seconds 8]
        [--variants tok512,tok4096,tok4096cap] [--modes requests,compute] [--size small]
        [--before <commit>]

The variants are the same weights served under three batching configs (one server, one
worker): ``tok512``, a token budget of 512 (a long batch is one text: the e2e test's);
``tok4096``, a budget of 4096 (eight long texts a batch); ``tok4096cap``, the same with
``mixed_batch_ms`` 10 (while the tenants mix, a batch is cut to about one long text).
Each round, for each variant and share mode (a tenants reload between), four phases:

- ``both``: both tenants backlogged (closed loops), each one's share of the worker's time
  (``zeroserve tenants``' ``compute_s``), and how often the short-text tenant had under
  two batches' worth in the broker (then it was not backlogged: its share is its own);
- ``alone``: the short-text tenant paced at 20 requests/s by itself, its p99;
- ``long``: the long-text tenant's closed loops by themselves, the worker seconds used;
- ``beside``: the short-text tenant paced beside the long-text flood, its p99 and the
  ratio to ``alone`` of the same round, variant and mode.

The long-text tenant runs in a process of its own (another client: its 128 KB answers are
not read on the loop that times the short texts). Beside the client's p99, the broker's
own: the short texts' queue time (``zeroserve_tenant_queue_seconds``, the upper bound of
the bucket holding the p99) and the batches' run time (``inference_compute_seconds``,
p50 and p99 the same way), so that what the scheduler made a short text wait is told
apart from what the shared host added. Pacing and lanes are those of
``tests/e2e/test_compute_shares.py``. The load generator shares the host's cores with
the server; the load average is printed.

With ``--before`` the server of that commit (its tree from ``git archive``, imported ahead
of this one's) and this one's run each round in turns, the before first, each on a server
of its own (warmed the same way), so that every figure has a baseline of the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import shutil
import threading
import time
import warnings
from typing import Any

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from tests import bert
from tests.bench.bench_openai_sse import tree_of
from tests.conftest import Server, short_tmpdir
from tests.e2e import test_compute_shares as cs
from zeroserve.broker.client import AsyncClient, Client, InferError
from zeroserve.broker.server.tenants import new_key

SHORT, LONG = cs.SHORT, cs.LONG
VARIANTS: dict[str, dict[str, Any]] = {
    "tok512": {"max_batch_tokens": 512},
    "tok4096": {"max_batch_tokens": 4096},
    "tok4096cap": {"max_batch_tokens": 4096, "mixed_batch_ms": 10},
}
SIZES = {"small": bert.SMALL, "mini": bert.MINI}


class World:
    """One server, one worker, the variants as models of the same weights."""

    def __init__(self, variants: list[str], size: str,
                 env: dict[str, str] | None = None) -> None:
        self.repo = short_tmpdir("zsbcs")
        with warnings.catch_warnings():   # transformers' and the tracer's, not ours
            warnings.simplefilter("ignore")
            module = bert.model(SIZES[size])
            for name in variants:
                bert.write(self.repo, name, module, padding=bert.PADDING, max_batch_size=32,
                           max_queue_delay_ms=2, **VARIANTS[name])
        self.keys, self.hashes = {}, {}
        for n in ("short", "long"):
            self.keys[n], self.hashes[n] = new_key()
        self.file = self.repo.parent / f"{self.repo.name}-tenants.toml"
        self.file.write_text(cs.tenants_text("requests", self.hashes))
        self.server = Server(self.repo, extra=["--tenants", str(self.file)],
                             env=env).wait_ready(300)

    def share(self, mode: str) -> None:
        self.file.write_text(cs.tenants_text(mode, self.hashes))
        with Client(self.server.control, timeout_s=10) as c:
            c.control("reload_tenants")
            assert c.control("tenants")["share"] == mode

    def control(self, verb: str) -> Any:
        with Client(self.server.control, timeout_s=10) as c:
            return c.control(verb)

    def close(self) -> None:
        self.server.stop()
        shutil.rmtree(self.repo, ignore_errors=True)
        self.file.unlink(missing_ok=True)


async def closed(c: AsyncClient, model: str, length: int, rows: int, lanes: int,
                 until: float, lat: list[float]) -> None:
    rng = np.random.default_rng(length)

    async def lane() -> None:
        x = bert.inputs(length, bert.SMALL["vocab_size"], rng, rows=rows)
        while time.monotonic() < until:
            t = time.perf_counter()
            try:
                await c.infer(model, x, timeout_ms=30_000)
                lat.append(time.perf_counter() - t)
            except InferError as exc:
                raise AssertionError(f"a {length}-token text failed: {exc}") from None
    await asyncio.gather(*[lane() for _ in range(lanes)])


async def paced(c: AsyncClient, model: str, until: float, lat: list[float]) -> None:
    rng = np.random.default_rng(SHORT + 1)
    tasks = []

    async def one() -> None:
        t = time.perf_counter()
        await c.infer(model, bert.inputs(SHORT, bert.SMALL["vocab_size"], rng,
                                         rows=cs.SHORT_ROWS), timeout_ms=30_000)
        lat.append(time.perf_counter() - t)
    next_s = time.monotonic()
    while next_s < until:
        tasks.append(asyncio.ensure_future(one()))
        next_s += 1.0 / cs.RATE
        await asyncio.sleep(max(0.0, next_s - time.monotonic()))  # noqa: sleep-ok (pacing)
    await asyncio.gather(*tasks)


def flood(frontend: str, key: str, model: str, ready: Any, go: Any, until: Any) -> None:
    """The long-text tenant's closed loops, in a process of their own: connected, it
    says ``ready``, then runs from ``go`` to ``until`` (CLOCK_MONOTONIC, which every
    process of the host shares; its imports take seconds on a loaded host)."""
    async def run() -> None:
        async with AsyncClient(frontend, api_key=key, broker_timeout_s=30) as c:
            assert await c.wait_connected(30)
            ready.set()
            while not go.is_set():
                await asyncio.sleep(0.01)  # noqa: sleep-ok (polling the parent's start)
            await closed(c, model, LONG, 1, cs.LONG_LANES, until.value, [])
    asyncio.run(run())


def histograms(w: World) -> dict[tuple[str, str], list[tuple[float, float]]]:
    """Cumulative buckets (le, count) of the tenants' queue time and the batches' run
    time, by (metric, tenant or model)."""
    out: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for fam in text_string_to_metric_families(w.control("metrics")["broker"]):
        if fam.name not in ("zeroserve_tenant_queue_seconds",
                            "zeroserve_inference_compute_seconds"):
            continue
        for s in fam.samples:
            if s.name.endswith("_bucket"):
                label = s.labels.get("tenant", s.labels.get("model", ""))
                out.setdefault((fam.name, label), []).append((float(s.labels["le"]), s.value))
    return out


def quantile(before: list[tuple[float, float]] | None, after: list[tuple[float, float]],
             q: float) -> float:
    """The upper bound (ms) of the bucket holding the q-th of what was observed between
    two scrapes."""
    base = dict(before or [])
    diff = [(le, n - base.get(le, 0.0)) for le, n in sorted(after)]
    total = diff[-1][1] if diff else 0.0
    for le, n in diff:
        if total and n >= q * total:
            return le * 1000
    return float("nan")


def compute_s(w: World) -> dict[str, float]:
    doc = w.control("tenants")["tenants"]
    return {n: doc[n]["compute_s"] for n in ("short", "long")}


def phase(w: World, model: str, short: str | None, long: bool, rows: int,
          seconds: float) -> dict[str, Any]:
    """``short``: None, "closed" (``rows`` texts a request) or "paced"; ``long``: the
    long-text tenant's closed loops too, from another process."""
    mp = multiprocessing.get_context("spawn")
    ready, go, until_v = mp.Event(), mp.Event(), mp.Value("d", 0.0)
    proc = mp.Process(target=flood, args=(w.server.frontend, w.keys["long"], model, ready,
                                          go, until_v)) if long else None
    if proc is not None:
        proc.start()
        assert ready.wait(120), "the long-text tenant's process never connected"
    before, h0 = compute_s(w), histograms(w)
    lat: list[float] = []
    start = time.monotonic() + 0.2
    until = until_v.value = start + seconds
    go.set()

    async def run() -> None:
        async with AsyncClient(w.server.frontend, api_key=w.keys["short"],
                               broker_timeout_s=30) as c:
            assert await c.wait_connected(10)
            await asyncio.sleep(max(0.0, start - time.monotonic()))  # noqa: sleep-ok (start together)
            if short == "closed":
                await closed(c, model, SHORT, rows, cs.SHORT_LANES, until, lat)
            elif short == "paced":
                await paced(c, model, until, lat)
            else:
                await asyncio.sleep(max(0.0, until - time.monotonic()))  # noqa: sleep-ok (the flood's phase)
    stop = threading.Event()
    seen: list[int] = []

    def sample() -> None:
        # the short-text tenant's requests in the broker (queued or running), every 20 ms
        with Client(w.server.control, timeout_s=10) as c:
            while not stop.wait(0.02):
                if time.monotonic() >= start:
                    seen.append(c.control("tenants")["tenants"]["short"]["inflight"])
    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        asyncio.run(run())
    finally:
        stop.set()
        sampler.join()
        if proc is not None:
            proc.join(seconds + 60)
            if proc.is_alive():
                proc.kill()
                proc.join()
    after, h1 = compute_s(w), histograms(w)
    queue_key = ("zeroserve_tenant_queue_seconds", "short")
    run_key = ("zeroserve_inference_compute_seconds", model)
    two = 2 * 512 // (SHORT * rows)   # requests in two full batches of short texts
    return {"used": {n: after[n] - before[n] for n in after}, "p99_ms": cs.p99(lat) * 1000,
            "under": sum(n < two for n in seen) / max(len(seen), 1),
            "queue_p99_ms": quantile(h0.get(queue_key), h1.get(queue_key, []), 0.99),
            "batch_p50_ms": quantile(h0.get(run_key), h1.get(run_key, []), 0.5),
            "batch_p99_ms": quantile(h0.get(run_key), h1.get(run_key, []), 0.99)}


def measure(w: World, label: str, r: int, variants: list[str], modes: list[str],
            args: argparse.Namespace) -> None:
    """One round of every variant and share mode on ``w``'s server, a line each."""
    for v in variants:
        for mode in modes:
            w.share(mode)
            both = phase(w, v, "closed", True, args.backlog_rows, args.seconds)
            alone = phase(w, v, "paced", False, cs.SHORT_ROWS, args.seconds)
            long = phase(w, v, None, True, cs.SHORT_ROWS, args.seconds)
            beside = phase(w, v, "paced", True, cs.SHORT_ROWS, args.seconds)
            total = sum(both["used"].values())
            print(f"round {r + 1} {label}{v:<10} {mode:<8}: both: short "
                  f"{both['used']['short'] / total:5.1%} of {total:.1f} worker s "
                  f"(not backlogged {both['under']:.0%}); long alone "
                  f"{long['used']['long']:.1f} s; short p99 alone "
                  f"{alone['p99_ms']:.1f} ms, beside {beside['p99_ms']:.1f} ms "
                  f"({beside['p99_ms'] / alone['p99_ms']:.1f}x); broker queue p99 <= "
                  f"{alone['queue_p99_ms']:g} / {beside['queue_p99_ms']:g} ms; "
                  f"batches beside p50/p99 <= {beside['batch_p50_ms']:g}/"
                  f"{beside['batch_p99_ms']:g} ms; load {os.getloadavg()[0]:.2f}",
                  flush=True)


def serve(variants: list[str], args: argparse.Namespace, env: dict[str, str] | None
          ) -> World:
    """A server of the variants, warmed: the latency model learns both lengths on each."""
    w = World(variants, args.size, env)
    try:
        for v in variants:
            phase(w, v, "paced", False, cs.SHORT_ROWS, 4.0)
            phase(w, v, "closed", True, args.backlog_rows, 4.0)
    except BaseException:
        w.close()
        raise
    return w


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=cs.PHASE_S)
    ap.add_argument("--variants", default="tok512,tok4096,tok4096cap")
    ap.add_argument("--modes", default="requests,compute")
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--backlog-rows", type=int, default=cs.BACKLOG_ROWS,
                    help="texts a request of the short-text tenant while backlogged")
    ap.add_argument("--before", help="a commit whose server runs each round in turns with "
                    "this one's")
    args = ap.parse_args()
    variants, modes = args.variants.split(","), args.modes.split(",")
    print(f"bert {args.size}, one worker, {args.seconds:g} s a phase; load average "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    if not args.before:
        w = serve(variants, args, None)
        try:
            for r in range(args.rounds):
                measure(w, "", r, variants, modes, args)
        finally:
            w.close()
        return
    before = short_tmpdir("zsbefore")
    try:
        runs = [(f"before {args.before[:10]} ", tree_of(args.before, before)),
                ("this tree ", None)]
        for r in range(args.rounds):
            for label, env in runs:
                w = serve(variants, args, env)
                try:
                    measure(w, label, r, variants, modes, args)
                finally:
                    w.close()
    finally:
        shutil.rmtree(before, ignore_errors=True)


if __name__ == "__main__":
    main()
