"""VIP first, served for real: a save_pretrained GPT-2 with 16 sequence slots, 16 streams
of the default priority fill them, and a request of priority 1 arrives. One running
stream pauses (its cache kept aside on the worker) and the VIP joins at the next step:
its first token comes within two steps of its arrival, counted in the tokens the other
streams got meanwhile; the paused stream resumes once the VIP ends, and every stream's
tokens equal ``model.generate(do_sample=False)`` in-process (as its unpaused run); the
broker's gauges and counters say what happened, and it holds nothing after."""

from __future__ import annotations

import asyncio
import re
import shutil
from typing import Any, Iterator

import numpy as np
import pytest

from zeroserve.broker.client import AsyncClient, Client
from tests.conftest import Server, short_tmpdir, wait_for
from tests.lm import prompt_ids, write_lm
from tests.models.test_causal_lm import same_as_generate

pytestmark = pytest.mark.timeout(400)

SLOTS = 16


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Server, Any, Any]]:
    repo = short_tmpdir("zsvip")
    # a step of some milliseconds (hidden 256, 4 layers: WORKLOADS' lm), so that the client
    # reads each step's tokens before the next one comes and its log counts steps
    folder, tokenizer = write_lm(repo, most=SLOTS, hidden=256, layers=4, dynamic_batching={
        "priority_levels": 2, "default_priority": 2})
    srv = Server(repo, workers=1).wait_ready(180)
    yield srv, folder, tokenizer
    srv.stop()
    shutil.rmtree(repo, ignore_errors=True)


def metric(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    found = re.search(rf"^{name}\{{{re.escape(want)}\}} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def test_a_vip_takes_a_slot_within_two_steps_and_the_paused_stream_ends_the_same(
        served: tuple[Server, Any, Any]) -> None:
    srv, folder, tokenizer = served
    # the lows outlast the VIP, so the paused one waits for the VIP's end (100 steps):
    # a pause of a few heartbeats (0.5 s), which the worker's gauge must show; with
    # shorter lows a slot freed after ~44 steps and the pause could fall between two
    lows = [(prompt_ids(tokenizer, i, 8 + 9 * i), 160) for i in range(SLOTS)]
    vip_ids = prompt_ids(tokenizer, 40, 12)
    log: list[tuple[str, int]] = []   # every token as the client got it, in order
    scraped: dict[str, str] = {}

    async def run() -> dict[str, list[int]]:
        async with AsyncClient(srv.frontend) as c:
            await c.wait_connected(5)

            async def one(rid: str, ids: list[int], m: int, priority: int = 0) -> list[int]:
                x = {"input_ids": np.array([ids], np.int64),
                     "max_tokens": np.array([[m]], np.int32)}
                got = []
                async for r in c.stream("lm", x, priority=priority):
                    if "token_id" in r.outputs:
                        got.append(int(r.outputs["token_id"].reshape(-1)[0]))
                        log.append((rid, got[-1]))
                return got
            tasks = {f"low{i}": asyncio.create_task(one(f"low{i}", ids, m))
                     for i, (ids, m) in enumerate(lows)}
            while sum(1 for rid, _ in log if rid.startswith("low")) < SLOTS * 4:
                await asyncio.sleep(0.005)   # noqa: sleep-ok (polls the log: every slot runs)
            log.append(("vip sent", -1))
            tasks["vip"] = asyncio.create_task(one("vip", vip_ids, 100, priority=1))
            while not any(rid == "vip" for rid, _ in log):
                await asyncio.sleep(0.002)   # noqa: sleep-ok (polls the log)
            scraped["during"] = await asyncio.to_thread(paused_seen, srv)
            return {rid: await t for rid, t in tasks.items()}
    got = asyncio.run(run())
    sent = log.index(("vip sent", -1))
    first = next(i for i, (rid, _) in enumerate(log) if rid == "vip")
    between: dict[str, int] = {}
    for rid, _ in log[sent + 1:first]:
        between[rid] = between.get(rid, 0) + 1
    # the steps run while the VIP waited: at most the one running when it came, and the
    # one it joined at the boundary after (whose token is its first)
    assert max(between.values(), default=0) <= 2, between
    assert len(got["vip"]) == 100
    requests = {**{f"low{i}": r for i, r in enumerate(lows)}, "vip": (vip_ids, 100)}
    notes = [note for rid, (ids, m) in requests.items()
             if (note := same_as_generate(folder, ids, m, got[rid]))]
    assert len(notes) <= 2, notes   # a near-tie may flip in float32 batches, and is named
    during = scraped["during"]   # the worker's gauges while the VIP ran
    assert metric(during, "zeroserve_worker_sequences", model="lm") == SLOTS
    assert metric(scrape(srv), "zeroserve_preemptions_total", model="lm",
                  tenant="anonymous") == 1
    wait_for(lambda: metric(scrape(srv, worker=True), "zeroserve_worker_sequences_paused",
                            model="lm") == 0, 10, "the worker to say none is paused")

    def empty() -> bool:
        with Client(srv.control, timeout_s=5) as c:
            return not any(c.control("census").values())
    wait_for(empty, 10, "the broker to hold nothing")


def paused_seen(srv: Server) -> str:
    """The worker's metrics once they say one sequence is paused (its heartbeat carries
    them, every 0.5 s)."""
    seen: list[str] = []

    def one_paused() -> bool:
        seen.append(scrape(srv, worker=True))
        return metric(seen[-1], "zeroserve_worker_sequences_paused", model="lm") == 1
    wait_for(one_paused, 5, "the worker to say one sequence is paused")
    return seen[-1]


def scrape(srv: Server, worker: bool = False) -> str:
    """The broker's metrics text, or its one worker's."""
    with Client(srv.control, timeout_s=5) as c:
        got = c.control("metrics")
    return str(next(iter(got["workers"].values())) if worker else got["broker"])
