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
from zeroserve.workers import sequences
from zeroserve.workers.loaded import LoadedModels

pytestmark = pytest.mark.timeout(60)
STREAM_S = 10.0   # how long the stream runs unless the broker's STOP reaches it
OWED_S = 1.5   # a paused sequence's slot is owed this long (PREEMPTOR_WAIT_NS, set)


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


class Paced:
    """An iterative model's handler: each sequence answers a step every few ms, never
    final; the compute thread's CPU clock read as it pauses and resumes one."""

    def __init__(self) -> None:
        self.steps = 0
        self.paused_at: tuple[float, float] | None = None    # (monotonic, thread CPU)
        self.resumed_at: tuple[float, float] | None = None
        self.joined: list[int] = []

    def join(self, seq_id: int, inputs: dict[str, torch.Tensor]) -> dict[str, int]:
        self.joined.append(seq_id)
        return {}

    def step(self, states: dict[int, Any]) -> dict[int, Any]:
        self.steps += 1
        time.sleep(0.002)   # noqa: sleep-ok (a step's compute)
        return {seq_id: ({"output": torch.ones((1, 3))}, False) for seq_id in states}

    def pause(self, seq_id: int) -> None:
        self.paused_at = (time.monotonic(), time.thread_time())

    def resume(self, seq_id: int) -> None:
        self.resumed_at = (time.monotonic(), time.thread_time())


class Quiet:
    """A main thread's side that reads nothing itself: the test hands the compute thread
    what the main thread would."""

    def route(self, frames: list[Any]) -> bool:
        return True

    def heard(self, now: float) -> None:
        pass


@pytest.fixture
def paused(broker: tuple[zmq.Context[Any], zmq.Socket[Any]],
           monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Compute, Paced]]:
    """A compute thread whose one sequence slot is held by a sequence the broker paused
    (PAUSE): its slot owed to a preemptor whose batch the worker has not read, for
    OWED_S (the main thread's side played by the test: it calls pause, queue, stop)."""
    ctx, router = broker
    monkeypatch.setattr(sequences, "PREEMPTOR_WAIT_NS", int(OWED_S * 1e9))
    handler = Paced()
    cfg = parse_config({**linear_config("c"), "platform": "python",
                        "sequences": {"max": 1}}, "test")
    models = LoadedModels()
    models.put(("c", 1), LoadedModel("c", 1, cfg, "0" * 64, handler.step, "cpu",
                                     handler=handler, version_dir=Path("/nonexistent")))
    compute = Compute(models, "w/0", CollectorRegistry(), spans=None,
                      bad_log=RateLimitedLog(logging.getLogger(__name__)))
    channel = BrokerChannel(ctx, "inproc://broker", b"w0", None, lambda: None)
    channel.connect()
    thread = None
    try:
        channel.send([b"hello"])
        assert router.poll(5000), "the worker's channel did not connect"
        router.recv_multipart()
        router.send_multipart([b"w0", *p.encode_batch(one_request(1))])
        thread = compute.start(channel, Quiet())
        wait_for(lambda: handler.steps >= 3, 10, "the sequence's steps")
        compute.pause(p.Pause(1, ["0"]))
        wait_for(lambda: handler.paused_at is not None, 10, "the pause")
        yield compute, handler
    finally:
        if thread is not None:
            compute.close()
            thread.join(5)
        channel.close(compute_stopped=thread is None or not thread.is_alive())


def one_request(batch_id: int) -> p.Batch:
    return p.Batch(batch_id, "c", 1, [p.BatchItem(
        "0", [p.from_numpy("input", np.zeros((1, 4), np.float32))])])


def test_a_compute_thread_with_only_paused_sequences_waits_without_spinning(
        paused: tuple[Compute, Paced]) -> None:
    """Nothing to step until the owed slot lapses: the compute thread waits on its poller
    (it looped over empty step boundaries, a core's worth of CPU for the whole wait)."""
    _, handler = paused
    wait_for(lambda: handler.resumed_at is not None, OWED_S + 10, "the resume")
    assert handler.paused_at is not None and handler.resumed_at is not None
    wall = handler.resumed_at[0] - handler.paused_at[0]
    cpu = handler.resumed_at[1] - handler.paused_at[1]
    assert wall >= OWED_S * 0.9, wall   # it waited for the preemptor as long as owed
    # a few wake-ups' worth, against a spinning thread's share of a core (on a loaded
    # host, with most of the cores taken, still a quarter of the wait or more)
    assert cpu < 0.1 * OWED_S, f"{cpu:.3f} s of CPU in a wait of {wall:.3f} s"


def test_a_resting_compute_thread_wakes_for_the_preemptors_batch(
        paused: tuple[Compute, Paced]) -> None:
    """The preemptor's batch that the main thread reads joins at once, not when the owed
    slot lapses (queue woke the compute thread only when it was idle)."""
    compute, handler = paused
    t0 = time.monotonic()
    header, bufs = p.unpack(p.encode_batch(one_request(2)))[1:]
    compute.queue(header, bufs, time.monotonic())
    wait_for(lambda: len(handler.joined) == 2, OWED_S + 10, "the preemptor's join")
    assert time.monotonic() - t0 < OWED_S / 2, "the batch waited for the owed slot"
    assert handler.resumed_at is None   # its slot is the preemptor's


def test_a_resting_compute_thread_wakes_for_a_stop_of_the_paused(
        broker: tuple[zmq.Context[Any], zmq.Socket[Any]],
        paused: tuple[Compute, Paced]) -> None:
    """A STOP of the paused sequence: it leaves at once, and its join's RESULT goes."""
    _, router = broker
    compute, handler = paused
    t0 = time.monotonic()
    compute.stop(p.Stop(1, ["0"]))
    deadline = t0 + OWED_S + 10
    while (left_ms := int((deadline - time.monotonic()) * 1000)) > 0 and router.poll(left_ms):
        if p.unpack(router.recv_multipart()[1:])[0] is p.Kind.RESULT:
            break
    else:
        raise AssertionError("no RESULT for the stopped sequence's batch")
    assert time.monotonic() - t0 < OWED_S / 2, "the STOP waited for the owed slot"
    assert handler.resumed_at is None
