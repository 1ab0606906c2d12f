"""Streams under load while workers die: 2 workers serve the ticker stream model to 24
concurrent streams; one worker is SIGKILLed twice mid-stream. Every stream ends (its
final response, or a retryable error), its responses come in order without a gap or a
repeat, the broker answers each request exactly once (its own count), its pid never
changes, and once everything is answered it holds nothing of any request."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import time
from typing import Any, Iterator

import numpy as np
import pytest

from zeroserve.broker.client import AsyncClient, Client, InferError
from tests.conftest import Server, short_tmpdir, wait_for
from tests.e2e.test_streams import TICKER, settled, ticker_config

pytestmark = pytest.mark.timeout(300)

STREAMS = 24
TICKS = 15   # about 0.3 s a stream


@pytest.fixture
def server() -> Iterator[Server]:
    repo = short_tmpdir("zsrepo")
    (repo / "ticker" / "1").mkdir(parents=True)
    (repo / "ticker" / "1" / "model.py").write_text(TICKER)
    (repo / "ticker" / "config.json").write_text(json.dumps(ticker_config()))
    srv = Server(repo, workers=2).wait_ready(120)
    wait_for(lambda: len(holders(srv)) == 2, 60, "both workers")
    yield srv
    srv.stop()
    shutil.rmtree(repo, ignore_errors=True)


def holders(srv: Server) -> list[dict[str, Any]]:
    with Client(srv.control, timeout_s=5) as c:
        return [w for w in c.control("status")["workers"] if w["models"]]


def answered_by_broker(srv: Server) -> int:
    with Client(srv.control, timeout_s=5) as c:
        text = c.control("metrics")["broker"]
    return int(sum(float(v) for v in re.findall(
        r'zeroserve_inference_requests_total{model="ticker",status="[a-z_]+"} ([0-9.e+]+)',
        text)))


class Load:
    def __init__(self) -> None:
        self.sent = 0
        self.completed = 0
        # counted, with the text of the first few and of any that may not be retried: a
        # server failing every stream at once must not fill this process's memory
        self.errors = 0
        self.first_errors: list[str] = []
        self.not_retryable: list[str] = []
        self.broken: list[str] = []   # order violations
        self.stop = False

    async def one(self, c: AsyncClient) -> None:
        self.sent += 1
        indices = []
        try:
            async for r in c.stream("ticker", {"input": np.full((1, 4), TICKS, np.float32)},
                                    timeout_ms=10000):
                indices.append(r.index)
                if r.final:
                    break
            if indices != list(range(TICKS)):
                self.broken.append(f"completed with {indices}")
            self.completed += 1
        except InferError as exc:
            if indices != list(range(len(indices))):
                self.broken.append(f"failed after {indices}")
            self.errors += 1
            if len(self.first_errors) < 5:
                self.first_errors.append(str(exc))
            if not exc.retryable and len(self.not_retryable) < 5:
                self.not_retryable.append(str(exc))
            # a stream cut by a kill is sent again after a pause, as a client backs off; a
            # broker that fails every stream at once is then not asked 10,000 times a second
            await asyncio.sleep(0.005)  # noqa: sleep-ok - the retry's backoff

    async def run(self, frontend: str) -> None:
        async with AsyncClient(frontend) as c:
            await c.wait_connected(5)

            async def loop() -> None:
                while not self.stop:
                    await self.one(c)
            await asyncio.gather(*(loop() for _ in range(STREAMS)))


def test_sigkill_of_a_worker_during_streams_ends_every_stream_once(server: Server) -> None:
    broker_pid = server.pids("broker")
    load = Load()

    async def chaos() -> None:
        task = asyncio.ensure_future(load.run(server.frontend))
        loop = asyncio.get_running_loop()
        for _ in range(2):
            await asyncio.sleep(1.0)  # noqa: sleep-ok (load runs meanwhile)
            victim = (await loop.run_in_executor(None, holders, server))[0]["pid"]
            os.kill(victim, signal.SIGKILL)
            await loop.run_in_executor(None, lambda: wait_for(
                lambda: sorted(w["pid"] != victim for w in holders(server)) == [True, True],
                60, "the worker to be back"))
        await asyncio.sleep(0.5)  # noqa: sleep-ok (load runs on the restored pair)
        load.stop = True
        await asyncio.wait_for(task, 60)   # every stream ended: none hangs

    start = time.monotonic()
    asyncio.run(chaos())
    assert not load.broken, load.broken[:5]
    assert load.completed + load.errors == load.sent
    assert not load.not_retryable, load.not_retryable
    assert load.errors, "no stream was cut: the kills missed the load"
    assert load.completed > load.errors, (load.completed, load.errors, load.first_errors)
    assert server.pids("broker") == broker_pid
    wait_for(lambda: answered_by_broker(server) == load.sent, 10,
             f"the broker to count {load.sent} answers")
    wait_for(lambda: settled(server), 10, "the broker to hold nothing")
    assert answered_by_broker(server) == load.sent   # and never more
    assert time.monotonic() - start < 120
