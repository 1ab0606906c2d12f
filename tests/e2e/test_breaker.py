"""Circuit breaking end to end, under direct and HTTP load (tests/e2e/canary.py's):
a swap without a plan is watched and its failing build rolled back with no request
failed; a model with no other version that starts failing opens its breaker, its callers
get 503 at once, and a new build closes it; one that still holds a healthy version is
answered by it meanwhile."""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import Server, http, linear_config, short_tmpdir, wait_for
from tests.e2e.canary import Load, add_version, control, rollout_of, write_version
from zeroserve.broker.client import Client, InferError
from zeroserve.broker.protocol import ErrorCode

pytestmark = pytest.mark.timeout(180)

BREAKABLE = '''
import pathlib


class Model:
    def load(self, version_dir, device):
        pass

    def predict(self, inputs):
        if pathlib.Path({flag!r}).exists():
            raise RuntimeError("the model broke")
        return {{"output": inputs["input"][:, :3] * 0.0 + 1.0}}
'''


@pytest.fixture
def repo():
    path = short_tmpdir("zsrepo")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def config(repo: Path, **extra: object) -> None:
    (repo / "m").mkdir(exist_ok=True)
    (repo / "m" / "config.json").write_text(json.dumps(
        {**linear_config("m", **extra), "platform": "python"}))


def breaker(srv: Server) -> dict:
    return control(srv, "models")["models"]["m"].get("breaker") or {}


def test_a_swap_without_a_plan_is_watched_and_its_failing_build_rolled_back(repo: Path,
                                                                             serve) -> None:
    config(repo, version_policy={"latest": 2})
    write_version(repo / "m" / "1", 1)
    srv = serve(repo)
    load = Load(srv)
    try:
        wait_for(lambda: len(load.answers.all()) > 100, 30, "answers from version 1")
        published = time.monotonic()
        add_version(repo, 2, fails=True)     # raises on a fifth of its inputs
        done = wait_for(lambda: (r := rollout_of(srv)).get("outcome") == "rolled back"
                        and r, 30, "the watch to roll version 2 back")
        took_s = time.monotonic() - published
        served = len(load.answers.all())
        wait_for(lambda: len(load.answers.all()) > served + 100, 20, "answers after it")
    finally:
        answers = load.finish()
    assert done["watch"] is True and done["canary"] == 2 and done["stable"] == 1
    assert took_s < 10.0, f"rolled back {took_s:.1f} s after the rename"
    failed = [a.outcome for a in answers.all() if not isinstance(a.outcome, int)]
    assert not failed, failed[:5]          # version 2's failures ran again on version 1
    m = control(srv, "models")["models"]["m"]
    assert "2" in m["rolled_back"] and m["default_version"] == 1
    tail = sorted(answers.all(), key=lambda a: a.sent)[-50:]
    assert {a.outcome for a in tail} == {1}
    print(f"\nwatch: version 2 rolled back {took_s:.2f} s after its rename, "
          f"{len(answers.all())} answers, none failed, "
          f"{done['counts']['2']['errors']} of version 2's failures retried on version 1")


