"""AsyncClient against a stand-in broker made of a real ROUTER socket."""

from __future__ import annotations

import asyncio
import shutil

import numpy as np
import pytest
import zmq
import zmq.asyncio

from zeroserve.broker import protocol as p
from zeroserve.broker.client import AsyncClient, InferError
from tests.conftest import short_tmpdir

pytestmark = pytest.mark.timeout(30)


async def _router(ctx, endpoint):
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    return sock


async def _stand_in(sock, got_request=None):
    """Answer pings; note a request's arrival and leave it unanswered."""
    while True:
        frames = await sock.recv_multipart()
        kind = p.unpack(frames[1:])[0]
        if kind is p.Kind.PING:
            await sock.send_multipart([frames[0], *p.encode(p.Pong())])
        elif kind is p.Kind.REQUEST and got_request is not None:
            got_request.set()


async def _stop(task):
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def _run(go):
    """Run ``go(endpoint)`` with an ipc endpoint in a folder of its own, then remove it."""
    folder = short_tmpdir("zscl")
    try:
        asyncio.run(go(f"ipc://{folder}/frontend"))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_a_request_held_by_a_broker_that_restarts_at_once_fails_retryably():
    async def go(endpoint):
        ctx = zmq.asyncio.Context()
        old = await _router(ctx, endpoint)
        client = AsyncClient(endpoint, broker_timeout_s=30.0)
        await client.start()
        got_request = asyncio.Event()
        tasks = [asyncio.ensure_future(_stand_in(old, got_request))]
        new = None
        try:
            assert await client.wait_connected(5)
            call = asyncio.ensure_future(client.infer("m", {"x": np.zeros(2, np.float32)}))
            await asyncio.wait_for(got_request.wait(), 10)
            await _stop(tasks.pop())
            old.close(linger=0)  # the broker dies holding the request ...
            new = await _router(ctx, endpoint)  # ... and its successor is up at once
            tasks.append(asyncio.ensure_future(_stand_in(new)))
            # broker_timeout_s is 30 s: only the dropped connection can end the wait
            with pytest.raises(InferError) as err:
                await asyncio.wait_for(call, 10)
            assert err.value.code is p.ErrorCode.UNAVAILABLE and err.value.retryable
        finally:
            for task in tasks:
                await _stop(task)
            await client.close()
            for sock in (old, new):
                if sock is not None and not sock.closed:
                    sock.close(linger=0)
            ctx.term()

    _run(go)


def test_a_loop_turn_sends_its_requests_every_flush_at_as_it_makes_them():
    """70 requests made in one turn leave as 1, 32, 32 and 5: the first at once, alone
    in flight (holding it to the turn's end cost a direct C=1 call a turn of the loop),
    the next 64 while the turn goes on, the rest at its end (a turn that held everything
    back left the broker idle meanwhile)."""
    from zeroserve.broker.client import FLUSH_AT

    n = 2 * FLUSH_AT + 6

    async def go(endpoint):
        ctx = zmq.asyncio.Context()
        sock = await _router(ctx, endpoint)
        client = AsyncClient(endpoint, broker_timeout_s=30.0)
        await client.start()
        sizes: list[int] = []
        reader = asyncio.ensure_future(_pongs_then_bundles(sock, sizes, n))
        try:
            assert await client.wait_connected(5)
            x = {"x": np.zeros(2, np.float32)}
            calls = [asyncio.ensure_future(client.infer("m", x)) for _ in range(n)]
            await asyncio.wait_for(reader, 10)
            assert sizes == [1, FLUSH_AT, FLUSH_AT, 5], sizes
            for call in calls:
                call.cancel()
            await asyncio.gather(*calls, return_exceptions=True)
        finally:
            await _stop(reader)
            await client.close()
            sock.close(linger=0)
            ctx.term()

    _run(go)


async def _pongs_then_bundles(sock, sizes, n):
    """Answer pings (as a version-2 broker); record how many requests each message
    holds until ``n`` have come."""
    while sum(sizes) < n:
        frames = await sock.recv_multipart()
        kind, header, _ = p.unpack(frames[1:])
        if kind is p.Kind.PING:
            await sock.send_multipart([frames[0], *p.encode(p.Pong())])
        elif kind is p.Kind.REQUESTS:
            sizes.append(len(header["requests"]))
        elif kind is p.Kind.REQUEST:
            sizes.append(1)
