"""A VIP request under full load, on WORKLOADS' ``lm`` (a GPT-2 of 4 layers, hidden 256,
random weights) served as an iterative model: the time to its first token, in ms and in
steps, beside the same arrivals at the default priority (the baseline, same run).

    .venv/bin/python -m tests.bench.bench_vip [--slots 8] [--arrivals 100]
        [--vip-tokens 16] [--before <commit> [--rounds 1]] [--trace]

Every one of ``--slots`` sequence slots is held by a stream of the default priority (the
direct client, each slot sending its next request when one ends: prompts of 16-128
tokens, ``max_tokens`` 16-256, WORKLOADS' generation load). One at a time, after a pause
drawn in 0-50 ms (so arrivals fall anywhere in a step), a request arrives: priority 1
(the VIP, which pauses a running stream) and the default priority in turns, ``--arrivals``
of each. Its time to the first token is measured by the client from its send, and counted
in steps: the most tokens any slot's stream got between the send and that first token
(one a step; what the e2e test tests/e2e/test_preemption.py bounds at 2). The step's
time is the slots' gap between two tokens (p50), measured in the same run. The client
shares the host's cores with the server. ``--before``: that commit's server and this
one's in turns, as tests/bench/bench_openai_sse.py does.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import random
import secrets
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from tests.bench.bench_openai_sse import pct, tree_of
from tests.conftest import Server, short_tmpdir
from tests.lm import prompt_ids, write_lm
from zeroserve.broker.client import AsyncClient


class Load:
    """The slots' streams: their tokens counted per slot, and their gaps."""

    def __init__(self, slots: int) -> None:
        self.tokens = [0] * slots
        self.gaps: list[float] = []
        self.running = True


def inputs(ids: list[int], m: int) -> dict[str, np.ndarray]:
    return {"input_ids": np.array([ids], np.int64), "max_tokens": np.array([[m]], np.int32)}


async def hold(c: AsyncClient, load: Load, slot: int, tokenizer: Any) -> None:
    """One slot's streams at the default priority, one after the other, until told."""
    rng = random.Random(slot)
    k = 0
    while load.running:
        ids = prompt_ids(tokenizer, (slot * 97 + k) % 300, rng.randint(16, 128))
        k += 1
        last = None
        async for r in c.stream("lm", inputs(ids, rng.randint(16, 256))):
            if "token_id" not in r.outputs:
                continue
            now = time.perf_counter()
            load.tokens[slot] += 1
            if last is not None:
                load.gaps.append(now - last)
            last = now
            if not load.running:
                break


async def arrive(c: AsyncClient, load: Load, ids: list[int], m: int, priority: int,
                 traceparent: str = "") -> tuple[float, int]:
    """One arrival's time to its first token, and the steps counted meanwhile."""
    before = list(load.tokens)
    t0 = time.perf_counter()
    first: tuple[float, int] | None = None
    async for r in c.stream("lm", inputs(ids, m), priority=priority,
                            traceparent=traceparent):
        if first is None and "token_id" in r.outputs:
            first = (time.perf_counter() - t0,
                     max(b - a for a, b in zip(before, load.tokens)))
    assert first is not None, "the arrival got no token"
    return first


def measure(repo: Path, tokenizer: Any, args: argparse.Namespace,
            env: dict[str, str] | None, receiver: Any = None
            ) -> tuple[dict[int, list[tuple[float, int]]], Load, float]:
    """One server's run: each priority's arrivals (time to first token, steps counted),
    the slots' load, the wall time. With ``receiver`` (tests/otlp.py) every arrival is
    traced, and those that waited more than 2 steps are said with their spans."""
    extra = ["--log-level", "warning"]
    if receiver is not None:
        from tests.otlp import traced_serve_flags   # the SDK, traced runs only
        extra += traced_serve_flags(receiver.port)
    srv = Server(repo, extra=extra, env=env).wait_ready(180)
    traces: list[tuple[str, int, float, int]] = []
    rng = random.Random(7)
    results: dict[int, list[tuple[float, int]]] = {1: [], 0: []}
    load = Load(args.slots)
    try:
        async def run() -> float:
            async with AsyncClient(srv.frontend) as c:
                assert await c.wait_connected(10)
                holders = [asyncio.create_task(hold(c, load, s, tokenizer))
                           for s in range(args.slots)]
                while min(load.tokens) < 4:   # every slot holds a running stream
                    await asyncio.sleep(0.01)   # noqa: sleep-ok (polls the counts)
                start = time.perf_counter()
                for k in range(2 * args.arrivals):
                    priority = 1 if k % 2 == 0 else 0
                    await asyncio.sleep(rng.uniform(0, 0.05))   # noqa: sleep-ok (arrivals)
                    ids = prompt_ids(tokenizer, 500 + k, rng.randint(16, 128))
                    trace_id = secrets.token_hex(16)
                    tp = f"00-{trace_id}-{secrets.token_hex(8)}-01" if receiver else ""
                    results[priority].append(await arrive(c, load, ids, args.vip_tokens,
                                                          priority, tp))
                    traces.append((trace_id, priority, *results[priority][-1]))
                wall = time.perf_counter() - start
                load.running = False
                for t in holders:
                    t.cancel()
                await asyncio.gather(*holders, return_exceptions=True)
                return wall
        wall = asyncio.run(run())
    finally:
        srv.stop()
    if receiver is not None:
        time.sleep(1)   # noqa: sleep-ok (the receiver decodes the last export)
        server_side(receiver, traces)
    return results, load, wall


