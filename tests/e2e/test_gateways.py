"""Several gateway processes on one port (SO_REUSEPORT), one metrics view."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

from tests.conftest import http, linear_config, short_tmpdir, write_model

pytestmark = pytest.mark.timeout(120)


def test_two_gateway_processes_share_the_port_and_the_metrics(serve):
    repo = short_tmpdir("zsrepo")
    write_model(repo, "linear", 1, "nn.Linear(4, 3)", linear_config("linear"))
    srv = serve(repo, extra=["--http-workers", "2"])
    assert len(srv.pids("gateway")) == 2
    body = json.dumps({"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32",
                                   "data": np.ones(4).tolist()}]}).encode()
    for _ in range(40):  # a new connection each: the kernel spreads them
        status, _, got = http("POST", srv.url + "/v2/models/linear/infer", body)
        assert status == 200, got
    _, _, text = http("GET", srv.url + "/metrics")
    served = sum(float(v) for v in re.findall(
        r'zeroserve_http_requests_total\{[^}]*route="/v2/models/\{name\}/infer"[^}]*\} '
        r'([0-9.e+]+)', text.decode()))
    assert served >= 40  # both processes' counts, whichever answered the scrape


def test_gateway_processes_by_default_follow_the_cores_the_workers_leave() -> None:
    from zeroserve.workers.serve import http_processes, usable_cores
    # no worker on the host's cores: one gateway per two cores the broker leaves, at most 4
    assert [http_processes(0, c, False) for c in (1, 2, 4, 7, 8, 16, 32, 64)] == [
        1, 1, 1, 3, 3, 4, 4, 4]
    # 16 cores: 8 GPU workers (a core each) leave 7; one CPU worker of 15 threads, none
    assert http_processes(0, 16, False, 8) == 3
    assert http_processes(0, 16, False, 15) == 1
    assert http_processes(0, 64, False, 8) == 4
    assert http_processes(0, 32, True) == 1   # shared-memory regions live in one gateway
    assert http_processes(3, 2, True) == 3    # what the operator asked for, as is
    assert 1 <= usable_cores() <= (os.cpu_count() or 1)
