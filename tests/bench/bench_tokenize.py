"""Where the gateway tokenizes (gateway/tokens.py): one call of the tokenizer on the event
loop against the same call handed to a thread (``run_in_executor``), for inputs of a few
sizes, WORKLOADS.md's ``bert-emb`` tokenizer. What the loop is kept from is the inline
time; what the hand-off adds shows where the two cross.

    python -m tests.bench.bench_tokenize [--seconds 0.5]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import importlib.util
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=0.5)
    args = ap.parse_args()
    path = ROOT.parent / "shared" / "bench" / "make_text_models.py"
    spec = importlib.util.spec_from_file_location("make_text_models", path)
    if spec is None or spec.loader is None or not path.exists():
        raise SystemExit(f"{path} not found: it builds the bert-emb tokenizer")
    mk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mk)
    from tokenizers import Tokenizer
    with tempfile.TemporaryDirectory() as folder:
        mk.make_bert_emb(folder)
        tok = Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    threads = concurrent.futures.ThreadPoolExecutor(2)

    async def timed(texts: list[str], inline: bool) -> float:
        loop = asyncio.get_running_loop()
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < args.seconds:
            if inline:
                tok.encode_batch(texts)
            else:
                await loop.run_in_executor(threads, tok.encode_batch, texts)
            n += 1
        return (time.perf_counter() - start) / n * 1e6

    async def run() -> None:
        print(f"{'texts x tokens':>16} {'chars':>7} {'inline µs':>10} {'thread µs':>10}")
        for count, tokens in ((1, 16), (1, 64), (1, 512), (4, 64), (8, 64), (32, 64)):
            texts = [mk.text(tokens)] * count
            inline, thread = await timed(texts, True), await timed(texts, False)
            print(f"{count:>6} x {tokens:<7} {sum(map(len, texts)):>7} {inline:>10.0f} "
                  f"{thread:>10.0f}", flush=True)
    asyncio.run(run())
    threads.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
