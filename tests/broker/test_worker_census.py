"""What a lost worker leaves in the broker: workers that register, load, run a batch and
die (their connection closed without a word, as a SIGKILL leaves it), 100 of them, some
with a batch still in flight, some restarting under the id of the one before; a census
of every container the broker reaches (test_version_census's), by where it sits, before
and after. A structure kept per worker id grows by one each time and is found here.
Workers and the client are sockets of the test."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import zmq

from tests.broker.test_lifecycle import OPEN, FakeWorker
from tests.broker.test_version_census import Caller, expect, one_model_broker, stable_census
from tests.conftest import wait_for
from zeroserve.broker import protocol as p
from zeroserve.broker.server import metrics
from zeroserve.models.repository import version_sha256

pytestmark = pytest.mark.timeout(600)


@pytest.fixture
def world() -> Iterator[tuple[Any, Path, zmq.Context[Any]]]:
    with one_model_broker() as parts:
        yield parts


def answer(w: FakeWorker) -> None:
    header, bufs = expect(w, p.Kind.BATCH)
    batch = p.decode_batch(header, bufs)
    w.sock.send_multipart(p.encode_result(p.BatchResult(batch.batch_id, [
        p.InferReply(i.request_id, "m", 1, [p.from_numpy(
            "output", np.zeros((1, 3), np.float32))]) for i in batch.items], 1.0)))


def test_a_hundred_workers_killed_leave_nothing_behind(world, monkeypatch) -> None:
    b, repo, ctx = world
    # the metrics keep the series of the last WORKER_SERIES worker ids: fewer than the
    # ids this test goes through, so that it sees them bounded
    monkeypatch.setattr(metrics, "WORKER_SERIES", 16)
    sha = version_sha256(repo / "m" / "1")
    caller = Caller(ctx, b.endpoints.frontend)

    def cycle(i: int) -> None:
        # every third a restart under the id before (a supervisor's), else a new id (a
        # pod's); a new process is a new connection either way
        wid = f"host/{i - 1 if i % 3 == 0 else i}"
        w = FakeWorker(ctx, b.endpoints.backend, wid)
        w.loaded(w.expect(p.Kind.LOAD), sha=sha)
        wait_for(lambda: any(x.versions_of("m") for x in list(b.pool.workers.values())),
                 10.0, f"worker {wid} to hold the model")
        caller.send()
        if i % 2:
            answer(w)
            caller.reply()
        else:   # killed with the batch in flight
            expect(w, p.Kind.BATCH)
        OPEN.remove(w.sock)
        w.sock.close(linger=0)
        wait_for(lambda: not b.pool.workers, 10.0, f"worker {wid} to be found gone")
        if not i % 2:   # no other worker to retry it on: answered at once
            assert caller.sock.poll(10_000), "no answer within 10 s"
            kind, header, _ = p.unpack(caller.sock.recv_multipart())
            assert kind is p.Kind.ERROR and header["code"] == "worker_lost", header

    # past every window bounded by count (the latency model's 64 batches: one a cycle
    # of two); the breaker's is bounded by time (its last seconds of answers), not here
    for i in range(1, 141):
        cycle(i)
    before = stable_census(b)
    for i in range(141, 241):
        cycle(i)
    after = stable_census(b)
    grown = {k: (before.get(k, 0), n) for k, n in after.items() if n > before.get(k, 0)
             and not k.startswith("broker.front.intake.breakers._models[].events")}
    assert not grown, f"what 100 more lost workers left behind: {grown}"
