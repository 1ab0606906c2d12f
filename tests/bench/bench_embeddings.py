"""Embeddings through OpenAI's route (WORKLOADS.md's ``bert-emb``, text in), against the
model in-process in the same run:

- in-process: a window of 256 lengths sorted, batched by a token budget (padded tokens),
  mean-pooled and normalized: the loop TEI and vLLM run, without a server;
- served, token budget: ``POST /v1/embeddings`` at C=32, one text a request, lengths
  log-normal (median 64, sigma 0.8, clipped to 8-512), the model folder served as it
  is (``platform: transformers``) with ``max_batch_tokens``;
- served, today's batching: the same, batched by rows (``max_batch_size`` 32, padding
  where the latency model says it pays), no token budget;
- one request of 1,000 texts against 1,000 concurrent one-text requests;
- with ``--infinity PATH`` (the ``infinity_emb`` command of Infinity, a Python embedding
  server, installed in its own venv: ``pip install "infinity-emb[server,torch]"``), the
  same load against it serving the same folder (``--engine torch --device cpu``).

    python tests/bench/bench_embeddings.py [--budget 2048] [--duration-s 20]

The model folder is built by ../shared/bench/make_text_models.py (WORKLOADS.md's
builder, beside the checkout). The load generator shares the host's cores with the
server; say so beside the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.conftest import Server, free_port  # noqa: E402
from tests.bench.harness import broker_metric  # noqa: E402
from zeroserve.broker.bench.http import HttpConnection, Url, request_bytes  # noqa: E402

WINDOW = 256


def builder() -> Any:
    """WORKLOADS.md's builder of the text models, as a module."""
    import importlib.util
    path = ROOT.parent / "shared" / "bench" / "make_text_models.py"
    spec = importlib.util.spec_from_file_location("make_text_models", path)
    if spec is None or spec.loader is None or not path.exists():
        raise SystemExit(f"{path} not found: it builds the bert-emb folder")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def lengths(n: int, seed: int = 1) -> list[int]:
    """WORKLOADS.md's text load: log-normal, median 64, sigma 0.8, clipped to 8-512."""
    rng = np.random.default_rng(seed)
    return [int(x) for x in np.clip(rng.lognormal(math.log(64), 0.8, n), 8, 512)]


def repo_with(folder: Path, root: Path, models: dict[str, dict[str, Any]]) -> Path:
    for name, batching in models.items():
        (root / name).mkdir(parents=True)
        shutil.copytree(folder, root / name / "1")
        cfg = {"platform": "transformers", "max_batch_size": batching.pop("rows", 64),
               "text": {"task": "embeddings"}, "dynamic_batching": batching}
        (root / name / "config.json").write_text(json.dumps(cfg))
    return root


def in_process(folder: Path, budget: int, threads: int, seconds: float) -> float:
    """Tokens/s (the texts' own) of the model called directly on sorted windows."""
    import torch
    from transformers import BertModel

    torch.set_num_threads(threads)
    model = BertModel.from_pretrained(str(folder)).eval()
    draw = lengths(20000, seed=2)
    done = spent = 0.0
    k = 0
    with torch.inference_mode():
        while spent < seconds:
            window = sorted(draw[k:k + WINDOW])
            k = (k + WINDOW) % (len(draw) - WINDOW)
            i = 0
            while i < len(window):
                j = i + 1
                while j < len(window) and (j + 1 - i) * window[j] <= budget:
                    j += 1
                batch = window[i:j]
                n = max(batch)
                mask = torch.from_numpy((np.arange(n)[None, :] <
                                         np.array(batch)[:, None]).astype(np.int64))
                ids = torch.randint(1000, 30000, (len(batch), n))
                t = time.perf_counter()
                hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
                m = mask.unsqueeze(-1).float()
                torch.nn.functional.normalize((hidden * m).sum(1) / m.sum(1), dim=1)
                spent += time.perf_counter() - t
                done += sum(batch)
                i = j
    return done / spent


