"""A faulty canary at 10% of the traffic: how long from its first error to its rollback,
and how many requests failed meanwhile.

    .venv/bin/python -m tests.bench.bench_rollout [--seconds S] [--rate R] [--fail F]

One ``zeroserve serve`` (one worker) serves a Python handler model ``m`` (1 ms a batch)
at an open-loop rate from one asyncio direct client, each request with a routing key of
its own. Three phases, in the same run:

1. baseline: version 1 alone, ``--seconds``, its failures counted;
2. ``rollout --retry false``: version 2, which raises on a fraction ``--fail`` of its
   inputs, rolled out with steps [10, 100] (a long dwell: it stays at 10%) and the
   default thresholds; the time from the first error a client sees to the broker's
   verdict, and the failures meanwhile, as a share of every request answered meanwhile;
3. ``rollout --retry true`` (the default plan): the same with a version 3 alike; the
   canary's failures run again on version 1.

The goal (issue 32): rolled back within 10 s of its first errors, having failed no more
than 1% of all requests meanwhile. The client shares the machine's cores with the server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tests.conftest import Server, linear_config, short_tmpdir, wait_for
from zeroserve.broker.client import AsyncClient, Client, InferError

HANDLER = '''
import time


class Model:
    def load(self, version_dir, device):
        pass

    def predict(self, inputs):
        x = inputs["input"]
        if any(1 <= int(v) % 1000 <= {fail_per_mille} for v in x[:, 0]):
            raise ValueError("version {version} fails on this input")
        time.sleep(0.001)  # noqa: sleep-ok (a model with a known service time)
        return {{"output": x[:, :3] * 0.0 + {version}.0}}
'''


def add_version(repo: Path, version: int, fail: float) -> None:
    tmp = repo / "m" / f".tmp-{version}"
    tmp.mkdir(parents=True)
    # warm-up sends zeros: a faulty version fails on inputs 1 to fail x 1000, never on 0
    (tmp / "model.py").write_text(HANDLER.format(version=version,
                                                 fail_per_mille=round(fail * 1000)))
    os.rename(tmp, repo / "m" / str(version))


@dataclass
class Outcomes:
    answers: list[tuple[float, bool]] = field(default_factory=list)   # (time, failed)
    errors: dict[str, int] = field(default_factory=dict)              # by code

    def between(self, start_s: float, end_s: float) -> tuple[int, int]:
        inside = [failed for t, failed in self.answers if start_s <= t <= end_s]
        return len(inside), sum(inside)


async def open_loop(frontend: str, rate: float, seconds: float, out: Outcomes,
                    start_n: int) -> int:
    """Requests at ``rate`` per second for ``seconds``, whatever the answers; returns
    the next request number."""
    async with AsyncClient(frontend) as client:
        await client.wait_connected(10.0)   # else the first requests answer unavailable
        pending: set[asyncio.Task[None]] = set()
        begin, n = time.monotonic(), 0

        async def one(k: int) -> None:
            # inputs cycle through 1..999, never 0 (see add_version)
            x = np.full((1, 4), float(k % 999 + 1), np.float32)
            try:
                await client.infer("m", {"input": x}, routing_key=f"user-{k}")
                out.answers.append((time.monotonic(), False))
            except InferError as exc:
                out.answers.append((time.monotonic(), True))
                out.errors[exc.code.value] = out.errors.get(exc.code.value, 0) + 1

        while (elapsed := time.monotonic() - begin) < seconds:
            due = int(elapsed * rate)
            while n < due:
                task = asyncio.create_task(one(start_n + n))
                pending.add(task)
                task.add_done_callback(pending.discard)
                n += 1
            await asyncio.sleep(1.0 / rate)  # noqa: sleep-ok (the open loop's pace)
        await asyncio.gather(*pending)
        return start_n + n


def control(srv: Server, verb: str, **args: Any) -> Any:
    with Client(srv.control, timeout_s=10) as c:
        return c.control(verb, **args)


def phase(srv: Server, repo: Path, version: int, args: argparse.Namespace,
          retry: bool, start_n: int) -> tuple[dict[str, Any], int]:
    add_version(repo, version, args.fail)
    wait_for(lambda: version in control(srv, "models")["models"]["m"]["ready"], 60,
             f"version {version} to load")
    control(srv, "rollout", model="m", version=version, steps=[10, 100], dwell_s=3600.0,
            retry=retry, stable=1)
    out = Outcomes()
    sent_at = time.monotonic()
    next_n = asyncio.run(open_loop(srv.frontend, args.rate, args.seconds, out, start_n))
    rollout = control(srv, "models")["models"]["m"]["rollout"]
    counts = rollout["counts"][str(version)]
    ended_s = rollout.get("ended_s")
    failures = sorted(t for t, failed in out.answers if failed)
    first_s = failures[0] if failures else None
    row: dict[str, Any] = {"retry": retry, "outcome": rollout["outcome"] or "still running",
                           "canary_requests": counts["requests"],
                           "canary_errors": counts["errors"],
                           "failed_total": len(failures), "answered": len(out.answers),
                           "errors": out.errors}
    if ended_s is not None:
        # the canary's first error: the first a client saw, or (retrying) the verdict's
        # start, which the broker's first counted error bounds from below
        start_s = first_s if first_s is not None else sent_at
        total, failed = out.between(start_s, ended_s)
        row.update(to_rollback_s=round(ended_s - start_s, 2), failed_meanwhile=failed,
                   answered_meanwhile=total,
                   failed_share_pct=round(100.0 * failed / max(total, 1), 2))
    shutil.rmtree(repo / "m" / str(version))
    wait_for(lambda: control(srv, "models")["models"]["m"]["versions"] == [1], 60,
             f"version {version} to leave")
    return row, next_n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=15.0, help="each phase's load")
    ap.add_argument("--rate", type=float, default=200.0, help="requests per second")
    ap.add_argument("--fail", type=float, default=0.2,
                    help="the share of its inputs the faulty canary raises on")
    args = ap.parse_args()
    repo = short_tmpdir("zsbench")
    (repo / "m").mkdir()
    (repo / "m" / "config.json").write_text(json.dumps(
        {**linear_config("m"), "platform": "python", "version_policy": {"latest": 2}}))
    add_version(repo, 1, 0.0)
    srv = Server(repo, workers=1).wait_ready()
    try:
        base = Outcomes()
        n = asyncio.run(open_loop(srv.frontend, args.rate, args.seconds, base, 0))
        print(f"baseline (version 1 alone): {len(base.answers)} answered, "
              f"{sum(f for _, f in base.answers)} failed {base.errors}, at {args.rate:g} rps")
        for version, retry in ((2, False), (3, True)):
            row, n = phase(srv, repo, version, args, retry, n)
            print(f"canary v{version} at 10%, raising on {args.fail:.0%} of its inputs: "
                  + ", ".join(f"{k} {v}" for k, v in row.items()))
    finally:
        srv.stop()
        shutil.rmtree(repo, ignore_errors=True)


if __name__ == "__main__":
    main()
