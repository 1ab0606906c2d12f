"""No input ends the broker's loop, and only who may change state can: malformed frames on
every socket (a corpus, then hypothesis-made headers), requests that name themselves
get a typed error, state-changing verbs are refused on the frontend and need the admin
token, a second broker and an unsafe runtime folder are refused. Real processes."""

from __future__ import annotations

import json
import math
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zeroserve.broker import protocol as p
from zeroserve.broker.client import Client, ErrorCode, InferError
from tests.conftest import ZEROSERVE, Server, examples, http, linear_config, short_tmpdir, \
    wait_for, write_model

pytestmark = pytest.mark.timeout(240)

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    repo = short_tmpdir("zsrepo")
    write_model(repo, "linear", 1, "nn.Linear(4, 3)", linear_config("linear"))
    srv = Server(repo, env={"ZEROSERVE_ADMIN_TOKEN": TOKEN}).wait_ready()
    yield srv
    srv.stop()


def broker_pid(srv: Server) -> int:
    (pid,) = srv.pids("broker")
    return pid


def still_serves(srv: Server) -> None:
    with Client(srv.frontend, timeout_s=10) as c:
        out = c.infer("linear", {"input": np.ones((1, 4), np.float32)})
    assert out.outputs["output"].shape == (1, 3)


class Raw:
    """A DEALER that sends any frames and reads answers with a deadline."""

    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.connect(endpoint)

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def answer(self, rid: str, timeout_s: float = 5.0) -> tuple[p.Kind, dict[str, Any]]:
        deadline = time.monotonic() + timeout_s
        while True:
            left = int((deadline - time.monotonic()) * 1000)
            assert left > 0 and self.sock.poll(left), f"no answer to {rid!r}"
            kind, header, _ = p.unpack(self.sock.recv_multipart())
            if header.get("id") == rid:
                return kind, header

    def close(self) -> None:
        self.sock.close()


def request_frames(rid: str, **fields: Any) -> list[bytes]:
    frames = p.encode_request(p.InferRequest(
        rid, "linear", [p.from_numpy("input", np.ones((1, 4), np.float32))]))
    header = msgpack.unpackb(frames[1])
    header.update(fields)
    return [bytes(frames[0]), msgpack.packb(header), *[bytes(f) for f in frames[2:]]]


def corpus() -> list[list[bytes]]:
    """Random bytes, wrong frame counts, unknown kinds and versions, every header field
    of a request with a wrong type, wrong byte lengths."""
    good = request_frames("x")
    out: list[list[bytes]] = [[b""], [b"\x01"], [os.urandom(64)], [b"\xff", b"junk"],
                              [b"\x01", b"\xc1\xc1"], [b"\x01", msgpack.packb([1, 2])],
                              [b"\x01", msgpack.packb({"v": 99})], good[:2],
                              good + [b"extra"], [good[0], good[1], good[2][:-1]]]
    for kind in p.Kind:
        out.append([kind.value, msgpack.packb({"v": 1})])
        out.append([kind.value, msgpack.packb({"v": 1, "id": 7, "verb": [], "reason": {}})])
    bundle = p.Kind.REQUESTS.value
    for parts in ([1], [[]], [{"tensors": 3}], [{"tensors": [1]}], "x", [{}] * 300):
        out.append([bundle, msgpack.packb({"v": 2, "requests": parts})])
    out.append([bundle, msgpack.packb({"v": 2, "requests": [msgpack.unpackb(good[1])]})])
    for batches in (1, [[1]], [["x", []]], [[1, "x"]], [[1, [["0", True, [["o"]]]]]]):
        out.append([p.Kind.STEPS.value, msgpack.packb({"v": 4, "batches": batches})])
    for name in ("model", "version", "priority", "timeout_ms", "tenant", "tensors",
                 "outputs", "row"):
        for bad in ([1, 2], {"k": "v"}, "str", 1.5, True, None, -1):
            out.append(request_frames(None, **{name: bad}))  # type: ignore[arg-type]
    return out


@pytest.mark.parametrize("socket_name", ["frontend", "backend", "control"])
def test_a_corpus_of_malformed_frames_ends_nothing(server: Server, socket_name: str) -> None:
    pid = broker_pid(server)
    raw = Raw(f"ipc://{server.runtime}/{socket_name}")
    for frames in corpus():
        raw.send(frames)
    raw.close()
    with Client(server.control) as c:
        wait_for(lambda: f'socket="{socket_name}"' in c.control("metrics")["broker"], 10,
                 "the bad messages counted")
    still_serves(server)
    assert broker_pid(server) == pid


