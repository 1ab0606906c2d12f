"""The log settings are the server's, not one gateway process's: one broker, one worker
and two gateway processes started apart (tests/e2e/test_trace_settings.py's cluster). A
change through one gateway is what the other logs by before anyone asks it, and what it
answers; the worker logs by it too; a restarted broker starts again from its own
settings, and every gateway follows it."""

from __future__ import annotations

import json
import re
import time
from typing import Any, Iterator

import pytest

from tests.conftest import http, linear_config, wait_for, write_model
from tests.e2e.test_trace_settings import BOUND_S, Cluster, Gateway

pytestmark = pytest.mark.timeout(180)

DEFAULTS = {"log_file": "", "log_info": True, "log_warning": True, "log_error": True,
            "log_verbose_level": 0, "log_format": "default"}
ISO = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"
DEFAULT_STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}"
# what a gateway logs at DEBUG once it has taken the broker's settings: at the
# gateways' --log-level info it is dropped, so it shows only once verbose is on there
FOLLOWED = r" DEBUG gateway\[\d+\] \S+: log settings: the broker's, version"


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster()
    yield c
    c.close()


def get(g: Gateway) -> dict[str, Any]:
    status, _, body = http("GET", g.url + "/v2/logging")
    assert status == 200, body
    got: dict[str, Any] = json.loads(body)
    return got


def post(g: Gateway, changes: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    status, _, body = http("POST", g.url + "/v2/logging", json.dumps(changes).encode())
    return status, json.loads(body)


def test_a_change_through_one_gateway_is_what_the_other_logs_by(cluster: Cluster) -> None:
    a, b = cluster.gateways
    assert get(a) == get(b) == DEFAULTS
    assert not re.search(FOLLOWED, b.proc.log())   # at info, b drops its DEBUG records
    start = time.monotonic()
    status, got = post(a, {"log_verbose_level": 1, "log_format": "ISO8601"})
    assert status == 200 and got == {**DEFAULTS, "log_verbose_level": 1,
                                     "log_format": "ISO8601"}, got
    # b's own logging follows before anyone asks b: its PONG named another version
    wait_for(lambda: re.search(ISO + FOLLOWED, b.proc.log()), BOUND_S,
             "gateway b logging at DEBUG, stamped ISO8601")
    followed_s = time.monotonic() - start
    assert followed_s < BOUND_S
    assert get(b) == got
    # the worker logs by them (the broker passed them on), stamped ISO8601
    write_model(cluster.repo, "late", 1, "nn.Linear(4, 3)", linear_config("late"))
    worker = next(p for p in cluster.procs if p.name == "worker")
    wait_for(lambda: re.search(ISO + r" INFO worker\d*\[\d+\] \S+: loaded late/1",
                               worker.log()), 60, "the worker's ISO8601 line")
    # back through the other gateway; Triton's errors from either
    status, got = post(b, {"log_verbose_level": 0, "log_format": "default"})
    assert status == 200 and got == DEFAULTS and get(a) == DEFAULTS
    for g, body, why in [(a, {"log_verbose_level": -1}, "log_verbose_level"),
                         (b, {"log_colour": True}, "unknown log setting 'log_colour'"),
                         (a, {"log_file": "/tmp/x"}, "log_file cannot be set")]:
        status, got = post(g, body)
        assert status == 400 and why in got["error"], got
    assert get(a) == get(b) == DEFAULTS


def test_a_restarted_broker_starts_from_its_own_settings(cluster: Cluster) -> None:
    a, b = cluster.gateways
    status, got = post(b, {"log_verbose_level": 1, "log_format": "ISO8601"})
    assert status == 200 and get(a) == got
    wait_for(lambda: re.search(ISO + FOLLOWED, a.proc.log()),
             BOUND_S, "gateway a logging at DEBUG")
    back = DEFAULT_STAMP + r" INFO gateway\[\d+\] \S+: log settings now the broker's: " \
        r"\{'log_verbose_level': 0, 'log_format': 'default'\}"

    def times_back() -> list[int]:
        return [len(re.findall(back, g.proc.log())) for g in (a, b)]
    before = times_back()
    cluster.restart_broker()
    # each gateway's own logging goes back before anyone asks it: the new broker's
    # version is another, its settings its start-up ones (--log-level info)
    wait_for(lambda: all(n > m for n, m in zip(times_back(), before)), 60,
             "both gateways back on the new broker's settings")
    assert get(a) == get(b) == DEFAULTS
