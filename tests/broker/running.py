"""A real broker (loop and sockets) on a thread of the test process, for tests whose
workers are DEALER sockets played by the test."""

from __future__ import annotations

import contextlib
import shutil
import threading
from pathlib import Path
from typing import Any, Iterator

import zmq

from zeroserve.broker.runtime import Endpoints
from zeroserve.broker.server.broker import Broker
from zeroserve.broker.server.loop import BrokerLoop
from zeroserve.broker.server.lifecycle import LifecycleOptions
from tests.conftest import short_tmpdir


@contextlib.contextmanager
def broker_in_thread(repo: Path, lifecycle: LifecycleOptions
                     ) -> Iterator[tuple[Broker, zmq.Context[Any]]]:
    rt = short_tmpdir("zsrt")
    ctx: zmq.Context[Any] = zmq.Context()
    endpoints = Endpoints.in_dir(rt)
    loop = BrokerLoop(endpoints, ctx)
    b = Broker(repo, to_client=loop.to_client, to_worker=loop.to_worker,
               to_controller=loop.to_controller, worker_expiry_s=60, ctx=ctx,
               lifecycle=lifecycle)
    b.endpoints = endpoints  # type: ignore[attr-defined]  # for the tests' sockets
    b.load_catalog()
    b.start(loop.poller)
    thread = threading.Thread(target=loop.run, args=(b,), daemon=True)
    thread.start()
    try:
        yield b, ctx
    finally:
        b.request_stop()
        thread.join(10)
        b.close()
        loop.close(0)
        ctx.destroy(linger=0)
        shutil.rmtree(rt, ignore_errors=True)
