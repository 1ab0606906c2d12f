"""gateway/leaving.py: requests that wait long enough watch for their client to leave,
one timer for all of them; a disconnect cancels the request's task."""

from __future__ import annotations

import asyncio
from typing import Any

from zeroserve.gateway.leaving import Leaving

AFTER_S = 0.02
BOUND_S = 10.0   # every wait below is for a condition, bounded by this


class Client:
    """An ASGI receive: counts its calls; each waits for what the test lets it say."""

    def __init__(self) -> None:
        self.calls = 0
        self.called = asyncio.Event()
        self.says: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()

    async def receive(self) -> dict[str, Any]:
        self.calls += 1
        self.called.set()
        return await self.says


async def parked() -> None:
    await asyncio.get_running_loop().create_future()


def test_an_answer_in_time_never_watches() -> None:
    async def go() -> tuple[int, int]:
        leaving, client = Leaving(AFTER_S), Client()
        task = asyncio.ensure_future(parked())
        entry = leaving.add(task, client.receive)
        leaving.remove(entry)   # answered at once
        later = Leaving(AFTER_S)   # a second one, left waiting, shows the time has come
        other = Client()
        later.add(task, other.receive)
        await asyncio.wait_for(other.called.wait(), BOUND_S)
        task.cancel()
        return client.calls, len(leaving)
    assert asyncio.run(go()) == (0, 0)


def test_a_client_that_leaves_cancels_its_request() -> None:
    async def go() -> tuple[bool, bool, int]:
        leaving, client = Leaving(AFTER_S), Client()
        task = asyncio.ensure_future(parked())
        entry = leaving.add(task, client.receive)
        await asyncio.wait_for(client.called.wait(), BOUND_S)
        client.says.set_result({"type": "http.disconnect"})
        try:
            await asyncio.wait_for(task, BOUND_S)
        except asyncio.CancelledError:
            pass
        leaving.remove(entry)
        return entry.gone, task.cancelled(), len(leaving)
    assert asyncio.run(go()) == (True, True, 0)


def test_every_request_waiting_long_enough_watches_once_and_stops_when_answered() -> None:
    async def go() -> tuple[list[int], int, bool]:
        leaving = Leaving(AFTER_S)
        task = asyncio.ensure_future(parked())
        clients = [Client() for _ in range(50)]
        entries = [leaving.add(task, c.receive) for c in clients]
        await asyncio.wait_for(asyncio.gather(*(c.called.wait() for c in clients)), BOUND_S)
        watchers = [e.watcher for e in entries]
        for e in entries:
            leaving.remove(e)
        await asyncio.sleep(0)   # the cancelled watchers finish  # noqa: sleep-ok - one turn
        task.cancel()
        return [c.calls for c in clients], len(leaving), all(
            w is not None and w.cancelled() for w in watchers)
    calls, left, cancelled = asyncio.run(go())
    assert calls == [1] * 50 and left == 0 and cancelled