def server_side(receiver: Any, traces: list[tuple[str, int, float, int]]) -> None:
    """Each priority's time to first token inside the server, from its spans: the
    broker's arrival to the worker's sending of the first token (the queue, the worker's
    wait for the step running to end, the prefill), in ms and in steps, the step being
    the worker's own (a traced arrival's steps span over the steps it answered)."""
    legs: dict[int, dict[str, list[float]]] = {1: {}, 0: {}}
    periods = []
    for trace_id, priority, _, _ in traces:
        got = {sp.name: sp for sp in receiver.of_trace(trace_id)}
        if not {"queue", "sequence", "wait", "prefill", "steps"} <= got.keys():
            continue
        seq = got["sequence"]
        first = seq.start_ns + seq.attributes["zeroserve.sequence.first_response_ms"] * 1e6
        n = seq.attributes["zeroserve.sequence.steps"]
        if n > 1:
            periods.append((got["steps"].end_ns - got["steps"].start_ns) / (n - 1) / 1e6)
        for name, ms in (("broker queue", (got["queue"].end_ns - got["queue"].start_ns) / 1e6),
                         ("worker wait", seq.attributes["zeroserve.sequence.wait_ms"]),
                         ("steps the worker ran meanwhile",
                          float(seq.attributes["zeroserve.sequence.waited_steps"])),
                         ("prefill", seq.attributes["zeroserve.sequence.prefill_ms"]),
                         ("arrival to first token sent", (first - got["queue"].start_ns) / 1e6)):
            legs[priority].setdefault(name, []).append(ms)
    step = statistics.median(periods)
    print(f"  inside the server (spans), a step of the worker's {step:.1f} ms (p50):")
    for priority, label in ((1, "VIP"), (0, "default priority")):
        print(f"    {label}: " + "; ".join(
            f"{name} p50 {pct(v, .5):.1f}, p99 {pct(v, .99):.1f}"
            + ("" if name.startswith("steps") else " ms")
            + (f" ({pct(v, .5) / step:.1f} and {pct(v, .99) / step:.1f} steps)"
               if name.startswith("arrival") else "")
            for name, v in legs[priority].items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--arrivals", type=int, default=100, help="of each priority")
    ap.add_argument("--vip-tokens", type=int, default=16, help="max_tokens of an arrival")
    ap.add_argument("--before", help="a commit whose server is measured in turns with this one")
    ap.add_argument("--rounds", type=int, default=1, help="turns of each, with --before")
    ap.add_argument("--trace", action="store_true", help="trace every arrival (this tree): "
                    "say where a VIP that waited more than 2 steps spent its time")
    args = ap.parse_args()

    repo = short_tmpdir("zsvipb")
    # priorities 1 (the VIP) and 2, the default (what priority 0 on the wire means)
    _, tokenizer = write_lm(repo, "lm", most=args.slots, hidden=256, layers=4,
                            dynamic_batching={"priority_levels": 2, "default_priority": 2})
    runs: list[tuple[str, dict[str, str] | None]] = [("this tree", None)]
    before = short_tmpdir("zsvipbefore")
    if args.before:
        runs = [(f"before {args.before}", tree_of(args.before, before)),
                ("this tree", None)] * args.rounds
    try:
        for label, env in runs:
            results, load, wall = measure(repo, tokenizer, args, env)
            report(label, args, results, load, wall)
        if args.trace:
            from tests.otlp import Receiver
            receiver = Receiver()
            try:
                report("this tree, traced", args,
                       *measure(repo, tokenizer, args, None, receiver))
            finally:
                receiver.close()
    finally:
        shutil.rmtree(repo, ignore_errors=True)
        shutil.rmtree(before, ignore_errors=True)


def report(label: str, args: argparse.Namespace, results: dict[int, list[tuple[float, int]]],
           load: Load, wall: float) -> None:
    step = pct(load.gaps, .5)
    print(f"{label}: {args.slots} slots held at the default priority, {args.arrivals} "
          f"arrivals of each priority in turns, {wall:.0f} s; a step (the slots' gap p50) "
          f"{step * 1000:.1f} ms, p99 {pct(load.gaps, .99) * 1000:.1f} ms; load average "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    for priority, name in ((1, "VIP (priority 1)"), (0, "default priority (baseline)")):
        ttft = [t for t, _ in results[priority]]
        steps = [float(n) for _, n in results[priority]]
        print(f"  {name}: time to first token p50 {pct(ttft, .5) * 1000:.1f} ms, p99 "
              f"{pct(ttft, .99) * 1000:.1f} ms ({pct(ttft, .5) / step:.1f} and "
              f"{pct(ttft, .99) / step:.1f} steps of {step * 1000:.1f} ms); steps counted "
              f"p50 {pct(steps, .5):.0f}, p99 {pct(steps, .99):.0f}, max {max(steps):.0f} "
              f"(arrivals by steps counted: {counted(steps)})", flush=True)


def counted(steps: list[float]) -> str:
    """How many arrivals counted each number of steps: where the p99's one arrival in
    a hundred sits."""
    by = collections.Counter(int(n) for n in steps)
    return ", ".join(f"{n}: {by[n]}" for n in sorted(by))


if __name__ == "__main__":
    main()
