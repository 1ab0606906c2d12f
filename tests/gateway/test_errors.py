"""Limits and errors: JSON everywhere, the right statuses, readiness that follows the
broker and the workers."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import signal

import pytest

from zeroserve.gateway.app import Settings, create_app
from tests.conftest import http, wait_for
from tests.gateway.conftest import MAX_BODY_BYTES

pytestmark = pytest.mark.timeout(180)


def v2_body(n_floats):
    return json.dumps({"inputs": [{"name": "input", "shape": [1, n_floats],
                                   "datatype": "FP32", "data": [0.5] * n_floats}]}).encode()


def test_body_over_the_limit_is_a_413(api_server):
    big = v2_body(MAX_BODY_BYTES // 4)
    assert len(big) > MAX_BODY_BYTES
    for path in ("/v2/models/linear/infer", "/models/linear/predict", "/predictions/linear"):
        status, headers, got = http("POST", api_server.url + path, big)
        assert status == 413 and headers["content-type"] == "application/json", path
        assert f"exceeds {MAX_BODY_BYTES} bytes" in json.loads(got)["error"]
    # a small gzip body that inflates past the limit is refused the same way
    bomb = gzip.compress(b" " * (MAX_BODY_BYTES * 4))
    assert len(bomb) < MAX_BODY_BYTES
    status, _, got = http("POST", api_server.url + "/v2/models/linear/infer", bomb,
                          {"Content-Encoding": "gzip"})
    assert status == 413, got
    # and the server goes on serving
    assert http("POST", api_server.url + "/v2/models/linear/infer", v2_body(4))[0] == 200


def test_unknown_route_and_method_are_json(api_server):
    status, _, got = http("GET", api_server.url + "/nowhere")
    assert status == 404 and json.loads(got)["error"]
    status, headers, got = http("DELETE", api_server.url + "/v2/models/linear/infer")
    assert status == 405 and "POST" in headers["allow"] and json.loads(got)["error"]
    status, _, got = http("GET", api_server.url + "/v2/models/linear/versions/0")
    assert status == 400 and "positive integer" in json.loads(got)["error"]
    status, _, got = http("GET", api_server.url + "/v2/models/linear/versions/"
                          + "9" * 30 + "/ready")
    assert status == 400


def test_an_unexpected_exception_is_a_500_json_answer():
    from starlette.routing import Route

    app = create_app(Settings(frontend="ipc:///nonexistent/frontend"))

    async def boom(request):
        raise RuntimeError("a bug")

    app.router.routes.append(Route("/boom", boom))
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "GET", "scheme": "http", "path": "/boom", "raw_path": b"/boom",
             "root_path": "", "query_string": b"", "headers": [],
             "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1), "app": app}
    # Starlette answers through the handler, then re-raises for the server's log
    with pytest.raises(RuntimeError, match="a bug"):
        asyncio.run(app(scope, receive, send))
    assert sent[0]["status"] == 500
    assert (b"content-type", b"application/json") in sent[0]["headers"]
    assert json.loads(sent[1]["body"]) == {"error": "internal error: RuntimeError"}


def _ready(srv):
    return {path: http("GET", srv.url + path, timeout=5)[0]
            for path in ("/readyz", "/v2/health/ready", "/ping")}


def test_readiness_follows_the_broker_and_the_workers(serve, tiny_repo):
    srv = serve(tiny_repo)
    assert set(_ready(srv).values()) == {200}
    (broker,) = srv.pids("broker")
    os.kill(broker, signal.SIGKILL)
    wait_for(lambda: set(_ready(srv).values()) == {503}, 20, "not ready without a broker")
    status, _, got = http("GET", srv.url + "/readyz")
    assert "broker" in json.loads(got)["error"]
    # the supervisor restarts the broker; workers and the gateway find it again
    wait_for(lambda: set(_ready(srv).values()) == {200}, 40, "ready with the new broker")
    assert broker not in srv.pids("broker")
    (worker,) = srv.pids("worker --")
    os.kill(worker, signal.SIGKILL)
    wait_for(lambda: set(_ready(srv).values()) == {503}, 20, "not ready without a worker")
    status, _, got = http("GET", srv.url + "/v2/health/ready")
    assert "worker" in json.loads(got)["error"]
    wait_for(lambda: set(_ready(srv).values()) == {200}, 60, "ready with the new worker")
