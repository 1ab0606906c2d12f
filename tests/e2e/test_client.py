"""The direct client across a broker restart: requests in flight fail at once with a
retryable error (never hang), and the same client serves again once the broker is back."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

from tests.conftest import Server, short_tmpdir, wait_for
from tests.e2e.load import spin_input, write_spin_model
from zeroserve.broker.client import AsyncClient, Client, ErrorCode, InferError

pytestmark = pytest.mark.timeout(120)


def serving(srv: Server) -> bool:
    try:
        with Client(srv.control, timeout_s=2) as c:
            return bool(c.control("models")["models"]["spin"]["ready"])
    except InferError:
        return False


def test_clients_survive_a_broker_restart(serve) -> None:  # type: ignore[no-untyped-def]
    repo = short_tmpdir("zsrepo")
    write_spin_model(repo)
    srv = serve(repo)
    wait_for(lambda: serving(srv), 30, "the model")
    sync_outcome: list[object] = []
    sync = Client(srv.frontend, timeout_s=60)

    def sync_call() -> None:
        try:
            sync.infer("spin", {"input": spin_input(3000)})
            sync_outcome.append("ok")
        except InferError as exc:
            sync_outcome.append(exc)

    async def scenario() -> None:
        async with AsyncClient(srv.frontend) as ac:
            assert await ac.wait_connected(5)
            pending = [asyncio.ensure_future(ac.infer("spin", {"input": spin_input(3000)}))
                       for _ in range(3)]
            t = threading.Thread(target=sync_call)
            t.start()

            def running() -> bool:
                with Client(srv.control, timeout_s=2) as c:
                    st = c.control("status")
                return st["inflight_batches"] >= 2 and st["queues"]["spin"] >= 1
            await asyncio.to_thread(wait_for, running, 20, "requests in flight")
            os.kill(srv.pids("broker")[0], signal.SIGKILL)
            start = time.monotonic()
            results = await asyncio.wait_for(
                asyncio.gather(*pending, return_exceptions=True), 10)
            await asyncio.to_thread(t.join, 10)
            assert time.monotonic() - start < 10 and not t.is_alive(), "a request hung"
            for err in [*results, *sync_outcome]:
                assert isinstance(err, InferError), err
                assert err.code is ErrorCode.UNAVAILABLE and err.retryable
            # the supervisor restarts the broker; the worker and the clients reconnect
            await asyncio.to_thread(wait_for, lambda: serving(srv), 30, "the new broker")
            assert await ac.wait_connected(5)
            got = await ac.infer("spin", {"input": spin_input(1)})
            assert got.outputs["output"].shape == (1, 4)

    try:
        asyncio.run(scenario())
        assert sync.infer("spin", {"input": spin_input(1)}).outputs["output"].shape == (1, 4)
    finally:
        sync.close()
