"""A save_pretrained GPT-2 served as it is (platform transformers with sequences): 24
concurrent streams of mixed prompt lengths (4-200 tokens) and max_tokens (1-48), and 64
of max_tokens 1-128 (slow), and 24 again with prompts prefilled 32 tokens a step (chunked
prefill: longer prompts join the running ones in chunks, as forwards of their own or
inside the decode's), through
``zeroserve serve`` and the direct client, each stream's tokens equal to
``model.generate(do_sample=False)`` in-process (a flip where the in-process top two logits
lie within 1e-4 is allowed and named), and nothing of any request left after."""

from __future__ import annotations

import asyncio
import json
import random
import shutil
from typing import Any, Iterator

import numpy as np
import pytest

from zeroserve.broker.client import AsyncClient, Client
from tests.conftest import Server, short_tmpdir, wait_for
from tests.lm import greedy, prompt_ids, write_lm
from tests.models.test_causal_lm import same_as_generate

pytestmark = pytest.mark.timeout(400)


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Server, Any, Any]]:
    repo = short_tmpdir("zsrepo")
    folder, tokenizer = write_lm(repo, most=8)
    srv = Server(repo, workers=1).wait_ready(180)
    yield srv, folder, tokenizer
    srv.stop()
    shutil.rmtree(repo, ignore_errors=True)


@pytest.mark.parametrize("streams, most_tokens", [
    (24, 48), pytest.param(64, 128, marks=[pytest.mark.slow, pytest.mark.timeout(900)])],
    ids=["24x48", "64x128"])
def test_concurrent_streams_of_mixed_lengths_equal_generate(
        served: tuple[Server, Any, Any], streams: int, most_tokens: int) -> None:
    """24 streams of up to 48 tokens in the e2e layer; the issue's 64 of up to 128 in the
    slow one (270 s on two cores shared with other work, load average 9, of which 130 s
    of CPU: the server's steps and 64 in-process generate() calls)."""
    run_streams(*served, streams, most_tokens)


@pytest.mark.parametrize("step_ratio", [None, 2.0], ids=["own-forwards", "in-the-decode"])
def test_prompts_prefilled_in_chunks_equal_generate(step_ratio: float | None) -> None:
    """sequences.prefill_tokens 32: most of the prompts take several steps to prefill,
    joining streams that run, as forwards of their own or (step_ratio) inside the running
    streams' decode; each stream still equals generate()."""
    repo = short_tmpdir("zsrepo")
    try:
        folder, tokenizer = write_lm(repo, most=8)
        config = json.loads((repo / "lm" / "config.json").read_text())
        config["sequences"]["prefill_tokens"] = 32
        if step_ratio is not None:
            config["sequences"]["step_ratio"] = step_ratio
        (repo / "lm" / "config.json").write_text(json.dumps(config))
        srv = Server(repo, workers=1).wait_ready(180)
        try:
            run_streams(srv, folder, tokenizer, 24, 24)
        finally:
            srv.stop()
    finally:
        shutil.rmtree(repo, ignore_errors=True)


def run_streams(srv: Server, folder: Any, tokenizer: Any, streams: int,
                most_tokens: int) -> None:
    """``streams`` at once through the direct client, prompts of 4-200 tokens and
    max_tokens 1-``most_tokens``: each equals generate(), and the broker holds nothing
    after."""
    rng = random.Random(43)
    plan = [(rng.randint(4, 200), rng.randint(1, most_tokens)) for _ in range(streams)]
    prompts = [prompt_ids(tokenizer, i, n) for i, (n, _) in enumerate(plan)]

    async def run() -> list[list[int]]:
        async with AsyncClient(srv.frontend) as c:
            await c.wait_connected(5)

            async def one(ids: list[int], m: int) -> list[int]:
                x = {"input_ids": np.array([ids], np.int64),
                     "max_tokens": np.array([[m]], np.int32)}
                return [int(r.outputs["token_id"].reshape(-1)[0])
                        async for r in c.stream("lm", x) if "token_id" in r.outputs]
            return await asyncio.gather(*(one(ids, m) for ids, (_, m) in zip(prompts, plan)))
    got = asyncio.run(run())
    notes = [note for ids, (_, m), tokens in zip(prompts, plan, got)
             if (note := same_as_generate(folder, ids, m, tokens))]
    assert len(notes) <= 2, notes   # a near-tie may flip in float32 batches, and is named
    want = [greedy(folder, ids, m)[0] for ids, (_, m) in zip(prompts, plan)]
    assert sum(g == w for g, w in zip(got, want)) >= len(plan) - len(notes)

    def empty() -> bool:
        with Client(srv.control, timeout_s=5) as c:
            return not any(c.control("census").values())
    wait_for(empty, 10, "the broker to hold nothing")
