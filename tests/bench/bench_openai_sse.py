"""Streams over OpenAI's completions route (HTTP, server-sent events) on WORKLOADS' ``lm``
(a GPT-2 of 4 layers, hidden 256, random weights), served as an iterative model: the time
to the first token and the gaps between tokens at C streams while new requests keep
joining, beside the model's prefill of the same prompts in-process (one forward of the
prompt, the first token's cost without a server).

    .venv/bin/python -m tests.bench.bench_openai_sse [--concurrency 8] [--requests 48]
        [--before <commit> [--rounds 2]] [--client openai|raw] [--trace]
        [--prefill-tokens 512,32,512:2]

With ``--before`` the server of that commit (its tree from ``git archive``, imported ahead
of this one's) and this one's serve the same requests in turns, ``--rounds`` times each,
the before first: a baseline from the same run.

With ``--prefill-tokens`` this tree's server runs once a round with each of the budgets
(``sequences.prefill_tokens``: the prompt tokens a step prefills at most; ``T:R`` adds
``sequences.step_ratio`` R: prefills in the decode's forward, within R decodes' time), in
turns; the before commit's config has none (its default).

With ``--trace`` this tree's server alone runs once more in opentelemetry mode, every
request with a sampled ``traceparent``, its spans sent to a receiver in this process
(tests/otlp.py), and the time to each first token is cut where it went (medians): the
client, HTTP and the gateway's parsing until the gateway's span, the gateway until the
broker's queue, the queue, the way to the worker, the wait there for the step running to
end, the prefill (what the join ran of it: all, or its first chunk), its other chunks
until the step that sends the first token, and the way back to the client.

The `openai` client (AsyncOpenAI; ``--client raw``: a bare HTTP/1.1 client, which
leaves the openai client's own time out) keeps C streams open, each sending its next
request when one ends; prompts of 16-128 tokens, ``max_tokens`` uniform in 16-256
(WORKLOADS' generation load). The client shares the host's cores with the server.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import random
import secrets
import shutil
import statistics
import subprocess
import tarfile
import time
from pathlib import Path
from typing import Any, AsyncIterator

from tests.conftest import Server, short_tmpdir
from tests.lm import prompt_ids, write_lm


def budgets_of(spec: str) -> list[tuple[int, float]]:
    """``512,32,512:2``: (prefill_tokens, step_ratio) each, 0 where not given."""
    return [(int(t or 0), float(r or 0)) for t, _, r in
            (b.partition(":") for b in spec.split(",") if b)]


def budget_label(tokens: int, ratio: float) -> str:
    return f"prefill_tokens {tokens or 'default'}" + (f", step_ratio {ratio:g}" if ratio else "")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def prefill_s(folder: Any, prompts: list[list[int]], device: str = "cpu") -> float:
    """The median time of one forward of a prompt, in-process, one thread, on ``device``
    (the served worker's own, for a baseline of the same hardware)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(str(folder)).to(device).eval()
    cuda = device.startswith("cuda")
    times = []
    with torch.inference_mode():
        model(torch.tensor([prompts[0]], device=device))
        for ids in prompts:
            t = time.perf_counter()
            # the prompt's copy to the device counts: a worker's prefill makes it too
            model(torch.tensor([ids], device=device))
            if cuda:   # the forward's kernels, inside the time
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def decode_s(folder: Any, prompts: list[list[int]], steps: int = 40) -> float:
    """The median time of one batched decode step of ``len(prompts)`` sequences through
    the served step code (models/causal_lm.py), in-process, one thread."""
    import torch
    from transformers import AutoModelForCausalLM

    from zeroserve.models.causal_lm import CausalLMSteps

    torch.set_num_threads(1)
    lm = CausalLMSteps(AutoModelForCausalLM.from_pretrained(str(folder)).eval())
    times = []
    with torch.inference_mode():
        states = {i: lm.join(i, {"input_ids": torch.tensor(ids),
                                 "max_tokens": torch.tensor([steps + 1])})
                  for i, ids in enumerate(prompts)}
        for _ in range(steps):
            lm.step(states)
            t = time.perf_counter()
            lm.advance(states)
            times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


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


class RawSSE:
    """A bare HTTP/1.1 client of the completions route on one kept-alive connection: the
    request's bytes, then each event's text as it is read (the body is chunked). What
    the `openai` client adds (its models, httpx) is not in its times."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def texts(self, ids: list[int], m: int, headers: dict[str, str]
                    ) -> AsyncIterator[str]:
        if self.conn is None:
            self.conn = await asyncio.open_connection("127.0.0.1", self.port)
        reader, writer = self.conn
        body = json.dumps({"model": "lm", "prompt": ids, "max_tokens": m,
                           "stream": True}).encode()
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: "
                     f"application/json\r\nContent-Length: {len(body)}\r\n{head}\r\n"
                     .encode() + body)
        status = await reader.readline()
        assert b" 200 " in status, status
        while (await reader.readline()) != b"\r\n":   # the headers: chunked, kept alive
            pass
        pending = b""
        while True:
            size = int((await reader.readline()).strip(), 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                return
            pending += chunk[:-2]
            *events, pending = pending.split(b"\n\n")
            for event in events:
                data = event.removeprefix(b"data: ")
                if data != b"[DONE]":
                    choices = json.loads(data).get("choices") or [{}]
                    yield choices[0].get("text") or ""

    def close(self) -> None:
        if self.conn is not None:
            self.conn[1].close()


def serve(repo: Path, asks: list[tuple[list[int], int]], concurrency: int,
          env: dict[str, str] | None, traced: dict[str, tuple[int, int]] | None = None,
          receiver_port: int = 0, raw: bool = False
          ) -> tuple[list[float], list[float], float]:
    """The requests over SSE, C at a time: times to the first token, gaps, wall. With
    ``traced`` each request is sent with a traceparent, its trace id mapped to the wall
    clock's ns of its send and of its first token. ``raw``: a bare HTTP client (RawSSE)
    instead of the `openai` one."""
    import openai

    extra = ["--log-level", "warning"]
    if traced is not None:
        from tests.otlp import traced_serve_flags   # the SDK, traced runs only
        extra += traced_serve_flags(receiver_port)
    srv = Server(repo, extra=extra, env=env).wait_ready(180)
    firsts: list[float] = []
    gaps: list[float] = []
    try:
        async def run() -> float:
            client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused",
                                        max_retries=0)
            todo = list(asks)

            async def by_openai(ids: list[int], m: int, headers: dict[str, str]
                                ) -> AsyncIterator[str]:
                stream = await client.completions.create(model="lm", prompt=ids,
                                                         max_tokens=m, stream=True,
                                                         extra_headers=headers)
                async for chunk in stream:
                    yield chunk.choices[0].text if chunk.choices else ""

            async def slot() -> None:
                bare = RawSSE(srv.port)
                try:
                    while todo:
                        ids, m = todo.pop()
                        headers, trace_id = {}, secrets.token_hex(16)
                        if traced is not None:
                            headers["traceparent"] = \
                                f"00-{trace_id}-{secrets.token_hex(8)}-01"
                        sent_ns = time.time_ns()
                        t0 = last = time.perf_counter()
                        texts = bare.texts(ids, m, headers) if raw else \
                            by_openai(ids, m, headers)
                        async for text in texts:
                            now = time.perf_counter()
                            if not text:
                                continue
                            if last == t0:
                                firsts.append(now - t0)
                                if traced is not None:
                                    traced[trace_id] = (sent_ns, time.time_ns())
                            else:
                                gaps.append(now - last)
                            last = now
                finally:
                    bare.close()
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


def breakdown(receiver: Any, traced: dict[str, tuple[int, int]]) -> list[tuple[str, float]]:
    """Where each traced request's time to its first token went, medians in ms."""
    legs: dict[str, list[float]] = {}
    for trace_id, (sent, first) in traced.items():
        got = {sp.name: sp for sp in receiver.of_trace(trace_id)}
        if not {"gateway", "queue", "sequence", "wait", "prefill", "steps"} <= got.keys():
            continue
        marks = [("client, HTTP and the gateway's parsing", got["gateway"].start_ns),
                 ("gateway to the broker's queue", got["queue"].start_ns),
                 ("broker queue", got["queue"].end_ns),
                 ("to the worker", got["sequence"].start_ns),
                 ("wait for the step running to end", got["wait"].end_ns),
                 ("prefill (at the join: all of it, or its first chunk)",
                  got["prefill"].end_ns),
                 ("its other chunks, to the first token sent", got["steps"].start_ns),
                 ("worker to the client (broker, gateway, SSE)", first)]
        at = sent
        for name, t in marks:
            legs.setdefault(name, []).append((t - at) / 1e6)
            at = t
        legs.setdefault("total", []).append((first - sent) / 1e6)
    return [(name, statistics.median(v)) for name, v in legs.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--before", help="a commit whose server is measured in turns with this one")
    ap.add_argument("--rounds", type=int, default=2, help="turns of each, with --before")
    ap.add_argument("--client", choices=("openai", "raw"), default="openai",
                    help="the `openai` client, or a bare HTTP/1.1 one (what the server "
                         "alone takes)")
    ap.add_argument("--prefill-tokens", default="",
                    help="comma-separated sequences.prefill_tokens, a run of this tree each "
                         "(default: the config's default)")
    ap.add_argument("--trace", action="store_true",
                    help="one more run, traced: where the time to the first token went")
    args = ap.parse_args()

    repo = short_tmpdir("zssse")
    folder, tokenizer = write_lm(repo, "lm", most=32, hidden=256, layers=4)
    config = json.loads((repo / "lm" / "config.json").read_text())
    config["text"] = {"task": "generate", "max_length": 512}
    (repo / "lm" / "config.json").write_text(json.dumps(config))
    rng = random.Random(5)
    asks = [(prompt_ids(tokenizer, i, rng.randint(16, 128)), rng.randint(16, 256))
            for i in range(args.requests)]
    budgets = budgets_of(args.prefill_tokens)
    ours: list[tuple[str, dict[str, str] | None, tuple[int, float]]] = \
        [(f"this tree, {budget_label(*b)}", None, b) for b in budgets] or \
        [("this tree", None, (0, 0.0))]
    runs = ours
    before = short_tmpdir("zsbefore")
    if args.before:
        runs = [(f"before {args.before}", tree_of(args.before, before), (0, 0.0)),
                *ours] * args.rounds
    rows = []

    def configure(budget: tuple[int, float]) -> None:
        tokens, ratio = budget
        sequences = {"max": config["sequences"]["max"],
                     **({"prefill_tokens": tokens} if tokens else {}),
                     **({"step_ratio": ratio} if ratio else {})}
        (repo / "lm" / "config.json").write_text(json.dumps({**config, "sequences": sequences}))
    try:
        for label, env, budget in runs:
            configure(budget)
            rows.append((label, *serve(repo, asks, args.concurrency, env,
                                       raw=args.client == "raw")))
        if args.trace:
            from tests.otlp import Receiver
            receiver, traced = Receiver(), dict[str, tuple[int, int]]()
            configure(budgets[-1] if budgets else (0, 0.0))
            try:
                rows.append((f"{ours[-1][0]}, traced", *serve(
                    repo, asks, args.concurrency, None, traced, receiver.port,
                    raw=args.client == "raw")))
                time.sleep(2)   # noqa: sleep-ok (the last spans' export, every 5 s at most)
                legs = breakdown(receiver, traced)
            finally:
                receiver.close()
        prefill = prefill_s(folder, [ids for ids, _ in asks[:24]])
        decode = decode_s(folder, [ids for ids, _ in asks[:args.concurrency]])
    finally:
        shutil.rmtree(repo, ignore_errors=True)
        shutil.rmtree(before, ignore_errors=True)
    print(f"C={args.concurrency}, {args.requests} requests over SSE a run ({args.client} "
          f"client, load average {os.getloadavg()[0]:.1f}); prefill "
          f"in-process {prefill * 1000:.1f} ms (goal: time to first token p50 <= prefill "
          f"+ 5 ms = {(prefill + 0.005) * 1000:.1f} ms); a decode step of "
          f"{args.concurrency} sequences in-process {decode * 1000:.1f} ms")
    for label, firsts, gaps, wall in rows:
        print(f"{label}: {wall:.1f} s; time to first token p50 {pct(firsts, .5) * 1000:.1f} "
              f"ms, p99 {pct(firsts, .99) * 1000:.1f} ms; gap between tokens p50 "
              f"{pct(gaps, .5) * 1000:.1f} ms, p99 {pct(gaps, .99) * 1000:.1f} ms "
              f"({pct(gaps, .99) / pct(gaps, .5):.1f}x; goal <= 2x)")
    if args.trace:
        print(f"the time to first token of {len(traced)} traced requests, medians of each leg:")
        for name, ms in legs:
            print(f"  {name}: {ms:.1f} ms")


if __name__ == "__main__":
    main()
