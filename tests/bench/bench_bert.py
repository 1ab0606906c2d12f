"""The ``bert`` workload (WORKLOADS.md): BERT-mini, random weights, lengths drawn per request
uniformly from a range, over HTTP (binary tensors) at C=1, 16, 64, against one server that
holds the model three times: batched by shape only, padded (to the longest in a batch,
where the latency model says it pays), and padded to buckets. Beside each level: the
server's mean batch, and the model in-process at that batch size, lengths from the same
draw (shape-only: a batch of one length; padded: a batch of mixed lengths padded to its
longest, or to its bucket).

    python tests/bench/bench_bert.py [--lengths 8-32,8-128] [--duration-s 20]

The load generator shares the host's cores with the server; say so beside the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
import warnings
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests import bert  # noqa: E402
from zeroserve.broker.bench import report as br  # noqa: E402
from zeroserve.broker.bench.http import HttpConnection, Url, request_bytes  # noqa: E402
from zeroserve.broker.bench.main import scrape  # noqa: E402

BUCKETS = [16, 32, 64, 128]
VOCAB = bert.MINI["vocab_size"]
MODELS = {"bert": None, "bert_pad": bert.PADDING,
          "bert_bucket": {**bert.PADDING, "buckets": BUCKETS}}


def build(repo: Path, delay_ms: float) -> Any:
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = bert.model(bert.MINI)
        for name, padding in MODELS.items():
            bert.write(repo, name, module, padding=padding, max_queue_delay_ms=delay_ms)
    torch.set_num_threads(1)
    return module


def body(length: int, rng: np.random.Generator) -> tuple[bytes, int]:
    """A v2 binary-tensor body of one request (Triton's extension)."""
    ids = rng.integers(0, VOCAB, (1, length), dtype=np.int64)
    mask = np.ones((1, length), dtype=np.int64)
    header = json.dumps({"inputs": [
        {"name": n, "datatype": "INT64", "shape": [1, length],
         "parameters": {"binary_data_size": a.nbytes}}
        for n, a in (("input_ids", ids), ("attention_mask", mask))],
        "outputs": [{"name": "pooler_output", "parameters": {"binary_data": True}}]}).encode()
    return header + ids.tobytes() + mask.tobytes(), len(header)


async def closed_loop(url: Url, model: str, lengths: tuple[int, int], streams: int,
                      warmup_s: float, duration_s: float) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    raws = []
    for _ in range(512):
        b, hlen = body(int(rng.integers(lengths[0], lengths[1] + 1)), rng)
        raws.append(request_bytes(url, "POST", f"/v2/models/{model}/infer", b, {
            "Content-Type": "application/octet-stream",
            "Inference-Header-Content-Length": str(hlen)}))
    conns = [await HttpConnection.open(url) for _ in range(streams)]
    start = time.monotonic()
    count_from, end = start + warmup_s, start + warmup_s + duration_s
    lat: list[float] = []
    errors: dict[str, int] = {}

    async def stream(i: int) -> None:
        k = i
        while time.monotonic() < end:
            t = time.monotonic()
            resp = await conns[i].send(raws[k % len(raws)])
            k += streams
            if t >= count_from:
                if resp.status == 200:
                    lat.append(time.monotonic() - t)
                else:
                    key = f"{resp.status} {resp.body[:120]!r}"
                    errors[key] = errors.get(key, 0) + 1

    await asyncio.gather(*(stream(i) for i in range(streams)))
    for c in conns:
        c.close()
    lat.sort()

    def pct(q: float) -> float:
        return lat[min(len(lat) - 1, int(q * len(lat)))] * 1000 if lat else math.nan
    return {"rps": len(lat) / duration_s, "p50_ms": pct(0.5), "p99_ms": pct(0.99),
            "errors": errors}


def in_process(module: Any, batch: int, lengths: tuple[int, int], padding: Any,
               seconds: float = 3.0, device: str = "cpu") -> float:
    """Samples/s of the model called directly at ``batch``, lengths from the same draw:
    padded, a batch of mixed lengths padded to its bucket; else a batch of one length.
    On ``device`` (the module is there already), each call with its copies in and out,
    as a worker's batch has them."""
    import torch

    rng = np.random.default_rng(1)
    done, spent = 0, 0.0
    with torch.inference_mode():
        while spent < seconds:
            if padding is not None:
                own = rng.integers(lengths[0], lengths[1] + 1, batch)
                n = next(b for b in padding.get("buckets", []) + [int(own.max())]
                         if b >= own.max())
                mask = torch.from_numpy((np.arange(n)[None, :] < own[:, None]).astype(np.int64))
            else:
                n = int(rng.integers(lengths[0], lengths[1] + 1))
                mask = torch.ones((batch, n), dtype=torch.int64)
            ids = torch.from_numpy(rng.integers(0, VOCAB, (batch, n), dtype=np.int64))
            t = time.perf_counter()
            out = module(ids.to(device), mask.to(device))
            out[1].cpu()   # the pooled output back, as served: waits for the device
            spent += time.perf_counter() - t
            done += batch
    return done / spent


def serve(repo: Path, port: int) -> subprocess.Popen[bytes]:
    runtime = Path(tempfile.mkdtemp(prefix="zsbb", dir="/tmp"))
    log = open(runtime / "serve.log", "wb")
    proc = subprocess.Popen([sys.executable, str(ROOT / "bin" / "zeroserve"), "serve",
                             "--model-dir", str(repo), "--http-port", str(port),
                             "--grpc-port", str(port + 1), "--runtime-dir", str(runtime),
                             "--workers", "1", "--threads", "1"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=1):
                return proc
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(0.2)  # noqa: sleep-ok (polls a starting server until its deadline)
    proc.kill()
    raise SystemExit((runtime / "serve.log").read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="8-32,8-128")
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--warmup-s", type=float, default=3.0)
    ap.add_argument("--duration-s", type=float, default=20.0)
    ap.add_argument("--delay-ms", type=float, default=5.0, help="max_queue_delay_ms")
    ap.add_argument("--port", type=int, default=18080)
    args = ap.parse_args()
    repo = Path(tempfile.mkdtemp(prefix="zsbert"))
    module = build(repo, args.delay_ms)
    proc = serve(repo, args.port)
    base = f"http://127.0.0.1:{args.port}"
    url = Url.parse(base)
    rows = []
    try:
        for spec in args.lengths.split(","):
            lo, hi = (int(x) for x in spec.split("-"))
            for c in (int(x) for x in args.concurrency.split(",")):
                for model, padding in MODELS.items():
                    before = scrape(base, model)
                    got = asyncio.run(closed_loop(url, model, (lo, hi), c, args.warmup_s,
                                                  args.duration_s))
                    split = br.metrics_split(before, scrape(base, model))
                    b = max(1, round(split.get("server_batch_mean") or 1))
                    got.update(lengths=spec, c=c, model=model, batch=b,
                               inproc=in_process(module, b, (lo, hi), padding))
                    rows.append(got)
                    for err, n in got["errors"].items():
                        print(f"    {n} x {err}")
                    print(f"{spec:>7} C={c:<3} {model:<11} {got['rps']:8.1f} req/s  "
                          f"p50 {got['p50_ms']:7.1f}  p99 {got['p99_ms']:7.1f} ms  "
                          f"err {sum(got['errors'].values())}  batch {b:>2}  in-process at it "
                          f"{got['inproc']:7.1f}/s ({got['rps'] / got['inproc']:.0%})",
                          flush=True)
    finally:
        proc.terminate()
        proc.wait(60)
        shutil.rmtree(repo, ignore_errors=True)
    print(json.dumps({"load": os.getloadavg()[0], "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
