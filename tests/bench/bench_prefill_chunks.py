"""Chunked prefill's trade on WORKLOADS' ``lm`` (a GPT-2 of 4 layers, hidden 256), in-process:
the worker's sequence table (workers/sequences.py) over the causal LM step handler
(models/causal_lm.py), C streams in a closed loop, each slot's next request joining at the
step boundary after its stream's last token, with ``sequences.prefill_tokens`` set to each
budget in turn (rounds alternate the budgets). No server, no client: what the step
schedule alone does to the time to the first token and to the gaps between tokens,
without the HTTP path's and the other processes' share of the host's cores.

    .venv/bin/python -m tests.bench.bench_prefill_chunks [--concurrency 8] [--requests 48]
        [--prefill-tokens 512,64,24,512:2] [--rounds 2] [--before <commit>]

``T:R`` runs ``prefill_tokens`` T with ``sequences.step_ratio`` R (prefills in the decode's
forward, within R decodes' time; T 0: the default). With ``--before`` each round first
runs the default config over that commit's zeroserve (its tree from ``git archive``, in a
process of its own), then this tree's: a baseline from the same run.

The requests are bench_openai_sse's: prompts of 16-128 tokens, ``max_tokens`` 16-256.
The time to first token runs from the step boundary a request joins at to the emit of
its first token (the served run adds the wait for the step running and the path); a gap
is the time between two tokens of a stream. One torch thread, as a worker runs it. Each
figure twice: on the wall clock, and on the thread's CPU clock (``time.thread_time``),
which the host's other processes do not stretch: what a core of its own would show.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import random
import shutil
import subprocess
import sys
import time
from typing import Any

import numpy as np

from zeroserve.broker import protocol as p
from zeroserve.models.loader import load
from zeroserve.models.repository import load_config
from zeroserve.workers.sequences import SequenceTable
from tests.bench.bench_openai_sse import budget_label, budgets_of, pct, tree_of
from tests.conftest import short_tmpdir
from tests.lm import prompt_ids, write_lm


Figures = tuple[list[float], list[float]]   # times to first token, gaps


def closed_loop(folder: Any, budget: tuple[int, float], asks: list[tuple[list[int], int]],
                concurrency: int) -> tuple[Figures, Figures, float]:
    """The asks through a sequence table, C at a time: the figures on the wall clock and
    on the thread's CPU clock, and the wall time."""
    tokens, ratio = budget
    cfg = dataclasses.replace(load_config(folder.parent), prefill_tokens=tokens,
                              **({"step_ratio": ratio} if ratio else {}))
    loaded = load(cfg, 1, folder, "cpu", lambda: 0)
    times: dict[str, list[tuple[float, float]]] = {}
    done: list[str] = []

    def emit(step: list[p.Partial]) -> None:
        now = (time.perf_counter(), time.thread_time())
        for x in (x for part in step for x in part.parts if x.tensors):
            times[x.item].append(now)

    def finish(batch: p.Batch, result: p.BatchResult, taken_ns: int) -> None:
        assert not result.error, result.error
        done.extend(item.request_id for item in batch.items)

    table = SequenceTable(loaded, emit, finish, lambda b: frozenset(), itertools.count(1))
    todo = list(enumerate(asks))
    arrived: dict[str, tuple[float, float]] = {}
    batch_ids = itertools.count(1)

    def join() -> None:
        i, (ids, m) = todo.pop()
        rid = f"r{i}"
        item = p.BatchItem(rid, [p.from_numpy("input_ids", np.array([ids], np.int64)),
                                 p.from_numpy("max_tokens", np.array([[m]], np.int32))])
        times[rid], arrived[rid] = [], (time.perf_counter(), time.thread_time())
        table.join(p.Batch(next(batch_ids), "lm", 1, [item]), 0)

    start = time.perf_counter()
    for _ in range(min(concurrency, len(todo))):
        join()
    while table.busy:
        table.step()
        for _ in range(len(done)):
            done.pop()
            if todo:
                join()
    wall = time.perf_counter() - start
    loaded.release()

    def figures(clock: int) -> Figures:
        return ([t[0][clock] - arrived[rid][clock] for rid, t in times.items() if t],
                [b[clock] - a[clock] for t in times.values() for a, b in zip(t, t[1:])])
    return figures(0), figures(1), wall


