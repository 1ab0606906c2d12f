"""Iterative models served for real (continuous batching): ``zeroserve serve`` with a
counter whose worker runs its steps, one step every 20 ms. A request that arrives while
others run joins at the next step boundary instead of waiting for the longest stream;
no more sequences run at once than the config allows; a cancel frees its slot at the
next step (the worker's gauge says so); a worker SIGKILLed under 32 streams ends each
of them once, and the broker holds nothing after."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from zeroserve.broker.client import AsyncClient, Client, InferError
from tests.conftest import Server, linear_config, short_tmpdir, wait_for

pytestmark = pytest.mark.timeout(300)

# each output row: [this sequence's count, the handler's step number, sequences in it]
COUNTER = '''
import time

import torch


class Model:
    def load(self, version_dir, device):
        self.steps = 0

    def join(self, seq_id, inputs):
        x = inputs["input"]
        return {"left": int(x[0, 0]), "sent": 0}

    def step(self, states):
        time.sleep(0.02)  # noqa: sleep-ok (a step of the model under test takes 20 ms)
        self.steps += 1
        out = {}
        for seq_id, st in states.items():
            st["sent"] += 1
            row = torch.tensor([[st["sent"], self.steps, len(states)]], dtype=torch.float32)
            out[seq_id] = ({"output": row}, st["sent"] >= st["left"])
        return out
'''
MOST = 4


def counter_config() -> dict[str, Any]:
    return {**linear_config("counter", mbs=8), "platform": "python",
            "sequences": {"max": MOST}, "dynamic_batching": {"max_execution_ms": 5000}}


def make_repo() -> Path:
    repo = short_tmpdir("zsrepo")
    (repo / "counter" / "1").mkdir(parents=True)
    (repo / "counter" / "1" / "model.py").write_text(COUNTER)
    (repo / "counter" / "config.json").write_text(json.dumps(counter_config()))
    return repo


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    repo = make_repo()
    srv = Server(repo, workers=1).wait_ready(120)
    yield srv
    srv.stop()
    shutil.rmtree(repo, ignore_errors=True)


def count(n: int) -> dict[str, np.ndarray]:
    return {"input": np.array([[n, 0, 0, 0]], np.float32)}


def rows(responses: list[Any]) -> list[list[float]]:
    return [r.outputs["output"].reshape(-1).tolist() for r in responses]


def control(srv: Server, verb: str) -> Any:
    with Client(srv.control, timeout_s=5) as c:
        return c.control(verb)


def empty(srv: Server) -> bool:
    return not any(control(srv, "census").values())


def running_gauge(srv: Server) -> float | None:
    """The worker's zeroserve_worker_sequences for counter, as its last heartbeat said."""
    texts = control(srv, "metrics")["workers"].values()
    found = [float(m) for t in texts for m in re.findall(
        r'zeroserve_worker_sequences{model="counter"} ([0-9.e+]+)', t)]
    return found[0] if found else None


def test_a_request_joins_the_running_sequences_at_the_next_step(server: Server) -> None:
    async def run() -> tuple[list[Any], list[Any], float]:
        async with AsyncClient(server.frontend) as c:
            await c.wait_connected(5)
            long: list[Any] = []
            short: list[Any] = []
            seen = asyncio.Event()
            when: list[float] = []

            async def long_one() -> None:
                async for r in c.stream("counter", count(60)):
                    long.append(r)
                    if len(long) == 5:
                        when.append(r.outputs["output"].reshape(-1)[1])
                        seen.set()

            async def short_one() -> None:
                await seen.wait()
                async for r in c.stream("counter", count(3)):
                    short.append(r)
            await asyncio.gather(long_one(), short_one())
            return long, short, when[0]
    long, short, step_seen = asyncio.run(run())
    assert [r[0] for r in rows(long)] == list(range(1, 61))
    assert [r[0] for r in rows(short)] == [1, 2, 3] and short[-1].final
    first_step = rows(short)[0][1]
    # sent when the long stream's step k reached the client: step k + 1 was running, so
    # it joined at the boundary after it and answered from step k + 2
    assert step_seen < first_step <= step_seen + 2, (step_seen, first_step)
    assert rows(short)[0][2] == 2   # it ran beside the long one, not after it
    assert rows(short)[-1][1] < rows(long)[-1][1]   # and ended long before it
    wait_for(lambda: empty(server), 10, "the broker to hold nothing")


