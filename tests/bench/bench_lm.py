"""Continuous batching on a causal LM: tokens/s of WORKLOADS' ``lm`` (a GPT-2 of 4 layers,
hidden 256, made as /work/shared/bench/make_text_models.py's ``make_lm`` makes it) served
three ways in one run:

- iterative: platform ``transformers`` with ``sequences`` (models/causal_lm.py), requests
  joining and leaving at every step;
- request-level: the same step code as a decoupled Python handler whose generator runs a
  whole batch to its longest request (today's streams), prompts padded together;
- in-process: ``model.generate(do_sample=False)`` on static batches of C prompts,
  left-padded, each batch run to its longest ``max_tokens`` (the tokens past a request's
  own count are not counted).

    .venv/bin/python -m tests.bench.bench_lm [--concurrency 32] [--requests 64]
        [--prompt 16,128] [--max-tokens 16,256] [--hidden 256] [--layers 4]

One ``zeroserve serve`` with one worker; the direct client keeps C streams open, each
slot sending its next request when one ends, until ``--requests`` have run. Prompts
and ``max_tokens`` are drawn uniformly from the ranges, the same list for every way.
Tokens/s counts the tokens each request asked for, over the wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

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


def in_process(folder: Path, asks: list[tuple[list[int], int]], concurrency: int
               ) -> tuple[float, int]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    eos = model.generation_config.eos_token_id
    with torch.inference_mode():   # warm: generate's first call sets itself up
        model.generate(torch.tensor([asks[0][0]]), do_sample=False, max_new_tokens=2,
                       pad_token_id=eos)
    useful, start = 0, time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(asks), concurrency):
            batch = asks[i:i + concurrency]
            width = max(len(ids) for ids, _ in batch)
            x = torch.tensor([[eos] * (width - len(ids)) + ids for ids, _ in batch])
            mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids)
                                 for ids, _ in batch])
            out = model.generate(x, attention_mask=mask, do_sample=False, pad_token_id=eos,
                                 max_new_tokens=max(m for _, m in batch))
            useful += sum(min(m, out.shape[1] - width) for _, m in batch)
    return useful / (time.perf_counter() - start), useful


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt", default="16,128", help="prompt lengths, low,high")
    ap.add_argument("--max-tokens", default="16,256", help="max_tokens, low,high")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    lo, hi = (int(x) for x in args.prompt.split(","))
    mlo, mhi = (int(x) for x in args.max_tokens.split(","))
    repo = short_tmpdir("zslm")
    folder, tokenizer = make_repo(repo, args.hidden, args.layers, args.concurrency)
    rng = random.Random(0)
    asks = [(prompt_ids(tokenizer, i, rng.randint(lo, hi)), rng.randint(mlo, mhi))
            for i in range(args.requests)]
    srv = Server(repo, workers=1).wait_ready(300)
    try:
        print(f"GPT-2 {args.layers} layers hidden {args.hidden}, C={args.concurrency}, "
              f"{args.requests} requests, prompts {lo}-{hi} tokens, max_tokens {mlo}-{mhi} "
              f"(asked {sum(m for _, m in asks)} tokens), 1 worker")
        rate, useful = in_process(folder, asks, args.concurrency)
        print(f"{'in-process generate, static batches':<38} {rate:>9,.0f} tokens/s", flush=True)
        for name, model in (("iterative (continuous batching)", "lm"),
                            ("request-level batches of streams", "lm_batches")):
            served(srv, model, asks[:args.concurrency], args.concurrency)   # warm
            rate, ttft, got = served(srv, model, asks, args.concurrency)
            print(f"{name:<38} {rate:>9,.0f} tokens/s  TTFT p50 {ttft * 1000:,.1f} ms  "
                  f"({got} tokens)", flush=True)
    finally:
        srv.stop()
        shutil.rmtree(repo, ignore_errors=True)


if __name__ == "__main__":
    main()
