"""Handlers that call models (BLS), with real processes: one worker in the pool, so
every model a handler calls runs on the handler's own worker, which must not deadlock.
32 concurrent requests through the direct client, the numbers against the same
computation in-process, the caller's deadline inherited (a call past it fails at once),
a called model's error caught by the handler or failing the request with the model
named, and a SIGKILL of the worker while handlers wait: every request answered once,
the broker's census empty afterwards."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import torch

from zeroserve.broker.client import AsyncClient, Client, ErrorCode, InferError
from tests.conftest import Server, linear_config, short_tmpdir, wait_for, write_model

pytestmark = pytest.mark.timeout(240)

SCALE = '''
import time


class Model:
    def load(self, version_dir, device):
        pass

    def predict(self, inputs):
        x = inputs["input"]
        if bool((x[:, 0] == 777.0).any()):   # the slow input: a call that takes a while
            time.sleep(0.3)  # noqa: sleep-ok (the model under test is slow)
        return {"output": x * 2.0 + 1.0}
'''

BOOM = '''
class Model:
    def load(self, version_dir, device):
        pass

    def predict(self, inputs):
        if float(inputs["input"].abs().sum()) > 0:   # warm-up's zeros pass
            raise RuntimeError("boom!")
        return {"output": inputs["input"]}
'''

CHAIN = '''
from zeroserve.workers.bls import Call


class Model:
    def load(self, version_dir, device, models):
        self.models = models

    def predict(self, inputs):
        x = inputs["input"]
        s = self.models.infer("scale", {"input": x}, as_torch=True)["output"]
        lin, again = self.models.infer_many([Call("linear", {"input": s}),
                                             Call("scale", {"input": s})])
        return {"output": lin["output"], "output2": again["output"]}
'''

CHAIN_ASYNC = '''
import asyncio


class Model:
    def load(self, version_dir, device, models):
        self.models = models

    async def predict(self, inputs):
        x = inputs["input"]
        s = (await self.models.infer_async("scale", {"input": x}))["output"]
        lin, again = await asyncio.gather(self.models.infer_async("linear", {"input": s}),
                                          self.models.infer_async("scale", {"input": s}))
        return {"output": lin["output"], "output2": again["output"]}
'''

CATCHER = '''
import numpy as np

from zeroserve.workers.bls import ModelCallError


class Model:
    def load(self, version_dir, device, models):
        self.models = models

    def predict(self, inputs):
        x = inputs["input"]
        try:
            self.models.infer("boom", {"input": x})
            caught = 0.0
        except ModelCallError as err:
            caught = 1.0 if err.model == "boom" and "boom!" in err.message else 2.0
        return {"output": np.full((x.shape[0], 1), caught, np.float32)}
'''

UNCAUGHT = '''
class Model:
    def load(self, version_dir, device, models):
        self.models = models

    def predict(self, inputs):
        return self.models.infer("boom", {"input": inputs["input"]})
'''

# sleeps past its caller's deadline, then calls: the call must fail at once, unsent;
# what it saw goes to the file $BLS_TEST_LOG names (its request is answered by then)
LATE = '''
import json
import os
import time

import numpy as np

from zeroserve.workers.bls import ModelCallError


class Model:
    def load(self, version_dir, device, models):
        self.models = models

    def predict(self, inputs):
        x = inputs["input"]
        past_s = max(0.0, self.models.remaining_ms()) / 1000.0 + 0.05
        time.sleep(past_s)  # noqa: sleep-ok (past the deadline on purpose)
        start = time.monotonic()
        try:
            self.models.infer("scale", {"input": x})
            code = "none"
        except ModelCallError as err:
            code = err.code.value
        with open(os.environ["BLS_TEST_LOG"], "a") as f:
            f.write(json.dumps({"code": code, "ms": (time.monotonic() - start) * 1000}) + "\\n")
        return {"output": x}
'''

# calls probe, which reports the context its own call inherited
OUTER = '''
class Model:
    def load(self, version_dir, device, models):
        self.models = models

    def predict(self, inputs):
        return self.models.infer("probe", {"input": inputs["input"]})
'''

PROBE = '''
import numpy as np


class Model:
    def load(self, version_dir, device, models):
        self.models = models

    def predict(self, inputs):
        n = inputs["input"].shape[0]
        c = self.models.caller()
        traced = float(bool(c.trace) and c.trace["traceparent"].split("-")[1] == "ab" * 16)
        return {"output": np.array([[self.models.remaining_ms(), c.priority,
                                     float(c.api_key == ""), traced]] * n, np.float32)}
'''

# waits on the slow input's call to scale: the worker is killed meanwhile
WAITER = '''
class Model:
    def load(self, version_dir, device, models):
        self.models = models

    def predict(self, inputs):
        return {"output": self.models.infer("scale", {"input": inputs["input"]})["output"]}
'''


def _handler(repo: Path, name: str, code: str, n_out: int = 4,
             **extra: Any) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(code)
    outputs = [{"name": "output", "datatype": "FP32", "shape": [n_out]}]
    if name.startswith("chain"):
        outputs = [{"name": "output", "datatype": "FP32", "shape": [3]},
                   {"name": "output2", "datatype": "FP32", "shape": [4]}]
    cfg = {**linear_config(name, mbs=32), "platform": "python", "outputs": outputs, **extra}
    (repo / name / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    repo = short_tmpdir("zsbls")
    vdir = write_model(repo, "linear", 1, "nn.Linear(4, 3)", linear_config("linear", mbs=32))
    _handler(repo, "scale", SCALE)
    _handler(repo, "boom", BOOM)
    _handler(repo, "chain", CHAIN)
    _handler(repo, "chain_async", CHAIN_ASYNC)
    _handler(repo, "catcher", CATCHER, n_out=1)
    _handler(repo, "uncaught", UNCAUGHT)
    _handler(repo, "late", LATE)
    _handler(repo, "outer", OUTER, n_out=4)
    _handler(repo, "probe", PROBE, n_out=4)
    _handler(repo, "waiter", WAITER)
    log = repo / "late.log"
    srv = Server(repo, workers=1, env={"BLS_TEST_LOG": str(log)}).wait_ready()
    srv.linear = torch.jit.load(str(vdir / "model.pt"))  # type: ignore[attr-defined]
    srv.late_log = log  # type: ignore[attr-defined]
    yield srv
    srv.stop()


def census_empty(srv: Server) -> None:
    def empty() -> bool:
        with Client(srv.control, timeout_s=10) as c:
            census = c.control("census")
        return bool(census) and not any(census.values())
    wait_for(empty, 10, "an empty census")


def expected(srv: Server, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    s = x * 2.0 + 1.0
    with torch.inference_mode():
        lin = srv.linear(torch.from_numpy(s)).numpy()  # type: ignore[attr-defined]
    return lin, s * 2.0 + 1.0


async def _many(srv: Server, model: str, xs: list[np.ndarray], **kw: Any) -> list[Any]:
    async with AsyncClient(srv.frontend) as c:
        assert await c.wait_connected(10)

        async def one(x: np.ndarray) -> Any:
            try:
                return await c.infer(model, {"input": x}, **kw)
            except InferError as err:
                return err
        return await asyncio.gather(*(one(x) for x in xs))


@pytest.mark.parametrize("model", ["chain", "chain_async"])
def test_chain_under_concurrency_on_its_own_worker(server: Server, model: str) -> None:
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((int(rng.integers(1, 4)), 4)).astype(np.float32)
          for _ in range(96)]
    start = time.monotonic()
    results = asyncio.run(_many(server, model, xs, timeout_ms=60_000))
    assert time.monotonic() - start < 60   # a deadlock would run into the timeouts
    for x, r in zip(xs, results):
        assert not isinstance(r, InferError), r
        lin, again = expected(server, x)
        np.testing.assert_allclose(r.outputs["output"], lin, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(r.outputs["output2"], again, rtol=1e-6)
    census_empty(server)


def test_called_models_error_caught_or_named(server: Server) -> None:
    xs = [np.ones((1, 4), np.float32)] * 16
    caught = asyncio.run(_many(server, "catcher", xs, timeout_ms=30_000))
    assert all(not isinstance(r, InferError) and r.outputs["output"][0, 0] == 1.0
               for r in caught), caught
    failed = asyncio.run(_many(server, "uncaught", xs, timeout_ms=30_000))
    for err in failed:
        assert isinstance(err, InferError), err
        assert "'boom'" in err.message and "boom!" in err.message, err.message
    census_empty(server)


def test_the_callers_context_is_inherited(server: Server) -> None:
    with Client(server.frontend, timeout_s=30) as c:
        out = c.infer("outer", {"input": np.ones((1, 4), np.float32)}, timeout_ms=5000,
                      priority=1, traceparent=f"00-{'ab' * 16}-{'cd' * 8}-01"
                      ).outputs["output"]
        free = c.infer("outer", {"input": np.ones((1, 4), np.float32)}).outputs["output"]
    remaining, priority, no_key, traced = out[0]
    assert 0 < remaining < 5000       # the budget left, not a fresh one
    assert priority == 1 and no_key == 1.0
    assert traced == 1.0              # the call carried the caller's trace id
    assert free[0, 0] == np.inf and free[0, 3] == 0.0   # nothing given: nothing inherited


def test_a_call_past_the_callers_deadline_fails_at_once(server: Server) -> None:
    log: Path = server.late_log  # type: ignore[attr-defined]
    with Client(server.frontend, timeout_s=30) as c:
        try:   # the batch ran: its answer may come, late, or the broker's refusal
            c.infer("late", {"input": np.ones((1, 4), np.float32)}, timeout_ms=300)
        except InferError as err:
            assert err.code is ErrorCode.DEADLINE, err
    seen = wait_for(lambda: log.exists() and log.read_text().strip(), 10, "the late call")
    entry = json.loads(seen.splitlines()[-1])
    assert entry["code"] == "deadline"
    assert entry["ms"] < 50.0, entry     # failed here, before any round trip
    census_empty(server)


def test_worker_killed_while_handlers_wait(server: Server) -> None:
    """The handler waits on scale's slow call when its worker dies: every request is
    answered exactly once (by the retry on the restarted worker, or an error)."""
    xs = [np.full((1, 4), 777.0 if i % 2 == 0 else float(i), np.float32) for i in range(32)]
    old = server.pids("worker")
    assert len(old) == 1

    def waiting() -> bool:
        with Client(server.control, timeout_s=5) as c:
            return any(w.get("waiting_batches") for w in c.control("status")["workers"])

    async def run() -> list[Any]:
        task = asyncio.ensure_future(_many(server, "waiter", xs, timeout_ms=60_000))
        while not task.done() and not await asyncio.to_thread(waiting):
            pass
        assert not task.done(), "no handler was seen waiting"
        os.kill(old[0], signal.SIGKILL)
        return await task
    results = asyncio.run(run())
    assert len(results) == len(xs)
    for x, r in zip(xs, results):
        if isinstance(r, InferError):
            assert r.code in (ErrorCode.WORKER_LOST, ErrorCode.NO_WORKER,
                              ErrorCode.UNAVAILABLE, ErrorCode.DEADLINE), r
        else:
            np.testing.assert_allclose(r.outputs["output"], x * 2.0 + 1.0)
    wait_for(lambda: server.pids("worker") and server.pids("worker") != old, 60,
             "the worker restarted")
    census_empty(server)