@settings(max_examples=examples(60), suppress_health_check=list(HealthCheck))
@given(header=st.dictionaries(
    st.sampled_from(["v", "id", "model", "version", "priority", "timeout_ms", "tensors",
                     "outputs", "verb", "args", "reason", "worker_id", "credits", "models",
                     "requests", "replies"]),
    st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(),
              st.text(max_size=8), st.binary(max_size=8),
              st.lists(st.one_of(st.integers(-2**63, 2**63), st.text(max_size=3)),
                       max_size=3))),
    kind=st.sampled_from(list(p.Kind)), socket_name=st.sampled_from(["frontend", "backend",
                                                                     "control"]))
def test_hypothesis_headers_on_every_socket(server: Server, header: dict[str, Any],
                                            kind: p.Kind, socket_name: str) -> None:
    raw = Raw(f"ipc://{server.runtime}/{socket_name}")
    raw.send([kind.value, msgpack.packb(header)])
    raw.close()


def test_after_the_fuzz_the_same_broker_still_answers(server: Server) -> None:
    pid = broker_pid(server)
    still_serves(server)
    assert broker_pid(server) == pid


@pytest.mark.parametrize("fields, needle", [
    ({"timeout_ms": math.nan}, "finite number"),
    ({"timeout_ms": math.inf}, "finite number"),
    ({"timeout_ms": -5.0}, "finite number"),
    ({"tensors": [["input", ["FP32"], [1, 4]]]}, "datatype"),
    ({"tensors": [["input", {"a": 1}, [1, 4]]]}, "datatype"),
    # the first version this broker does not speak
    ({"v": max(p.SUPPORTED_VERSIONS) + 1},
     f"version {max(p.SUPPORTED_VERSIONS) + 1} is not supported"),
])
def test_a_request_that_names_itself_gets_a_typed_error(server: Server, fields: dict[str, Any],
                                                       needle: str) -> None:
    raw = Raw(server.frontend)
    raw.send(request_frames("named", **fields))
    kind, header = raw.answer("named")
    raw.close()
    assert kind is p.Kind.ERROR and header["code"] == "bad_input"
    assert needle in header["message"]


def _answers(raw: Raw, ids: set[str], timeout_s: float = 10.0) -> dict[str, list[p.Kind]]:
    """Every answer to ``ids`` (REPLY, ERROR, or inside REPLIES) until each has one, then
    half a second more: a second answer to any of them would show."""
    got: dict[str, list[p.Kind]] = {}
    deadline = time.monotonic() + timeout_s
    quiet_until = None
    while quiet_until is None or time.monotonic() < quiet_until:
        left = min(deadline, quiet_until or deadline) - time.monotonic()
        if left <= 0 or not raw.sock.poll(int(left * 1000) + 1):
            if quiet_until is None:
                raise AssertionError(f"unanswered: {sorted(ids - set(got))}")
            continue
        kind, header, bufs = p.unpack(raw.sock.recv_multipart())
        if kind is p.Kind.REPLIES:
            for rep in p.decode_replies(header, bufs):
                got.setdefault(rep.request_id, []).append(kind)
        elif header.get("id") in ids:
            got.setdefault(header["id"], []).append(kind)
        if quiet_until is None and set(got) >= ids:
            quiet_until = time.monotonic() + 0.5
    return got


def test_a_bundle_of_requests_gets_one_answer_each(server: Server) -> None:
    """REQUESTS (protocol version 2): good requests are answered, a bad one gets its own
    typed error, one without an id is dropped alone; never two answers to one request."""
    def req(rid: str, rows: int = 1) -> p.InferRequest:
        return p.InferRequest(rid, "linear", [p.from_numpy("input", np.ones((rows, 4),
                                                                           np.float32))])
    frames = p.encode_requests([req("a"), req("b", 3), req("c")])
    header = msgpack.unpackb(frames[1])
    header["requests"][1]["tensors"][0][1] = "INT8"       # b: a wrong datatype
    header["requests"].append({"model": "linear", "tensors": []})   # no id: nothing to answer
    raw = Raw(server.frontend)
    raw.send([frames[0], msgpack.packb(header), *[bytes(f) for f in frames[2:]]])
    got = _answers(raw, {"a", "b", "c"})
    raw.close()
    assert set(got) == {"a", "b", "c"} and all(len(v) == 1 for v in got.values()), got
    assert got["b"] == [p.Kind.ERROR]
    assert {got["a"][0], got["c"][0]} <= {p.Kind.REPLY, p.Kind.REPLIES}
    still_serves(server)


