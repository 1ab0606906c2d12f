"""Streams: time to first response and responses per second of a generator yielding
``--tokens`` responses per request (examples/chargen), over the direct client and
HTTP generate_stream (Server-Sent Events), beside the same generator called in-process.

    .venv/bin/python -m tests.bench.bench_streams [--tokens 100] [--streams 40]
        [--concurrency 1,8]

One ``zeroserve serve`` with one worker. At concurrency C, C streams run at once (the
direct client's from one AsyncClient, SSE's on C keep-alive connections), each one
after another until ``--streams`` have run per stream slot; time to first response is
per stream (median and p90), responses/s is every response over the wall time.
In-process: the handler loaded as a worker loads it, predict() called with a batch of
C requests, the generator driven to its end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import threading
import time
from http.client import HTTPConnection
from pathlib import Path
from typing import Callable

import numpy as np

from tests.conftest import ROOT, Server, short_tmpdir

CHARGEN = ROOT / "examples" / "chargen"


def prompt(i: int, tokens: int) -> dict[str, np.ndarray]:
    return {"text_input": np.array([[f"prompt {i} ".encode()]], dtype=object),
            "max_tokens": np.array([[tokens]], np.int32)}


class Figures:
    def __init__(self) -> None:
        self.first_s: list[float] = []
        self.responses = 0
        self.wall_s = 0.0

    def row(self, name: str) -> str:
        q = statistics.quantiles(self.first_s, n=10) if len(self.first_s) > 1 else \
            [self.first_s[0]] * 9
        return (f"{name:<30} {statistics.median(self.first_s) * 1000:>9.2f} "
                f"{q[8] * 1000:>9.2f} {self.responses / self.wall_s:>12,.0f}")


def in_process(tokens: int, concurrency: int, rounds: int, model: Path = CHARGEN) -> Figures:
    import torch

    from zeroserve.models.loader import load
    from zeroserve.models.repository import load_config

    cfg = load_config(model)
    loaded = load(cfg, 1, model / "1", "cpu", lambda: 0)
    fig = Figures()
    start = time.perf_counter()
    for r in range(rounds):
        inputs = {"text_input": np.array([[f"prompt {r * concurrency + i} ".encode()]
                                          for i in range(concurrency)], dtype=object),
                  "max_tokens": np.full((concurrency, 1), tokens, np.int32)}
        named = {"text_input": inputs["text_input"],
                 "max_tokens": torch.from_numpy(inputs["max_tokens"])}
        t0 = time.perf_counter()
        with torch.inference_mode():
            for i, step in enumerate(loaded.fn(named, [slice(k, k + 1)
                                                        for k in range(concurrency)])):
                if i == 0:
                    fig.first_s += [time.perf_counter() - t0] * concurrency
                fig.responses += len(step)
    fig.wall_s = time.perf_counter() - start
    loaded.release()
    return fig


def direct(srv: Server, tokens: int, concurrency: int, rounds: int) -> Figures:
    from zeroserve.broker.client import AsyncClient

    fig = Figures()

    async def main() -> None:
        async with AsyncClient(srv.frontend) as c:
            await c.wait_connected(5)

            async def slot(k: int) -> None:
                for r in range(rounds):
                    t0 = time.perf_counter()
                    async for resp in c.stream("chargen", prompt(r * concurrency + k, tokens)):
                        if resp.index == 0:
                            fig.first_s.append(time.perf_counter() - t0)
                        fig.responses += 1
            start = time.perf_counter()
            await asyncio.gather(*(slot(k) for k in range(concurrency)))
            fig.wall_s = time.perf_counter() - start
    asyncio.run(main())
    return fig


def sse(srv: Server, tokens: int, concurrency: int, rounds: int) -> Figures:
    fig = Figures()
    lock = threading.Lock()

    def slot(k: int) -> None:
        conn = HTTPConnection("127.0.0.1", srv.port, timeout=60)
        try:
            for r in range(rounds):
                body = json.dumps({"text_input": f"prompt {r * concurrency + k} ",
                                   "max_tokens": tokens}).encode()
                t0 = time.perf_counter()
                conn.request("POST", "/v2/models/chargen/generate_stream", body)
                resp = conn.getresponse()
                first, n = None, 0
                for line in resp:
                    if line.startswith(b"data: "):
                        n += 1
                        first = first if first is not None else time.perf_counter() - t0
                assert resp.status == 200 and n == tokens, (resp.status, n)
                with lock:
                    fig.first_s.append(first or 0.0)
                    fig.responses += n
        finally:
            conn.close()
    start = time.perf_counter()
    threads = [threading.Thread(target=slot, args=(k,)) for k in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    fig.wall_s = time.perf_counter() - start
    return fig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=100)
    ap.add_argument("--streams", type=int, default=40, help="streams per concurrency level")
    ap.add_argument("--concurrency", default="1,8")
    args = ap.parse_args()
    repo = short_tmpdir("zsrepo")
    shutil.copytree(CHARGEN, repo / "chargen")
    srv = Server(Path(repo), workers=1).wait_ready(120)
    try:
        print(f"chargen, {args.tokens} responses a request, 1 worker; time to first "
              f"response (ms) and responses/s")
        print(f"{'':<30} {'TTFR p50':>9} {'TTFR p90':>9} {'responses/s':>12}")
        for c in (int(x) for x in args.concurrency.split(",")):
            rounds = max(1, args.streams // c)
            runs: list[tuple[str, Callable[[], Figures]]] = [
                (f"in-process C={c}", lambda: in_process(args.tokens, c, rounds)),
                (f"direct client C={c}", lambda: direct(srv, args.tokens, c, rounds)),
                (f"SSE C={c}", lambda: sse(srv, args.tokens, c, rounds))]
            for name, run in runs:
                run()   # warm: first shapes, connections, the latency model
                print(run().row(name), flush=True)
    finally:
        srv.stop()
        shutil.rmtree(repo, ignore_errors=True)


if __name__ == "__main__":
    main()
