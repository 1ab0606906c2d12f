"""Where the load runs: in this process (one event loop kept across levels), or in N
spawned processes that run each level together from one start time and send back
their raw samples, merged here."""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

from zeroserve.broker.bench import load as bl

Progress = Callable[[int, int], None]   # answers so far (ok, errors), all processes
START_MARGIN_S = 0.3   # from "go" to the first request: every process is waiting by then


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    """uvloop when installed (uvicorn[standard] brings it): less generator CPU per
    request, on a host whose cores the server shares."""
    try:
        import uvloop
        return uvloop.new_event_loop
    except ImportError:
        return asyncio.new_event_loop


class InlineRunner:
    def __init__(self, plan: bl.Plan) -> None:
        self.plan = plan
        self._runner = asyncio.Runner(loop_factory=_loop_factory())
        self.sender = bl.make_sender(plan)
        self._runner.run(self.sender.start())

    def run(self, level: bl.LevelPlan, progress: Progress) -> bl.Samples:
        def tick(s: bl.Samples) -> None:
            progress(s.progress_ok, s.progress_err)
        start_at = time.monotonic() + START_MARGIN_S
        return self._runner.run(bl.run_level(self.sender, self.plan, level, start_at, tick))

    def close(self) -> None:
        try:
            self._runner.run(self.sender.close())
        finally:
            self._runner.close()


def _child(conn: Connection, plan: bl.Plan) -> None:
    """A load process: runs the levels the parent sends until told to stop."""
    asyncio.Runner(loop_factory=_loop_factory()).run(_child_loop(conn, plan))


async def _child_loop(conn: Connection, plan: bl.Plan) -> None:
    loop = asyncio.get_running_loop()
    sender = bl.make_sender(plan)
    try:
        await sender.start()
        conn.send(("ready", None))
        while True:
            # read in a thread: the loop keeps running (the direct client's pings)
            msg = await loop.run_in_executor(None, conn.recv)
            if msg[0] == "stop":
                return
            _, level, start_at = msg

            def tick(s: bl.Samples) -> None:
                conn.send(("progress", (s.progress_ok, s.progress_err)))
            try:
                samples = await bl.run_level(sender, plan, level, start_at, tick)
            except (ConnectionError, OSError) as exc:
                conn.send(("error", str(exc)))
                continue
            conn.send(("done", samples))
    finally:
        await sender.close()
        conn.close()


class ProcessRunner:
    def __init__(self, plan: bl.Plan, processes: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        for _ in range(processes):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_child, args=(theirs, plan), daemon=True)
            proc.start()
            theirs.close()
            self.conns.append(mine)
            self.procs.append(proc)
        try:
            for conn in self.conns:
                if not conn.poll(60):
                    raise RuntimeError("a load process did not start within 60 s")
                conn.recv()  # "ready"
        except (EOFError, RuntimeError) as exc:
            self.close()
            raise RuntimeError(f"a load process failed to start: {exc or 'it exited'}") from None

    def run(self, level: bl.LevelPlan, progress: Progress) -> bl.Samples:
        start_at = time.monotonic() + START_MARGIN_S
        shares = bl.split(level, len(self.conns))
        for conn, share in zip(self.conns, shares):
            conn.send(("level", share, start_at))
        counts = {id(c): (0, 0) for c in self.conns}
        merged = bl.Samples()
        pending = list(self.conns)
        failures = []
        limit = start_at + level.warmup_s + level.duration_s + 120.0
        while pending:
            if time.monotonic() > limit:
                raise RuntimeError("the load processes did not finish their level")
            for ready in wait(pending, timeout=1.0):
                assert isinstance(ready, Connection)
                conn = ready
                try:
                    kind, body = conn.recv()
                except EOFError:
                    kind, body = "error", "a load process exited during the level"
                if kind == "progress":
                    counts[id(conn)] = body
                    progress(sum(c[0] for c in counts.values()),
                             sum(c[1] for c in counts.values()))
                    continue
                pending.remove(conn)
                if kind == "error":
                    failures.append(body)
                else:
                    merged.merge(body)
        if failures:
            raise ConnectionError(failures[0])
        return merged

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(("stop", None))
            except OSError:
                pass
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()


Runner = InlineRunner | ProcessRunner


def make_runner(plan: bl.Plan, processes: int) -> Runner:
    return InlineRunner(plan) if processes <= 1 else ProcessRunner(plan, processes)