async def closed_loop(url: Url, model: str, text: Any, concurrency: int, warmup_s: float,
                      duration_s: float, route: str = "/v1/embeddings") -> dict[str, Any]:
    draw = lengths(4096)
    raws = [(n, request_bytes(url, "POST", route, json.dumps(
        {"model": model, "input": text(n), "encoding_format": "base64"}).encode(),
        {"Content-Type": "application/json"})) for n in draw]
    conns = [await HttpConnection.open(url) for _ in range(concurrency)]
    start = time.monotonic()
    count_from, end = start + warmup_s, start + warmup_s + duration_s
    lat: list[float] = []
    tokens = 0
    errors: dict[str, int] = {}

    async def stream(i: int) -> None:
        nonlocal tokens
        k = i
        while time.monotonic() < end:
            n, raw = raws[k % len(raws)]
            k += concurrency
            t = time.monotonic()
            resp = await conns[i].send(raw)
            if t >= count_from:
                if resp.status == 200:
                    lat.append(time.monotonic() - t)
                    tokens += n
                else:
                    key = f"{resp.status} {resp.body[:120]!r}"
                    errors[key] = errors.get(key, 0) + 1

    await asyncio.gather(*(stream(i) for i in range(concurrency)))
    for c in conns:
        c.close()
    lat.sort()

    def pct(q: float) -> float:
        return lat[min(len(lat) - 1, int(q * len(lat)))] * 1000 if lat else math.nan
    return {"tokens_s": tokens / duration_s, "rps": len(lat) / duration_s,
            "p50_ms": pct(0.5), "p99_ms": pct(0.99), "errors": errors}


async def thousand(url: Url, model: str, text: Any) -> tuple[float, float]:
    """Seconds for one request of 1,000 texts, and for 1,000 concurrent one-text ones."""
    # no two texts alike: a text repeated in one request is computed once
    texts = [f"w{k} {text(n - 1)}" for k, n in enumerate(lengths(1000, seed=3))]
    conn = await HttpConnection.open(url)
    body = json.dumps({"model": model, "input": texts,
                       "encoding_format": "base64"}).encode()
    t = time.monotonic()
    resp = await conn.send(request_bytes(url, "POST", "/v1/embeddings", body,
                                         {"Content-Type": "application/json"}))
    one = time.monotonic() - t
    conn.close()
    assert resp.status == 200, resp.body[:200]
    conns = [await HttpConnection.open(url) for _ in range(64)]
    raws = [request_bytes(url, "POST", "/v1/embeddings", json.dumps(
        {"model": model, "input": t, "encoding_format": "base64"}).encode(),
        {"Content-Type": "application/json"}) for t in texts]
    t = time.monotonic()

    async def stream(i: int) -> None:
        for raw in raws[i::len(conns)]:
            got = await conns[i].send(raw)
            assert got.status == 200, got.body[:200]
    await asyncio.gather(*(stream(i) for i in range(len(conns))))
    many = time.monotonic() - t
    for c in conns:
        c.close()
    return one, many


def padding_ratio(url: str, model: str) -> float:
    import urllib.request
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    total = broker_metric(text, "zeroserve_batch_padding_ratio_sum", {"model": model})
    count = broker_metric(text, "zeroserve_batch_padding_ratio_count", {"model": model})
    tokens = broker_metric(text, "zeroserve_batch_tokens_sum", {"model": model})
    return total / count if count else (math.nan if not tokens else 0.0)


