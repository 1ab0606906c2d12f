"""Continuous batching against request-level batching of streams: time to first response
and responses per second of the same character bigram model (examples/chargen) served as a
generator (a batch of streams holds its worker until the generator ends) and as an
iterative model (the worker runs its steps; requests join at every step), over HTTP
generate_stream (Server-Sent Events) and the direct client, beside both called in-process.

    .venv/bin/python -m tests.bench.bench_generation [--tokens 100] [--streams 40]
        [--concurrency 8] [--step-ms 0]

One ``zeroserve serve`` with one worker serving both models. At concurrency C, C streams
run at once (SSE's on C keep-alive connections, the direct client's from one
AsyncClient), each one after another until ``--streams`` have run per stream slot; time to
first response is per stream (median and p90), responses/s is every response over the
wall time. In-process: the generator driven to its end for a batch of C requests; the
iterative handler's join() for C requests, then step() until every one has ended. Both
models give the same text for the same prompt, which the script checks. ``--step-ms``
makes each step of both cost that much more (a sleep), as a real model's decode step does
(about 5 ms for WORKLOADS' ``lm`` here): chargen's own step takes microseconds, so without
it the figures measure the messages, not the batching.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import threading
import time
from http.client import HTTPConnection
from pathlib import Path
from typing import Callable

import numpy as np

from tests.bench.bench_streams import CHARGEN, Figures, in_process, prompt
from tests.conftest import Server, short_tmpdir

# chargen's handler, each step slowed by step_ms (a file beside it)
GENERATOR = '''
import time

from . import bigram


class Model(bigram.Model):
    def load(self, version_dir, device):
        super().load(version_dir, device)
        self.step_s = float((version_dir / "step_ms").read_text()) / 1000.0

    def predict(self, inputs, rows):
        for step in super().predict(inputs, rows):
            if self.step_s:
                time.sleep(self.step_s)  # noqa: sleep-ok (a model step's cost, --step-ms)
            yield step
'''
# chargen's handler with join() and step(): each sequence draws from its own generator,
# seeded by its prompt, so its text is chargen's for the same prompt
STEPS = '''
import time
import zlib

import numpy as np
import torch

from . import bigram


class Model(bigram.Model):
    def load(self, version_dir, device):
        super().load(version_dir, device)
        self.step_s = float((version_dir / "step_ms").read_text()) / 1000.0

    def join(self, seq_id, inputs):
        prompt = inputs["text_input"][0][0]
        return {"gen": torch.Generator().manual_seed(zlib.crc32(prompt)),
                "last": self._last_char(prompt), "left": int(inputs["max_tokens"][0, 0]),
                "done": 0}

    def step(self, states):
        if self.step_s:
            time.sleep(self.step_s)  # noqa: sleep-ok (a model step's cost, --step-ms)
        ids = list(states)
        last = torch.tensor([states[s]["last"] for s in ids])
        probs = self.log_probs[last].exp().cpu()
        out = {}
        for k, seq in enumerate(ids):
            st = states[seq]
            if st["left"] <= 0:
                out[seq] = (None, True)
                continue
            nxt = int(torch.multinomial(probs[k], 1, generator=st["gen"]))
            st["last"] = nxt
            st["done"] += 1
            out[seq] = ({"text_output": np.array([[self.chars[nxt].encode()]], dtype=object)},
                        st["done"] == st["left"])
        return out
'''
GENERATING, ITERATIVE = "chargen", "chargen_steps"


def make_repo(repo: Path, most: int, step_ms: float) -> None:
    for name, source in ((GENERATING, GENERATOR), (ITERATIVE, STEPS)):
        vdir = repo / name / "1"
        vdir.mkdir(parents=True)
        shutil.copy(CHARGEN / "1" / "model.py", vdir / "bigram.py")
        (vdir / "model.py").write_text(source)
        (vdir / "step_ms").write_text(str(step_ms))
        cfg = json.loads((CHARGEN / "config.json").read_text())
        cfg.update(name=name, max_batch_size=most)
        if name == ITERATIVE:
            cfg.pop("model_transaction_policy", None)
            cfg["sequences"] = {"max": most}
        (repo / name / "config.json").write_text(json.dumps(cfg))


def in_process_steps(repo: Path, tokens: int, concurrency: int, rounds: int) -> Figures:
    import torch

    from zeroserve.models.loader import load
    from zeroserve.models.repository import load_config

    cfg = load_config(repo / ITERATIVE)
    loaded = load(cfg, 1, repo / ITERATIVE / "1", "cpu", lambda: 0)
    handler = loaded.handler
    fig = Figures()
    start = time.perf_counter()
    with torch.inference_mode():
        for r in range(rounds):
            t0 = time.perf_counter()
            states = {k: handler.join(k, {
                "text_input": np.array([[f"prompt {r * concurrency + k} ".encode()]],
                                       dtype=object),
                "max_tokens": torch.tensor([[tokens]], dtype=torch.int32)})
                for k in range(concurrency)}
            first = True
            while states:
                out = handler.step(states)
                if first:
                    fig.first_s += [time.perf_counter() - t0] * concurrency
                    first = False
                fig.responses += len(out)
                for k, (_, final) in out.items():
                    if final:
                        del states[k]
    fig.wall_s = time.perf_counter() - start
    loaded.release()
    return fig


def sse(srv: Server, model: str, tokens: int, concurrency: int, rounds: int,
        texts: dict[str, str]) -> Figures:
    fig = Figures()
    lock = threading.Lock()

    def slot(k: int) -> None:
        conn = HTTPConnection("127.0.0.1", srv.port, timeout=60)
        try:
            for r in range(rounds):
                text = f"prompt {r * concurrency + k} "
                body = json.dumps({"text_input": text, "max_tokens": tokens}).encode()
                t0 = time.perf_counter()
                conn.request("POST", f"/v2/models/{model}/generate_stream", body)
                resp = conn.getresponse()
                first, chars = None, []
                for line in resp:
                    if line.startswith(b"data: "):
                        chars.append(json.loads(line[6:])["text_output"])
                        first = first if first is not None else time.perf_counter() - t0
                assert resp.status == 200 and len(chars) == tokens, (resp.status, len(chars))
                with lock:
                    fig.first_s.append(first or 0.0)
                    fig.responses += len(chars)
                    if texts.setdefault(text, "".join(chars)) != "".join(chars):
                        raise AssertionError(f"{model} answered {text!r} with another text")
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


def direct(srv: Server, model: str, tokens: int, concurrency: int, rounds: int) -> Figures:
    from zeroserve.broker.client import AsyncClient

    fig = Figures()

    async def main() -> None:
        async with AsyncClient(srv.frontend) as c:
            await c.wait_connected(5)

            async def slot(k: int) -> None:
                for r in range(rounds):
                    t0 = time.perf_counter()
                    async for resp in c.stream(model, prompt(r * concurrency + k, tokens)):
                        if resp.index == 0:
                            fig.first_s.append(time.perf_counter() - t0)
                        fig.responses += 1
            start = time.perf_counter()
            await asyncio.gather(*(slot(k) for k in range(concurrency)))
            fig.wall_s = time.perf_counter() - start
    asyncio.run(main())
    return fig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=100)
    ap.add_argument("--streams", type=int, default=40, help="streams per concurrency level")
    ap.add_argument("--concurrency", default="8")
    ap.add_argument("--step-ms", type=float, default=0.0,
                    help="what each step costs beside chargen's own (a sleep)")
    args = ap.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    repo = short_tmpdir("zsrepo")
    make_repo(repo, max(levels), args.step_ms)
    srv = Server(Path(repo), workers=1).wait_ready(120)
    texts: dict[str, str] = {}
    try:
        print(f"chargen as a generator and as an iterative model ({ITERATIVE}, sequences.max "
              f"{max(levels)}), {args.tokens} responses a request, steps {args.step_ms:g} ms "
              f"slower, 1 worker; time to first response (ms) and responses/s")
        print(f"{'':<30} {'TTFR p50':>9} {'TTFR p90':>9} {'responses/s':>12}")
        for c in levels:
            rounds = max(1, args.streams // c)
            runs: list[tuple[str, Callable[[], Figures]]] = [
                (f"generator in-process C={c}",
                 lambda: in_process(args.tokens, c, rounds, repo / GENERATING)),
                (f"iterative in-process C={c}",
                 lambda: in_process_steps(repo, args.tokens, c, rounds)),
                (f"generator direct C={c}",
                 lambda: direct(srv, GENERATING, args.tokens, c, rounds)),
                (f"iterative direct C={c}",
                 lambda: direct(srv, ITERATIVE, args.tokens, c, rounds)),
                (f"generator SSE C={c}",
                 lambda: sse(srv, GENERATING, args.tokens, c, rounds, texts)),
                (f"iterative SSE C={c}",
                 lambda: sse(srv, ITERATIVE, args.tokens, c, rounds, texts))]
            for name, run in runs:
                run()   # warm: first shapes, connections, the latency model
                print(run().row(name), flush=True)
        print(f"same text from both models for each of {len(texts)} prompts")
    finally:
        srv.stop()
        shutil.rmtree(repo, ignore_errors=True)


if __name__ == "__main__":
    main()
