"""Continuous batching on a causal LM: tokens/s of WORKLOADS' ``lm`` (a GPT-2 of 4 layers,
hidden 256, made as /work/shared/bench/make_text_models.py's ``make_lm`` makes it) served
three ways in one run:

- iterative: platform ``transformers`` with ``sequences`` (models/causal_lm.py), requests
  joining and leaving at every step;
- request-level: the same step code as a decoupled Python handler whose generator runs a
  whole batch to its longest request (today's streams), prompts padded together;
- in-process: ``model.generate(do_sample=False)`` on static batches of C prompts, on as
  many torch threads as the worker has,
  left-padded, each batch run to its longest ``max_tokens`` (the tokens past a request's
  own count are not counted).

    .venv/bin/python -m tests.bench.bench_lm [--concurrency 32] [--requests 64]
        [--prompt 16,128] [--max-tokens 16,256] [--hidden 256] [--layers 4]
        [--before <commit> [--rounds 2]]

One ``zeroserve serve`` with one worker; the direct client keeps C streams open, each
slot sending its next request when one ends, until ``--requests`` have run. Prompts
and ``max_tokens`` are drawn uniformly from the ranges, the same list for every way.
Tokens/s counts the tokens each request asked for, over the wall time.

Before the served ways, the step handler's decode in-process (one thread, as a worker
runs it): the time of one step at batch 1, 8 and 32, its sequences 72 tokens long
(the middle of the prompts) plus 64 generated; tokens/s at batch 32 over batch 1 is
what batching can win at most on this device.

With ``--before`` the server of that commit (its tree from ``git archive``, imported ahead
of this one's) and this one's serve the same requests in turns, ``--rounds`` times each,
the before first, and each round measures the in-process generate again: a baseline from
the same run. The step times of the before are measured in a process of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from tests.bench.bench_openai_sse import tree_of
from tests.conftest import Server, short_tmpdir
from tests.lm import lm_config, prompt_ids, write_lm

REQUEST_LEVEL = '''
from zeroserve.models.causal_lm import CausalLMSteps


class Model:
    def load(self, version_dir, device):
        import transformers
        model = transformers.AutoModelForCausalLM.from_pretrained(str(version_dir / "hf"))
        self.steps = CausalLMSteps(model.to(device).eval())

    def predict(self, inputs, rows):
        ids, wanted = inputs["input_ids"], inputs["max_tokens"]
        states = {}
        for i, r in enumerate(rows):
            own = ids[r][0]
            own = own[own >= 0].reshape(1, -1)   # padded with -1 to the batch's longest
            states[i] = self.steps.join(i, {"input_ids": own, "max_tokens": wanted[r]})
        try:
            while states:
                out = self.steps.step(states)
                yield out
                for i, (_, final) in out.items():
                    if final:
                        del states[i]
                        self.steps.leave(i)
        finally:
            for i in states:
                self.steps.leave(i)
'''


def make_repo(repo: Path, hidden: int, layers: int, most: int) -> tuple[Path, Any]:
    folder, tokenizer = write_lm(repo, "lm", most=most, hidden=hidden, layers=layers)
    cfg = lm_config("lm", most)
    cfg["max_batch_size"] = most
    (repo / "lm" / "config.json").write_text(json.dumps(cfg))
    vdir = repo / "lm_batches" / "1"
    shutil.copytree(folder, vdir / "hf")
    (vdir / "model.py").write_text(REQUEST_LEVEL)
    batches = {**lm_config("lm_batches"), "platform": "python", "max_batch_size": most,
               "model_transaction_policy": {"decoupled": True},
               "dynamic_batching": {"padding": {"inputs": [
                   {"name": "input_ids", "dim": 0, "value": -1}]}}}
    batches.pop("sequences")
    (repo / "lm_batches" / "config.json").write_text(json.dumps(batches))
    return folder, tokenizer


def served(srv: Server, model: str, asks: list[tuple[list[int], int]], concurrency: int
           ) -> tuple[float, float, int]:
    """Tokens/s, median time to first token (s), tokens received."""
    from zeroserve.broker.client import AsyncClient

    got, firsts = [0], []

    async def main() -> float:
        todo = list(asks)
        async with AsyncClient(srv.frontend) as c:
            await c.wait_connected(5)

            async def slot() -> None:
                while todo:
                    ids, m = todo.pop()
                    x = {"input_ids": np.array([ids], np.int64),
                         "max_tokens": np.array([[m]], np.int32)}
                    t0 = time.perf_counter()
                    async for r in c.stream(model, x):
                        if r.index == 0:
                            firsts.append(time.perf_counter() - t0)
                        got[0] += "token_id" in r.outputs
            start = time.perf_counter()
            await asyncio.gather(*(slot() for _ in range(concurrency)))
            return time.perf_counter() - start
    wall = asyncio.run(main())
    return got[0] / wall, sorted(firsts)[len(firsts) // 2], got[0]


def in_process(folder: Path, asks: list[tuple[list[int], int]], concurrency: int,
               device: str = "cpu") -> tuple[float, int]:
    """Tokens/s and tokens of ``generate`` on static batches, on ``device`` (the served
    worker's own, for a baseline of the same hardware)."""
    import torch
    from transformers import AutoModelForCausalLM

    # the worker's torch threads (workers/serve.py: a core left to the broker and the
    # gateway): torch's own count spins on every core of a loaded host, which cut this
    # baseline 10-fold at load average 10 on 2 cores
    torch.set_num_threads(max(1, (os.cpu_count() or 1) - 1))
    model = AutoModelForCausalLM.from_pretrained(str(folder)).to(device).eval()
    eos = model.generation_config.eos_token_id
    with torch.inference_mode():   # warm: generate's first call sets itself up
        model.generate(torch.tensor([asks[0][0]], device=device), do_sample=False,
                       max_new_tokens=2, pad_token_id=eos)
    useful, start = 0, time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(asks), concurrency):
            batch = asks[i:i + concurrency]
            width = max(len(ids) for ids, _ in batch)
            x = torch.tensor([[eos] * (width - len(ids)) + ids for ids, _ in batch],
                             device=device)
            mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids)
                                 for ids, _ in batch], device=device)
            out = model.generate(x, attention_mask=mask, do_sample=False, pad_token_id=eos,
                                 max_new_tokens=max(m for _, m in batch))
            useful += sum(min(m, out.shape[1] - width) for _, m in batch)
        if device.startswith("cuda"):   # the last batch's kernels, inside the time
            torch.cuda.synchronize(device)
    return useful / (time.perf_counter() - start), useful