def infinity(command: str, folder: Path, threads: int, batch: int, text: Any,
             concurrency: int, warmup_s: float, duration_s: float) -> dict[str, Any]:
    """Infinity serving the same folder, the same load (its route is /embeddings)."""
    import subprocess
    import urllib.request
    port = free_port()
    log = open(folder.parent / "infinity.log", "wb")
    proc = subprocess.Popen([command, "v2", "--model-id", str(folder), "--engine", "torch",
                             "--device", "cpu", "--batch-size", str(batch), "--host",
                             "127.0.0.1", "--port", str(port)], stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit((folder.parent / "infinity.log").read_text()) from None
                time.sleep(0.5)  # noqa: sleep-ok (polls a starting server until its deadline)
        return asyncio.run(closed_loop(Url.parse(f"http://127.0.0.1:{port}"), str(folder),
                                       text, concurrency, warmup_s, duration_s,
                                       "/embeddings"))
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", type=int, default=2048, help="max_batch_tokens served")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2, help="torch threads, both sides")
    ap.add_argument("--warmup-s", type=float, default=3.0)
    ap.add_argument("--duration-s", type=float, default=20.0)
    ap.add_argument("--infinity", default="", help="Infinity's infinity_emb command")
    args = ap.parse_args()
    mk = builder()
    work = Path(tempfile.mkdtemp(prefix="zsemb"))
    folder = work / "bert-emb"
    mk.make_bert_emb(str(folder))
    results: dict[str, Any] = {"load_before": os.getloadavg()[0]}

    def baseline(when: str) -> None:
        """The in-process loop at each thread count and budget; run before and after the
        served levels, the best of them counts (the host's cores are shared)."""
        for threads in sorted({1, args.threads}):
            for budget in sorted({1024, args.budget}):
                key = f"in_process_{budget}_{threads}t_{when}"
                results[key] = in_process(folder, budget, threads, 8.0)
                print(f"in-process ({when}), sorted windows of {WINDOW}, budget {budget}, "
                      f"{threads} thread(s): {results[key]:8.0f} tokens/s", flush=True)

    baseline("before")
    repo = repo_with(folder, work / "repo", {
        "emb": {"max_batch_tokens": args.budget, "max_queue_delay_ms": 0},
        "emb_rows": {"rows": 32}})
    srv = Server(repo, extra=["--threads", str(args.threads), "--log-level", "warning"])
    srv.wait_ready(300)
    url = Url.parse(srv.url)
    try:
        for model in ("emb", "emb_rows"):
            got = asyncio.run(closed_loop(url, model, mk.text, args.concurrency,
                                          args.warmup_s, args.duration_s))
            got["padding"] = padding_ratio(srv.url, model)
            results[model] = got
            print(f"served {model:<9} C={args.concurrency}: {got['tokens_s']:8.0f} tokens/s "
                  f"{got['rps']:6.1f} req/s  p50 {got['p50_ms']:7.1f}  p99 {got['p99_ms']:7.1f} ms"
                  f"  padding {got['padding']:.1%}  errors {sum(got['errors'].values())}",
                  flush=True)
        one, many = asyncio.run(thousand(url, "emb", mk.text))
        results["thousand"] = {"one_request_s": one, "concurrent_s": many}
        print(f"1,000 texts: one request {one:.2f} s, 1,000 concurrent requests {many:.2f} s "
              f"({one / many:.2f}x)", flush=True)
    finally:
        srv.stop()
    shutil.rmtree(work / "repo", ignore_errors=True)
    if args.infinity:
        got = infinity(args.infinity, folder, args.threads, 32, mk.text, args.concurrency,
                       args.warmup_s, args.duration_s)
        results["infinity"] = got
        print(f"Infinity        C={args.concurrency}: {got['tokens_s']:8.0f} tokens/s "
              f"{got['rps']:6.1f} req/s  p50 {got['p50_ms']:7.1f}  p99 {got['p99_ms']:7.1f} ms"
              f"  errors {sum(got['errors'].values())}", flush=True)
    baseline("after")
    shutil.rmtree(work, ignore_errors=True)
    best = max(v for k, v in results.items() if k.startswith("in_process_"))
    print(f"served / best in-process: {results['emb']['tokens_s'] / best:.0%}; token budget / "
          f"rows: {results['emb']['tokens_s'] / results['emb_rows']['tokens_s']:.2f}x")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