def test_no_more_sequences_run_than_the_config_allows(server: Server) -> None:
    async def run() -> list[list[Any]]:
        async with AsyncClient(server.frontend) as c:
            await c.wait_connected(5)

            async def one(n: int) -> list[Any]:
                return [r async for r in c.stream("counter", count(n))]
            return await asyncio.gather(*(one(3 + i % 5) for i in range(12)))
    streams = asyncio.run(run())
    for i, got in enumerate(streams):
        assert [r[0] for r in rows(got)] == list(range(1, 3 + i % 5 + 1))
        assert [r.final for r in got] == [False] * (len(got) - 1) + [True]
    assert max(r[2] for got in streams for r in rows(got)) == MOST
    wait_for(lambda: empty(server), 10, "the broker to hold nothing")


def test_a_cancel_frees_the_slot_at_the_next_step(server: Server) -> None:
    with Client(server.frontend, timeout_s=30) as c:
        streams = [c.stream("counter", count(5000)) for _ in range(MOST)]
        firsts = [next(iter(s)) for s in streams]
        assert [r.index for r in firsts] == [0] * MOST, [(r.index, r.outputs) for r in firsts]
        wait_for(lambda: running_gauge(server) == MOST, 10, "the gauge to show every slot")
        for s in streams:
            s.close()   # cancels at the broker, which stops the sequence at the worker
        wait_for(lambda: running_gauge(server) == 0, 10, "the gauge to show the slots free")
        # every slot free: a new request runs at once, alone
        got = list(c.stream("counter", count(2)))
    assert [r[2] for r in rows(got)] == [1, 1]
    wait_for(lambda: empty(server), 10, "the broker to hold nothing")


def test_a_first_response_deadline_ends_a_request_that_waits_for_a_slot(server: Server) -> None:
    with Client(server.frontend, timeout_s=30) as c:
        streams = [c.stream("counter", count(5000)) for _ in range(MOST)]
        for s in streams:
            next(iter(s))
        with pytest.raises(InferError) as err:
            list(c.stream("counter", count(2), timeout_ms=200))
        for s in streams:
            s.close()
    assert err.value.code.value == "deadline"
    wait_for(lambda: empty(server), 10, "the broker to hold nothing")


def test_a_worker_killed_under_32_streams_ends_each_once() -> None:
    repo = make_repo()
    cfg = {**counter_config(), "sequences": {"max": 32}}
    (repo / "counter" / "config.json").write_text(json.dumps(cfg))
    srv = Server(repo, workers=1).wait_ready(120)
    try:
        async def run() -> list[tuple[list[int], str | None]]:
            async with AsyncClient(srv.frontend) as c:
                await c.wait_connected(5)
                started = asyncio.Event()
                going = [0]

                async def one() -> tuple[list[int], str | None]:
                    got: list[int] = []
                    try:
                        async for r in c.stream("counter", count(1000)):
                            got.append(r.index)
                            if r.index == 0:
                                going[0] += 1
                                if going[0] == 32:
                                    started.set()
                    except InferError as exc:
                        return got, exc.code.value
                    return got, None

                async def kill() -> None:
                    await asyncio.wait_for(started.wait(), 60)
                    [pid] = srv.pids("worker")
                    os.kill(pid, signal.SIGKILL)
                tasks = [asyncio.ensure_future(one()) for _ in range(32)]
                await kill()
                return list(await asyncio.wait_for(asyncio.gather(*tasks), 60))
        ended = asyncio.run(run())
        for got, code in ended:
            assert code == "worker_lost", (code, len(got))   # one error each, after its parts
            assert got == list(range(len(got))) and got   # in order, none repeated
        wait_for(lambda: not any(control(srv, "census").values()), 20,
                 "the broker to hold nothing")
    finally:
        srv.stop()
        shutil.rmtree(repo, ignore_errors=True)