def test_a_bundle_stamped_version_1_answers_each_request(server: Server) -> None:
    """It used to be dropped: its callers waited for their own timeouts."""
    frames = p.encode_requests([p.InferRequest(rid, "linear", [
        p.from_numpy("input", np.ones((1, 4), np.float32))]) for rid in ("old1", "old2")])
    header = msgpack.unpackb(frames[1])
    header["v"] = 1
    raw = Raw(server.frontend)
    raw.send([frames[0], msgpack.packb(header), *[bytes(f) for f in frames[2:]]])
    for rid in ("old1", "old2"):
        kind, err = raw.answer(rid)
        assert kind is p.Kind.ERROR and "needs protocol version 2" in err["message"], err
    raw.close()
    still_serves(server)


def test_the_async_client_bundles_and_each_caller_gets_its_own_answer(server: Server) -> None:
    import asyncio

    from zeroserve.broker.client import AsyncClient

    async def go() -> None:
        async with AsyncClient(server.frontend) as c:
            assert await c.wait_connected(10)
            xs = [np.full((1, 4), i, np.float32) for i in range(40)]
            outs = await asyncio.gather(*[c.infer("linear", {"input": x}) for x in xs])
            assert c._bundles  # the broker's PONG said version 2
            firsts = [float(o.outputs["output"][0, 0]) for o in outs]
            assert len(set(firsts)) == len(xs)  # each its own answer, none swapped:
            ones = await c.infer("linear", {"input": np.ones((1, 4), np.float32)})
            slope = float(ones.outputs["output"][0, 0]) - firsts[0]
            for i, first in enumerate(firsts):  # a linear model's output is linear in x
                assert abs(first - (firsts[0] + slope * i)) < 1e-3 * (1 + abs(slope) * i)
            cancelled = asyncio.ensure_future(c.infer("linear", {"input": xs[0]}))
            await asyncio.sleep(0)  # noqa: sleep-ok (one loop turn: the request is made)
            cancelled.cancel()
            await asyncio.gather(cancelled, return_exceptions=True)
            assert c.census() == {"client.pending": 0, "client.outbox": 0}, c.census()
    asyncio.run(go())


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_an_idle_broker_stays_idle_after_a_signal(server: Server) -> None:
    """A signal's wake-up byte is read: zmq.Poller reports a plain socket by descriptor,
    and a loop that looked for the socket object left the byte there and spun."""
    import signal
    pid = broker_pid(server)
    os.kill(pid, signal.SIGHUP)   # reload: the broker goes on serving
    still_serves(server)
    before, start = _cpu_s(pid), time.monotonic()
    time.sleep(1.0)  # noqa: sleep-ok (the measurement: CPU used over a second of idling)
    used = (_cpu_s(pid) - before) / (time.monotonic() - start)
    assert used < 0.5, f"an idle broker used {used:.0%} of a core after SIGHUP"


def test_a_zero_size_batch_is_a_clear_bad_input(server: Server) -> None:
    with Client(server.frontend, timeout_s=10) as c, pytest.raises(InferError) as err:
        c.infer("linear", {"input": np.zeros((0, 4), np.float32)})
    assert err.value.code is ErrorCode.BAD_INPUT and "batch-size must be >= 1" in err.value.message


@pytest.mark.parametrize("verb, args", [
    ("drain", {"worker": "x/0"}), ("undrain", {"worker": "x/0"}),
    ("restart", {"worker": "x/0"}), ("reload", {"model": "linear"}),
    ("unregister", {"model": "linear"}), ("register", {"body": {}}),
])
def test_state_changing_verbs_are_refused_on_the_frontend(server: Server, verb: str,
                                                          args: dict[str, Any]) -> None:
    with Client(server.frontend, timeout_s=5, admin_token=TOKEN) as c:
        with pytest.raises(InferError) as err:
            c.control(verb, **args)
        assert err.value.code is ErrorCode.FORBIDDEN
        assert "control socket only" in err.value.message
        assert c.control("models")["models"]["linear"]["ready"] == [1]  # read-only is fine


def test_the_control_socket_needs_the_admin_token(server: Server) -> None:
    with Client(server.control, timeout_s=5) as c:
        with pytest.raises(InferError) as err:
            c.control("drain", worker="nobody/0")
        assert err.value.code is ErrorCode.UNAUTHORIZED
        assert c.control("status")["workers"]  # reading needs no token
    with Client(server.control, timeout_s=5, admin_token="wrong") as c:
        with pytest.raises(InferError) as err:
            c.control("reload", model="linear")
        assert err.value.code is ErrorCode.UNAUTHORIZED
    with Client(server.control, timeout_s=5, admin_token=TOKEN) as c:
        with pytest.raises(InferError) as err:
            c.control("drain", worker="nobody/0")
        assert err.value.code is ErrorCode.NOT_FOUND  # authorized: it got to the verb


