"""Limits and errors: JSON everywhere, the right statuses, readiness that follows the
broker and the workers."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import signal
import threading

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
    assert status == 400 and "integral value > 0" in json.loads(got)["error"]
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


class ReadyWatch:
    """Polls the readiness routes back to back in a thread, keeping every answer, so a
    short not-ready window (a broker restarted at once) cannot slip between polls."""

    PATHS = ("/readyz", "/v2/health/ready", "/ping")

    def __init__(self, srv):
        self.srv = srv
        self.seen: list[tuple[str, int, str]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.is_set():
            for path in self.PATHS:
                status, _, body = http("GET", self.srv.url + path, timeout=10)
                self.seen.append((path, status, body.decode(errors="replace")))
            self.stop.wait(0.01)  # noqa: sleep-ok (pacing, so the poller leaves CPU to the server)

    def mark(self):
        return len(self.seen)

    def went_down_and_up(self, since, *needles):
        """Readiness answered 503 (with one of ``needles`` in the error), and after
        that every route answered 200. A restarted broker is back within a second, so
        the 503 may show on one route only: whichever was asked in that window."""
        after = self.seen[since:]
        down = next((i for i, (_, s, b) in enumerate(after)
                     if s == 503 and any(n in b for n in needles)), None)
        if down is None:
            return False
        up = {p for p, s, _ in after[down + 1:] if s == 200}
        return up == set(self.PATHS)

    def close(self):
        self.stop.set()
        self.thread.join(30)


def test_readiness_follows_the_broker_and_the_workers(serve, tiny_repo):
    srv = serve(tiny_repo)
    watch = ReadyWatch(srv)
    try:
        wait_for(lambda: {s for _, s, _ in watch.seen[-3:]} == {200}, 10, "ready")
        (broker,) = srv.pids("broker")
        since = watch.mark()
        os.kill(broker, signal.SIGKILL)
        # the supervisor restarts the broker; workers and the gateway find it again
        # while it is gone: unreachable; once back, until the workers register again:
        # no live worker (either window may be the one the watcher sees)
        wait_for(lambda: watch.went_down_and_up(since, "broker", "worker"), 40,
                 "not ready without the broker, then ready with the new one")
        assert broker not in srv.pids("broker")
        (worker,) = srv.pids("worker --")
        since = watch.mark()
        os.kill(worker, signal.SIGKILL)
        wait_for(lambda: watch.went_down_and_up(since, "worker"), 60,
                 "not ready without a worker, then ready with the new one")
    finally:
        watch.close()