def test_a_failing_model_opens_its_breaker_fails_fast_and_a_new_build_closes_it(
        repo: Path, serve) -> None:
    flag = repo.parent / f"{repo.name}-broken"
    config(repo)
    (repo / "m" / "1").mkdir()
    (repo / "m" / "1" / "model.py").write_text(BREAKABLE.format(flag=str(flag)))
    srv = serve(repo)
    load = Load(srv)
    try:
        wait_for(lambda: len(load.answers.all()) > 100, 30, "answers")
        flag.write_text("")
        broke = time.monotonic()
        wait_for(lambda: breaker(srv).get("state") == "open", 10, "the breaker to open")

        def refused() -> list[Any]:
            return [a for a in load.answers.all()
                    if isinstance(a.outcome, str) and "circuit breaker" in a.outcome]
        # the state can be read open before the load's first 503 is back (a full run did)
        wait_for(refused, 10, "a request refused by the breaker")
        opened_s = min(a.got for a in refused()) - broke
        assert opened_s < 2.0, f"the first 503 came {opened_s:.2f} s after the failures"
        assert "the model broke" in breaker(srv)["reason"]
        with Client(srv.control, timeout_s=5) as c:
            metrics = c.control("metrics")["broker"]
        assert 'zeroserve_circuit_breaker_trips_total{model="m"} 1.0' in metrics
        assert re.search(r'zeroserve_circuit_breaker_state\{model="m"\} [12]\.0', metrics)
        # refused at once: a direct client's round trips, and HTTP's 503 with Retry-After
        x = np.ones((1, 4), np.float32)
        rtts, codes = [], set()
        with Client(srv.frontend, timeout_s=10) as c:
            for _ in range(200):
                t = time.perf_counter()
                try:
                    c.infer("m", {"input": x})
                    codes.add("ok")
                except InferError as exc:
                    codes.add(exc.code)
                    if exc.code is ErrorCode.UNAVAILABLE:
                        rtts.append(time.perf_counter() - t)
                        assert exc.retry_after_s is not None and exc.retry_after_s > 0
        body = json.dumps({"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32",
                                       "data": [1, 2, 3, 4]}]}).encode()
        status, headers, raw = http("POST", srv.url + "/v2/models/m/infer", body)
        lower = {k.lower(): v for k, v in headers.items()}
        assert ErrorCode.UNAVAILABLE in codes and len(rtts) > 100, codes
        assert status == 503 and int(lower["retry-after"]) >= 1, raw
        # fixed: a new build closes it, and the callers are answered again
        fixed = repo / "m" / ".tmp-2"
        fixed.mkdir()
        (fixed / "model.py").write_text(BREAKABLE.format(flag=str(flag) + "-never"))
        os.rename(fixed, repo / "m" / "2")
        wait_for(lambda: control(srv, "models")["models"]["m"]["ready"] == [2], 30,
                 "version 2")
        assert breaker(srv).get("state") in (None, "closed")
        count = len(load.answers.all())
        wait_for(lambda: len(load.answers.all()) > count + 50, 20, "answers from version 2")
    finally:
        answers = load.finish()
        flag.unlink(missing_ok=True)
    last = sorted(answers.all(), key=lambda a: a.sent)[-20:]
    assert {a.outcome for a in last} == {1}, last
    rtts.sort()
    print(f"\nbreaker: first 503 {opened_s * 1000:.0f} ms after the model broke; a refused "
          f"direct request's round trip p50 {statistics.median(rtts) * 1e6:.0f} µs, p99 "
          f"{rtts[int(len(rtts) * 0.99)] * 1e6:.0f} µs")
    assert statistics.median(rtts) < 0.005


VERSIONED = '''
import pathlib


class Model:
    def load(self, version_dir, device):
        pass

    def predict(self, inputs):
        if pathlib.Path({flag!r}).exists():
            raise RuntimeError("version {version} broke")
        return {{"output": inputs["input"][:, :3] * 0.0 + {version}.0}}
'''


def test_an_open_breaker_routes_to_the_healthy_version_the_model_still_holds(
        repo: Path, serve) -> None:
    """Two versions served (latest 2), the newest starts failing: its breaker opens and
    the callers are answered by version 1 instead of 503; the newest fixed, the probes
    pass, it closes, and version 2 answers again."""
    flag = repo.parent / f"{repo.name}-broken"
    config(repo, version_policy={"latest": 2})
    for v in (1, 2):
        (repo / "m" / str(v)).mkdir()
        (repo / "m" / str(v) / "model.py").write_text(VERSIONED.format(
            flag=str(flag) if v == 2 else str(flag) + "-never", version=v))
    srv = serve(repo)
    load = Load(srv)
    try:
        wait_for(lambda: sum(a.outcome == 2 for a in load.answers.all()) > 100, 30,
                 "answers from version 2")
        flag.write_text("")
        wait_for(lambda: breaker(srv).get("state") == "open", 10, "the breaker to open")
        opened = time.monotonic()
        assert breaker(srv)["version"] == 2
        wait_for(lambda: sum(a.sent > opened for a in load.answers.all()) > 300, 30,
                 "answers while it is open")
        flag.unlink()
        fixed = time.monotonic()
        wait_for(lambda: breaker(srv).get("state") == "closed", 60, "the probes to close it")
        closed = time.monotonic()
        wait_for(lambda: sum(a.sent > closed and a.outcome == 2
                             for a in load.answers.all()) > 50, 20,
                 "answers from version 2 again")
    finally:
        answers = load.finish()
        flag.unlink(missing_ok=True)
    meanwhile = [a for a in answers.all() if opened < a.sent and a.got < fixed]
    outcomes = [a.outcome for a in meanwhile]
    refused = [o for o in outcomes if isinstance(o, str) and "circuit breaker" in o]
    failed = [o for o in outcomes if isinstance(o, str)]
    assert not refused, refused[:3]
    # the half-open probes go to version 2 and fail while it is broken: a few a probe turn
    assert outcomes.count(1) >= 0.95 * len(outcomes), Counter(map(str, outcomes))
    print(f"\nbreaker routing: {len(outcomes)} answers while open, "
          f"{outcomes.count(1)} by version 1, {len(failed)} failed (probes of version 2), "
          f"none refused; closed {closed - fixed:.1f} s after the fix")