def test_a_second_broker_on_the_same_folder_exits_naming_the_first(server: Server) -> None:
    out = subprocess.run([*ZEROSERVE, "broker", "--model-dir", str(server.model_dir),
                          "--runtime-dir", str(server.runtime)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert f"another broker (pid {broker_pid(server)})" in out.stderr
    still_serves(server)


def test_a_second_server_on_the_same_folder_is_refused(server: Server) -> None:
    out = subprocess.run([*ZEROSERVE, "serve", "--model-dir", str(server.model_dir),
                          "--runtime-dir", str(server.runtime), "--http-port", "1"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert f"another server (pid {server.proc.pid})" in out.stderr
    still_serves(server)


def test_a_second_server_is_refused_while_the_first_restarts_its_broker(
        tiny_repo: Path, serve: Any) -> None:
    """The broker's own lock is free while its supervisor restarts it: a second server
    started then used to pass the check and run on through the first one's broker."""
    first = serve(tiny_repo)
    (pid,) = first.pids("broker")
    os.kill(pid, 9)
    out = subprocess.run([*ZEROSERVE, "serve", "--model-dir", str(tiny_repo),
                          "--runtime-dir", str(first.runtime), "--http-port", "1"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert f"another server (pid {first.proc.pid})" in out.stderr
    wait_for(lambda: [q for q in first.pids("broker") if q != pid], 30, "the broker's restart")
    wait_for(lambda: serves(first), 30, "the first server to serve again")


def serves(srv: Server) -> bool:
    try:
        still_serves(srv)
        return True
    except InferError as exc:
        assert exc.code.retryable, exc
        return False


def test_a_runtime_folder_others_can_write_is_refused(tmp_path: Path) -> None:
    folder = short_tmpdir("zsrt")
    try:
        folder.chmod(0o777)
        out = subprocess.run([*ZEROSERVE, "broker", "--model-dir", str(tmp_path),
                              "--runtime-dir", str(folder)],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and "writable by others" in out.stderr
        assert not (folder / "frontend").exists()
    finally:
        folder.chmod(0o700)
        for child in folder.iterdir():
            child.unlink()
        folder.rmdir()


def test_a_direct_client_that_disconnects_has_its_queued_requests_withdrawn(
        server: Server) -> None:
    with Client(server.control, timeout_s=5, admin_token=TOKEN) as ctl:
        (worker,) = ctl.control("status")["workers"]
        ctl.control("drain", worker=worker["id"])   # nothing runs: requests stay queued
        before = cancelled(ctl.control("metrics")["broker"])
        try:
            raw = Raw(server.frontend)
            for i in range(5):
                raw.send(request_frames(f"q{i}"))
            wait_for(lambda: ctl.control("status")["queues"]["linear"] == 5, 10, "queued")
            raw.sock.setsockopt(zmq.LINGER, 0)
            raw.close()
            wait_for(lambda: ctl.control("status")["queues"]["linear"] == 0, 10,
                     "the queue to empty")
            after = cancelled(ctl.control("metrics")["broker"])
        finally:
            ctl.control("undrain", worker=worker["id"])
    assert after == before + 5, (before, after)


def cancelled(metrics: str) -> float:
    series = 'zeroserve_requests_rejected_total{model="linear",reason="cancelled"} '
    return sum(float(line[len(series):]) for line in metrics.splitlines()
               if line.startswith(series))


def test_a_zero_size_batch_over_http_is_a_400(server: Server) -> None:
    for body, headers in (
            (json.dumps({"inputs": [{"name": "input", "shape": [0, 4], "datatype": "FP32",
                                     "data": []}]}).encode(), {}),
            (json.dumps({"inputs": [{"name": "input", "shape": [0, 4], "datatype": "FP32",
                                     "parameters": {"binary_data_size": 0}}]}).encode(),
             {"Inference-Header-Content-Length": "0"})):
        if headers:
            headers = {"Inference-Header-Content-Length": str(len(body))}
        code, _, got = http("POST", server.url + "/v2/models/linear/infer", body, headers)
        assert code == 400, got
        assert "batch-size must be >= 1" in json.loads(got)["error"]
