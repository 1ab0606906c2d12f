"""The worker's compute thread (workers/compute.py) in one process, with real sockets and
threads: a broker's ROUTER, the worker's channel, and the main thread's side played by
the test (what it routes, and a read of the socket at a chosen moment)."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import torch
import zmq
from prometheus_client import CollectorRegistry

from tests.conftest import linear_config, wait_for
from zeroserve.broker import protocol as p
from zeroserve.broker.process import RateLimitedLog
from zeroserve.models.loader import LoadedModel
from zeroserve.models.repository import parse_config
from zeroserve.workers.channel import BrokerChannel
from zeroserve.workers.compute import Compute
from zeroserve.workers.loaded import LoadedModels

pytestmark = pytest.mark.timeout(60)
STREAM_S = 10.0   # how long the stream runs unless the broker's STOP reaches it


class MainThread:
    """The main loop's side (workers/worker.py): what the compute thread routes to it,
    and, the moment the compute thread says it heard the broker (it has just read a
    batch), a read of the socket as the main thread makes while it reads meanwhile, on
    a thread of its own, with the STOP it reads handed to the compute thread."""

    def __init__(self, channel: BrokerChannel, compute: Compute) -> None:
        self.channel, self.compute = channel, compute
        self.routed: list[list[Any]] = []
        self.read_stop = threading.Event()

    def route(self, frames: list[Any]) -> bool:
        self.routed.append(frames)
        return True

    def heard(self, now: float) -> None:
        if self.read_stop.is_set():
            return
        reader = threading.Thread(target=self._read_stop, name="main")
        reader.start()
        # done at once, unless the compute thread holds the socket until its batch is
        # registered: then the read waits for that, and so does the STOP
        reader.join(1.0)

    def _read_stop(self) -> None:
        deadline = time.monotonic() + 5.0
        while not self.routed and time.monotonic() < deadline:
            if not self.channel.recv_into(self.route):
                time.sleep(0.001)  # noqa: sleep-ok (the STOP is on its way, behind the batch)
        kind, header, _ = p.unpack(self.routed.pop())
        assert kind is p.Kind.STOP
        self.compute.stop(p.decode(p.Stop, header))
        self.read_stop.set()


@pytest.fixture
def broker() -> Iterator[tuple[zmq.Context[Any], zmq.Socket[Any]]]:
    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind("inproc://broker")
    yield ctx, sock
    sock.close(linger=0)
    ctx.term()


def stream_model(closed: list[bool]) -> LoadedModel:
    """A decoupled model whose one stream runs STREAM_S unless it is stopped; ``closed``
    gets whether it was stopped first."""
    def predict(inputs: Any, rows: Any) -> Iterator[Any]:
        deadline = time.monotonic() + STREAM_S
        try:
            while time.monotonic() < deadline:
                yield {0: ({"output": torch.ones((1, 3))}, False)}
                time.sleep(0.005)  # noqa: sleep-ok (the stream's pace)
        finally:
            closed.append(time.monotonic() < deadline)
    cfg = parse_config({**linear_config("s"), "platform": "python",
                        "model_transaction_policy": {"decoupled": True}}, "test")
    return LoadedModel("s", 1, cfg, "0" * 64, predict, "cpu", handler=object(),
                       version_dir=Path("/nonexistent"))


def test_a_stop_read_by_the_main_thread_as_the_compute_thread_takes_its_batch_counts(
        broker: tuple[zmq.Context[Any], zmq.Socket[Any]]) -> None:
    """The compute thread reads a stream's batch while the main thread still reads the
    socket (its last look said a batch ran); the main thread reads the STOP right behind
    it before the compute thread has handled the batch. The STOP must stop the stream,
    not be taken for one of a batch already done."""
    ctx, router = broker
    closed: list[bool] = []
    models = LoadedModels()
    models.put(("s", 1), stream_model(closed))
    compute = Compute(models, "w/0", CollectorRegistry(), spans=None,
                      bad_log=RateLimitedLog(logging.getLogger(__name__)))
    channel = BrokerChannel(ctx, "inproc://broker", b"w0", None, lambda: None)
    channel.connect()
    main = MainThread(channel, compute)
    thread = None
    try:
        channel.send([b"hello"])
        assert router.poll(5000), "the worker's channel did not connect"
        identity = router.recv_multipart()[0]
        batch = p.Batch(7, "s", 1, [p.BatchItem(
            "0", [p.from_numpy("input", np.zeros((1, 4), np.float32))])])
        router.send_multipart([identity, *p.encode_batch(batch)])
        router.send_multipart([identity, *p.encode(p.Stop(7, ["0"]))])
        thread = compute.start(channel, main)
        wait_for(lambda: main.read_stop.is_set(), 10, "the main thread's read of the STOP")
        # the batch's RESULT: before its first step when the STOP is read first (the
        # generator never starts), else at the step after it; STREAM_S had it dropped
        ended = time.monotonic() + STREAM_S / 2
        while (left_ms := int((ended - time.monotonic()) * 1000)) > 0 and router.poll(left_ms):
            if p.unpack(router.recv_multipart()[1:])[0] is p.Kind.RESULT:
                break
        else:
            raise AssertionError("the STOP was dropped: the stream ran on")
        assert closed in ([], [True]), "the STOP was dropped: the stream ran to its end"
    finally:
        if thread is not None:
            compute.close()
            thread.join(5)
        channel.close(compute_stopped=thread is None or not thread.is_alive())