def step_times(folder: Path, batches: tuple[int, ...] = (1, 8, 32)) -> dict[int, float]:
    """Seconds of one decode step of the step handler (``advance``) at each batch size,
    the best of 20 steps, in this process on one thread."""
    import torch
    from transformers import AutoModelForCausalLM

    from zeroserve.models.causal_lm import CausalLMSteps

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    out = {}
    with torch.inference_mode():
        for batch in batches:
            steps = CausalLMSteps(model)
            gen = torch.Generator().manual_seed(batch)
            states = {i: steps.join(i, {"input_ids": torch.randint(1, 1000, (1, 72),
                                                                   generator=gen),
                                        "max_tokens": torch.tensor([[1000]])})
                      for i in range(batch)}
            times = []
            for k in range(84):   # 64 to grow the caches, 20 timed
                steps.step(states)
                t0 = time.perf_counter()
                steps.advance(states)
                if k >= 64:
                    times.append(time.perf_counter() - t0)
            out[batch] = min(times)
    return out


def print_step_times(label: str, times: dict[int, float]) -> None:
    print(f"{label}: decode step in-process (1 thread) " + ", ".join(
        f"batch {b} {t * 1000:.1f} ms ({b / t:,.0f} tokens/s)" for b, t in times.items())
        + f"; batch 32 over batch 1 {times[32] / times[1]:.1f}x the time, "
        f"{32 * times[1] / times[32]:.1f}x the tokens/s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt", default="16,128", help="prompt lengths, low,high")
    ap.add_argument("--max-tokens", default="16,256", help="max_tokens, low,high")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--before", help="a commit whose server is measured in turns with this one")
    ap.add_argument("--rounds", type=int, default=2, help="turns of each, with --before")
    ap.add_argument("--step-times-of", help=argparse.SUPPRESS)   # a model folder: that only
    args = ap.parse_args()
    if args.step_times_of:
        print(json.dumps(step_times(Path(args.step_times_of))))
        return
    lo, hi = (int(x) for x in args.prompt.split(","))
    mlo, mhi = (int(x) for x in args.max_tokens.split(","))
    repo = short_tmpdir("zslm")
    before = short_tmpdir("zsbefore")
    folder, tokenizer = make_repo(repo, args.hidden, args.layers, args.concurrency)
    rng = random.Random(0)
    asks = [(prompt_ids(tokenizer, i, rng.randint(lo, hi)), rng.randint(mlo, mhi))
            for i in range(args.requests)]
    runs: list[tuple[str, dict[str, str] | None]] = [("this tree", None)]
    if args.before:
        runs = [(f"before {args.before}", tree_of(args.before, before)),
                ("this tree", None)] * args.rounds
    print(f"GPT-2 {args.layers} layers hidden {args.hidden}, C={args.concurrency}, "
          f"{args.requests} requests, prompts {lo}-{hi} tokens, max_tokens {mlo}-{mhi} "
          f"(asked {sum(m for _, m in asks)} tokens), 1 worker; load average "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    try:
        for label, env in runs[:2]:
            got = subprocess.run([sys.executable, "-m", "tests.bench.bench_lm",
                                  "--step-times-of", str(folder)], check=True, text=True,
                                 capture_output=True, env={**os.environ, **(env or {})})
            print_step_times(label, {int(b): t for b, t in
                                     json.loads(got.stdout.splitlines()[-1]).items()})
        rates: dict[str, list[float]] = {}
        for round_, (label, env) in enumerate(runs):
            if round_ % (2 if args.before else 1) == 0:
                rate, _ = in_process(folder, asks, args.concurrency)
                rates.setdefault("in-process", []).append(rate)
                print(f"{'in-process generate, static batches':<38} {rate:>9,.0f} tokens/s",
                      flush=True)
            srv = Server(repo, workers=1, env=env).wait_ready(300)
            try:
                for name, model in (("iterative (continuous batching)", "lm"),
                                    ("request-level batches of streams", "lm_batches")):
                    served(srv, model, asks[:args.concurrency], args.concurrency)   # warm
                    rate, ttft, got_ = served(srv, model, asks, args.concurrency)
                    rates.setdefault(f"{label}: {name}", []).append(rate)
                    print(f"{label}: {name:<34} {rate:>9,.0f} tokens/s  TTFT p50 "
                          f"{ttft * 1000:,.1f} ms  ({got_} tokens; load average "
                          f"{os.getloadavg()[0]:.1f})", flush=True)
            finally:
                srv.stop()
        if len(runs) > 1:
            print("medians: " + "; ".join(f"{k} {statistics.median(v):,.0f}"
                                          for k, v in rates.items()))
    finally:
        shutil.rmtree(repo, ignore_errors=True)
        shutil.rmtree(before, ignore_errors=True)


if __name__ == "__main__":
    main()
