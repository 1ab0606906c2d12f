"""What a published and deleted version leaves in the broker (issue 48's soak grew ~1 MB
an hour under a version published and one deleted every 30 s): 200 versions through the
real watcher, swaps, a request answered on each, and a census of every container the
broker reaches, by where it sits, before and after; and, for what no attribute reaches
(a module's cache), the live objects of zeroserve's types. Workers and the client are
sockets of the test."""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import zmq

from tests.broker.running import broker_in_thread
from tests.broker.test_lifecycle import OPEN, FakeWorker, write_version
from tests.conftest import linear_config, short_tmpdir, wait_for
from zeroserve.broker import protocol as p
from zeroserve.broker.server import memtrace
from zeroserve.broker.server.lifecycle import LifecycleOptions
from zeroserve.models.repository import version_sha256

pytestmark = pytest.mark.timeout(600)

# logging's objects too: a handler is the test runner's (pytest's keeps every record)
SKIP = (type, type(len), type(lambda: 0), type(time), zmq.Socket, zmq.Context,
        zmq.Poller, np.ndarray, str, bytes, int, float, bool, type(None),
        logging.Logger, logging.Handler)


def census(root: Any) -> dict[str, int]:
    """Items of every container reachable from ``root``, summed by the path of
    attribute names that leads to it (a dict's keys are not in the path, so one
    version's entry and the next's count at the same place)."""
    out: collections.Counter[str] = collections.Counter()
    seen: set[int] = set()
    stack: list[tuple[str, Any]] = [("broker", root)]
    while stack:
        path, obj = stack.pop()
        if isinstance(obj, SKIP) or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            out[path] += len(obj)
            stack.extend((f"{path}[]", v) for v in list(obj.values()))
            stack.extend((f"{path}{{}}", k) for k in list(obj) if not isinstance(k, SKIP))
        elif isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
            out[path] += len(obj)
            stack.extend((f"{path}[]", v) for v in list(obj))
        else:
            attrs = dict(getattr(obj, "__dict__", {}))
            for cls in type(obj).__mro__:
                for name in getattr(cls, "__slots__", ()):
                    if hasattr(obj, name):
                        attrs[name] = getattr(obj, name)
            stack.extend((f"{path}.{k}", v) for k, v in attrs.items())
    return out


def own_objects() -> dict[str, int]:
    """Live objects of zeroserve's types in this process (the broker's thread and the
    test's), by type."""
    return {t: n for t, n in memtrace.type_counts().items() if t.startswith("zeroserve.")}


def stable_census(root: Any) -> dict[str, int]:
    for _ in range(20):   # the broker's thread may change a dict under the walk
        try:
            return census(root)
        except RuntimeError:
            time.sleep(0.01)   # noqa: sleep-ok (a turn for the broker's thread)
    raise AssertionError("the census never saw the broker still")


class Caller:
    def __init__(self, ctx: zmq.Context[Any], endpoint: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        OPEN.append(self.sock)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.n = 0

    def send(self) -> None:
        self.n += 1
        req = p.InferRequest(str(self.n), "m", [p.from_numpy("input", np.ones((1, 4),
                                                                              np.float32))])
        self.sock.send_multipart(p.encode_request(req))

    def reply(self) -> None:
        assert self.sock.poll(10_000), "no reply within 10 s"
        kind, header, _ = p.unpack(self.sock.recv_multipart())
        assert kind is p.Kind.REPLY, header


def expect(w: FakeWorker, kind: p.Kind) -> tuple[dict[str, Any], Any]:
    deadline = time.monotonic() + 10
    while True:
        left = int((deadline - time.monotonic()) * 1000)
        assert left > 0 and w.sock.poll(left), f"no {kind.name} within 10 s"
        got, header, bufs = p.unpack(w.sock.recv_multipart())
        if got is kind:
            return header, bufs


@contextlib.contextmanager
def one_model_broker() -> Iterator[tuple[Any, Path, zmq.Context[Any]]]:
    """A broker in a thread over a repository of model ``m`` (version 1 unpublished):
    the broker, the repository and the context its sockets take."""
    repo = short_tmpdir("zsrepo")
    write_version(repo, 1, publish=False)
    (repo / "m" / "config.json").write_text(json.dumps(linear_config("m")))
    with broker_in_thread(repo, LifecycleOptions(debounce_s=0.02)) as (b, ctx):
        yield b, repo, ctx
        while OPEN:
            OPEN.pop().close(linger=0)
    shutil.rmtree(repo, ignore_errors=True)


@pytest.fixture
def world() -> Iterator[tuple[Any, Path, zmq.Context[Any]]]:
    with one_model_broker() as parts:
        yield parts


def test_two_hundred_versions_published_and_deleted_leave_nothing_behind(world) -> None:
    b, repo, ctx = world
    w = FakeWorker(ctx, b.endpoints.backend, "host/0")
    w.loaded(w.expect(p.Kind.LOAD), sha=version_sha256(repo / "m" / "1"))
    caller = Caller(ctx, b.endpoints.frontend)

    def cycle(v: int) -> None:
        write_version(repo, v)
        w.loaded(w.expect(p.Kind.LOAD), sha=version_sha256(repo / "m" / str(v)))
        assert w.expect(p.Kind.UNLOAD)["version"] == v - 1
        caller.send()
        header, bufs = expect(w, p.Kind.BATCH)
        batch = p.decode_batch(header, bufs)
        assert batch.version == v
        w.sock.send_multipart(p.encode_result(p.BatchResult(batch.batch_id, [
            p.InferReply(i.request_id, "m", v, [p.from_numpy(
                "output", np.zeros((1, 3), np.float32))]) for i in batch.items], 1.0)))
        caller.reply()
        shutil.rmtree(repo / "m" / str(v - 1))

    for v in range(2, 82):   # past every bounded window (the latency model's 64 batches)
        cycle(v)
    before, alive = stable_census(b), own_objects()
    for v in range(82, 202):
        cycle(v)
    # what the census cannot reach: objects held by a module (a cache of configs kept
    # ModelConfig, ShapeRule and their specs of every version for hours), by type
    kept = {t: (alive.get(t, 0), n) for t, n in own_objects().items()
            if n - alive.get(t, 0) >= 60}
    assert not kept, f"objects of ours 120 more versions left alive: {kept}"
    grown: dict[str, tuple[int, int]] = {}

    def settled() -> bool:   # the last folder's deletion may still be on its way
        after = stable_census(b)
        grown.clear()
        grown.update({k: (before.get(k, 0), n) for k, n in after.items()
                      if n > before.get(k, 0)})
        return not grown
    try:
        wait_for(settled, 5.0, "the census to settle")
    except AssertionError:
        pass
    assert not grown, f"what 120 more versions left behind: {grown}"
