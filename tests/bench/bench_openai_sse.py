"""Streams over OpenAI's completions route (HTTP, server-sent events) on WORKLOADS' ``lm``
(a GPT-2 of 4 layers, hidden 256, random weights), served as an iterative model: the time
to the first token and the gaps between tokens at C streams while new requests keep
joining, beside the model's prefill of the same prompts in-process (one forward of the
prompt, the first token's cost without a server).

    .venv/bin/python -m tests.bench.bench_openai_sse [--concurrency 8] [--requests 48]
        [--before <commit> [--rounds 2]]

With ``--before`` the server of that commit (its tree from ``git archive``, imported ahead
of this one's) and this one's serve the same requests in turns, ``--rounds`` times each,
the before first: a baseline from the same run.

The `openai` client (AsyncOpenAI) keeps C streams open, each sending its next request
when one ends; prompts of 16-128 tokens, ``max_tokens`` uniform in 16-256 (WORKLOADS'
generation load). The client shares the host's cores with the server.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import random
import os
import shutil
import statistics
import subprocess
import tarfile
import time
from pathlib import Path
from typing import Any

from tests.conftest import Server, short_tmpdir
from tests.lm import prompt_ids, write_lm


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def prefill_s(folder: Any, prompts: list[list[int]]) -> float:
    """The median time of one forward of a prompt, in-process, one thread."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    times = []
    with torch.inference_mode():
        model(torch.tensor([prompts[0]]))
        for ids in prompts:
            t = time.perf_counter()
            model(torch.tensor([ids]))
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def tree_of(commit: str, into: Path) -> dict[str, str]:
    """The environment that runs ``commit``'s zeroserve: its tree, extracted, imported
    as ``zeroserve`` ahead of the installed one (the package is the repository's root)."""
    tree = into / "tree"
    tree.mkdir(parents=True)
    root = Path(__file__).resolve().parents[2]
    archive = subprocess.run(["git", "-C", str(root), "archive", commit],
                             check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(tree)
    (into / "site").mkdir()
    (into / "site" / "zeroserve").symlink_to(tree)
    return {"PYTHONPATH": os.pathsep.join([str(into / "site"),
                                           *filter(None, [os.environ.get("PYTHONPATH")])])}


def serve(repo: Path, asks: list[tuple[list[int], int]], concurrency: int,
          env: dict[str, str] | None) -> tuple[list[float], list[float], float]:
    """The requests over SSE, C at a time: times to the first token, gaps, wall."""
    import openai

    srv = Server(repo, extra=["--log-level", "warning"], env=env).wait_ready(180)
    firsts: list[float] = []
    gaps: list[float] = []
    try:
        async def run() -> float:
            client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused",
                                        max_retries=0)
            todo = list(asks)

            async def slot() -> None:
                while todo:
                    ids, m = todo.pop()
                    t0 = last = time.perf_counter()
                    stream = await client.completions.create(model="lm", prompt=ids,
                                                             max_tokens=m, stream=True)
                    async for chunk in stream:
                        now = time.perf_counter()
                        if not chunk.choices or not chunk.choices[0].text:
                            continue
                        if last == t0:
                            firsts.append(now - t0)
                        else:
                            gaps.append(now - last)
                        last = now
            start = time.perf_counter()
            try:
                await asyncio.gather(*(slot() for _ in range(concurrency)))
            finally:
                await client.close()
            return time.perf_counter() - start
        wall = asyncio.run(run())
    finally:
        srv.stop()
    return firsts, gaps, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--before", help="a commit whose server is measured in turns with this one")
    ap.add_argument("--rounds", type=int, default=2, help="turns of each, with --before")
    args = ap.parse_args()

    repo = short_tmpdir("zssse")
    folder, tokenizer = write_lm(repo, "lm", most=32, hidden=256, layers=4)
    config = json.loads((repo / "lm" / "config.json").read_text())
    config["text"] = {"task": "generate", "max_length": 512}
    (repo / "lm" / "config.json").write_text(json.dumps(config))
    rng = random.Random(5)
    asks = [(prompt_ids(tokenizer, i, rng.randint(16, 128)), rng.randint(16, 256))
            for i in range(args.requests)]
    runs: list[tuple[str, dict[str, str] | None]] = [("this tree", None)]
    before = short_tmpdir("zsbefore")
    if args.before:
        runs = [(f"before {args.before}", tree_of(args.before, before)),
                ("this tree", None)] * args.rounds
    rows = []
    try:
        for label, env in runs:
            rows.append((label, *serve(repo, asks,
                                       args.concurrency, env)))
        prefill = prefill_s(folder, [ids for ids, _ in asks[:24]])
    finally:
        shutil.rmtree(repo, ignore_errors=True)
        shutil.rmtree(before, ignore_errors=True)
    print(f"C={args.concurrency}, {args.requests} requests over SSE a run; prefill "
          f"in-process {prefill * 1000:.1f} ms (goal: time to first token p50 <= prefill "
          f"+ 5 ms = {(prefill + 0.005) * 1000:.1f} ms)")
    for label, firsts, gaps, wall in rows:
        print(f"{label}: {wall:.1f} s; time to first token p50 {pct(firsts, .5) * 1000:.1f} "
              f"ms, p99 {pct(firsts, .99) * 1000:.1f} ms; gap between tokens p50 "
              f"{pct(gaps, .5) * 1000:.1f} ms, p99 {pct(gaps, .99) * 1000:.1f} ms "
              f"({pct(gaps, .99) / pct(gaps, .5):.1f}x; goal <= 2x)")


if __name__ == "__main__":
    main()