def prefill_s(folder: Any, prompts: list[list[int]]) -> tuple[float, float]:
    """The median time of one whole prefill of a prompt (one forward, the last position's
    logits, as the step handler runs it), on the wall clock and on the CPU clock."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    walls, cpus = [], []
    with torch.inference_mode():
        model(torch.tensor([prompts[0]]))
        for ids in prompts:
            w, c = time.perf_counter(), time.thread_time()
            model(torch.tensor([ids]), logits_to_keep=1)
            walls.append(time.perf_counter() - w)
            cpus.append(time.thread_time() - c)
    return pct(walls, .5), pct(cpus, .5)


def before_loop(env: dict[str, str], folder: Any, concurrency: int
                ) -> tuple[Figures, Figures, float]:
    """closed_loop over another commit's zeroserve, in a process of its own, with the
    asks main() wrote beside the model."""
    out = subprocess.run(
        [sys.executable, "-m", "tests.bench.bench_prefill_chunks", "--one", str(folder),
         "--concurrency", str(concurrency)],
        env={**os.environ, **env}, check=True, capture_output=True, text=True).stdout
    wall, cpu, seconds = json.loads(out.splitlines()[-1])
    return (wall[0], wall[1]), (cpu[0], cpu[1]), seconds


def asks_of(tokenizer: Any, requests: int) -> list[tuple[list[int], int]]:
    rng = random.Random(5)   # bench_openai_sse's requests
    return [(prompt_ids(tokenizer, i, rng.randint(16, 128)), rng.randint(16, 256))
            for i in range(requests)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--prefill-tokens", default="512,64,24")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--before", help="a commit run in turns with this tree (its default)")
    ap.add_argument("--one", help=argparse.SUPPRESS)   # --before's process: this folder
    args = ap.parse_args()

    import torch
    torch.set_num_threads(1)
    if args.one:   # the default config once (warmed), its figures as JSON
        from pathlib import Path
        one = Path(args.one)
        asks = [(ids, m) for ids, m in json.loads((one.parent / "asks.json").read_text())]
        closed_loop(one, (0, 0.0), asks[:4], 4)
        print(json.dumps(closed_loop(one, (0, 0.0), asks, args.concurrency)))
        return
    repo = short_tmpdir("zschunks")
    before = short_tmpdir("zsbefore")
    try:
        folder, tokenizer = write_lm(repo, "lm", most=32, hidden=256, layers=4)
        asks = asks_of(tokenizer, args.requests)
        (folder.parent / "asks.json").write_text(json.dumps(asks))
        budgets = budgets_of(args.prefill_tokens)
        env = tree_of(args.before, before) if args.before else None
        closed_loop(folder, budgets[0], asks[:4], 4)   # warm: the first forward's costs
        rows = []
        for _ in range(args.rounds):
            if env is not None:
                rows.append((f"before {args.before} (its default)",
                             *before_loop(env, folder, args.concurrency)))
            for budget in budgets:
                rows.append((budget_label(*budget), *closed_loop(folder, budget, list(asks),
                                                                args.concurrency)))
        prefill = prefill_s(folder, [ids for ids, _ in asks[:24]])
    finally:
        shutil.rmtree(repo, ignore_errors=True)
        shutil.rmtree(before, ignore_errors=True)
    print(f"C={args.concurrency}, {args.requests} requests in-process a run (load average "
          f"{os.getloadavg()[0]:.1f}); a whole prefill of these prompts {prefill[0] * 1000:.1f} "
          f"ms on the wall clock, {prefill[1] * 1000:.1f} ms on the CPU's (medians)")
    for label, on_wall, on_cpu, wall in rows:
        print(f"{label}: {wall:.1f} s")
        for clock, (firsts, gaps) in (("wall", on_wall), ("CPU", on_cpu)):
            print(f"  {clock}: time to first token p50 {pct(firsts, .5) * 1000:.1f} ms, "
                  f"p99 {pct(firsts, .99) * 1000:.1f} ms; gap p50 {pct(gaps, .5) * 1000:.1f} "
                  f"ms, p99 {pct(gaps, .99) * 1000:.1f} ms "
                  f"({pct(gaps, .99) / pct(gaps, .5):.1f}x)")


if __name__ == "__main__":
    main()
