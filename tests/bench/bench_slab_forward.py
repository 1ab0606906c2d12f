"""What a prefill's chunk costs in the decode's forward, one forward at a time, on
WORKLOADS' ``lm`` (a GPT-2 of 4 layers, hidden 256), one torch thread, the thread's CPU
clock: a decode of 8 rows over the slab (models/kv_slab.py) alone; with a chunk of n
prompt tokens packed in the same forward (``sequences.step_ratio``'s way); the decode and
a forward of the chunk apart (``prefill_tokens``' way); and the decode rows padded to the
chunk's length, ``[rows, n]`` with a 4D mask through the model's own sdpa attention (the
way that keeps the model's attention, not built: every row computes n positions).

    .venv/bin/python -m tests.bench.bench_slab_forward [--chunks 16,32,72] [--repeat 30]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import time
from typing import Any, Callable

import torch
from transformers import AutoModelForCausalLM
from transformers.cache_utils import Cache, DynamicLayer

from zeroserve.models.kv_slab import ATTENTION, Slab, use_slab_attention
from tests.conftest import short_tmpdir
from tests.lm import write_lm


def cpu_ms(run: Callable[[], Any], repeat: int) -> float:
    run()
    times = []
    for _ in range(repeat):
        start = time.thread_time()
        run()
        times.append(time.thread_time() - start)
    return statistics.median(times) * 1000


class _Padded(DynamicLayer):
    """A cache layer over buffers ``[rows, heads, columns, head_dim]`` that writes each
    row's real tokens (the last ``feeds[r]`` of its T positions) at its own length."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, plan: dict[str, Any]) -> None:
        super().__init__()
        self.k, self.v, self.plan, self.is_initialized = keys, values, plan, True

    def update(self, keys: torch.Tensor, values: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        rows, at, columns, width = self.plan["write"]
        self.k[rows, :, columns] = keys[rows, :, at]
        self.v[rows, :, columns] = values[rows, :, at]
        return self.k[:keys.shape[0], :, :width], self.v[:keys.shape[0], :, :width]

    def get_seq_length(self) -> int:
        return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", default="16,32,72")
    ap.add_argument("--repeat", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(1)
    repo = short_tmpdir("zsslabfwd")
    try:
        folder, _ = write_lm(repo, "lm", most=32, hidden=256, layers=4)
        model = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
        padded_model = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    finally:
        shutil.rmtree(repo, ignore_errors=True)
    use_slab_attention(model)
    cfg = model.config
    heads, dim = cfg.n_head, cfg.n_embd // cfg.n_head
    rng = random.Random(1)
    lengths = [rng.randint(60, 250) for _ in range(8)]
    slab = Slab([(torch.randn(1, heads, lengths[0], dim),) * 2] * cfg.n_layer, 9, 512)
    for i, n in enumerate(lengths):
        slab.add(i, [(torch.randn(1, heads, n, dim), torch.randn(1, heads, n, dim))
                     for _ in range(cfg.n_layer)])
    slab.add(8, None)
    mask = torch.ones(1, 1, 1, 1, dtype=torch.bool)

    def packed(n: int) -> None:
        saved = list(slab.lengths)
        slab.lengths[8] = 40   # a chunk after 40 prompt tokens
        positions, places = slab.begin([1] * 8 + [n])
        model(input_ids=torch.randint(1, 1000, (1, 8 + n)), position_ids=positions,
              attention_mask=mask, use_cache=True, logits_to_keep=torch.tensor(places),
              cache=slab.cache, **{ATTENTION: slab})
        slab.end()
        slab.lengths = saved

    def apart(n: int) -> None:
        model(input_ids=torch.randint(1, 1000, (1, n)), use_cache=True, logits_to_keep=1)

    keys = [torch.randn(9, heads, 512, dim) for _ in range(cfg.n_layer)]
    plan: dict[str, Any] = {}
    cache = Cache(layers=[_Padded(k, torch.randn_like(k), plan) for k in keys])

    def padded(n: int) -> None:
        rows_in = lengths + [40]
        feeds = [1] * 8 + [n]
        rows, at, columns = [], [], []
        for r, (length, m) in enumerate(zip(rows_in, feeds)):
            for j in range(m):
                rows.append(r)
                at.append(n - m + j)
                columns.append(length + j)
        width = max(length + m for length, m in zip(rows_in, feeds))
        plan["write"] = (torch.tensor(rows), torch.tensor(at), torch.tensor(columns), width)
        ahead = torch.tensor(rows_in)[:, None] + torch.arange(n)[None, :] - n + \
            torch.tensor(feeds)[:, None]
        bound = ahead.clamp(min=0)   # a pad's query sees column 0: no NaN
        padded_model(input_ids=torch.randint(1, 1000, (9, n)), position_ids=bound,
                     attention_mask=(torch.arange(width)[None, None, :] <=
                                     bound[:, :, None])[:, None],
                     use_cache=True, logits_to_keep=1, cache=cache)

    with torch.inference_mode():
        decode = cpu_ms(lambda: packed(0), args.repeat)
        print(f"one torch thread, the thread's CPU clock, medians of {args.repeat} (load "
              f"average {os.getloadavg()[0]:.1f}); a decode of 8 rows over the slab alone: "
              f"{decode:.2f} ms")
        for n in (int(c) for c in args.chunks.split(",")):
            one = cpu_ms(lambda: packed(n), args.repeat)
            alone = cpu_ms(lambda: apart(n), args.repeat)
            pad = cpu_ms(lambda: padded(n), args.repeat)
            print(f"chunk of {n}: in the decode {one:.2f} ms ({one / decode:.2f}x the "
                  f"decode); apart {decode + alone:.2f} ms (its forward {alone:.2f}); "
                  f"padded [9, {n}] {pad:.2f} ms")


if __name__ == "__main__":
    main()
