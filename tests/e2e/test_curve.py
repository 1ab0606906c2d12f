"""Workers on other hosts, over CurveZMQ, with real processes and sockets: a broker
bound on 0.0.0.0 (which it allows with keys only), one worker on this host and one in
a network namespace of its own (10.77.X.2, over a veth pair, so its traffic really
leaves loopback; as root only, else both run here), a client and a worker with keys
the broker does not know, and a worker stopped under load."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import zmq

from tests.conftest import free_port, http, linear_config, short_tmpdir, wait_for
from zeroserve.broker import curve, protocol as p
from zeroserve.broker.client import Client, InferError
from zeroserve.broker.protocol import ErrorCode

pytestmark = pytest.mark.timeout(240)

# a python-handler model slow enough that batches are in flight when a worker stops
SLOW = '''
import time


class Model:
    def load(self, version_dir, device):
        pass

    def predict(self, inputs):
        time.sleep(0.02)  # noqa: sleep-ok (a slow model: batches in flight on each worker)
        return {"output": inputs["input"] * 2}
'''


class Netns:
    """A network namespace joined to this one by a veth pair: host side 10.77.X.1,
    namespace side 10.77.X.2. Removed (with its veth) by :meth:`remove`."""

    def __init__(self) -> None:
        used = subprocess.run(["ip", "-4", "addr"], capture_output=True, text=True).stdout
        free = [x for x in range(10, 250) if f"10.77.{x}." not in used]
        self.x = random.choice(free)
        self.name = f"zs-curve-{self.x}-{os.getpid()}"
        self.host_if, self.ns_if = f"zsh{self.x}", f"zsn{self.x}"
        self.host_ip, self.ns_ip = f"10.77.{self.x}.1", f"10.77.{self.x}.2"
        try:
            for cmd in (["netns", "add", self.name],
                        ["link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if],
                        ["link", "set", self.ns_if, "netns", self.name],
                        ["addr", "add", f"{self.host_ip}/24", "dev", self.host_if],
                        ["link", "set", self.host_if, "up"],
                        ["-n", self.name, "addr", "add", f"{self.ns_ip}/24", "dev", self.ns_if],
                        ["-n", self.name, "link", "set", self.ns_if, "up"],
                        ["-n", self.name, "link", "set", "lo", "up"]):
                subprocess.run(["ip", *cmd], check=True, capture_output=True, timeout=10)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
            self.remove()
            raise

    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]

    def remove(self) -> None:
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=10)
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True, timeout=10)


def netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create a network namespace and a veth pair"
    if shutil.which("ip") is None:
        return "needs the `ip` command (iproute2)"
    return None


@dataclass
class Proc:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        os.killpg(self.proc.pid, sig)  # the group: `ip netns exec` and the worker under it

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                pass
        try:
            self.signal(signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


@dataclass
class Cluster:
    folder: Path
    keys: Path
    auth: Path
    runtime: Path
    frontend_port: int
    backend_port: int
    netns: Netns | None
    broker: Proc | None = None
    workers: dict[str, Proc] = field(default_factory=dict)

    @classmethod
    def create(cls, folder: Path, trusted: tuple[str, ...],
               untrusted: tuple[str, ...] = ()) -> "Cluster":
        """Keys for the broker and each name (only the ``trusted`` authorized), a
        runtime folder, and a network namespace where the host allows one."""
        keys, auth = folder / "keys", folder / "auth"
        auth.mkdir()
        for name in ("broker", *trusted, *untrusted):
            public, _ = curve.generate(keys, name)
            if name in trusted:
                shutil.copy(public, auth)
        runtime = folder / "rt"
        runtime.mkdir(mode=0o700)
        netns = None if netns_unavailable() else Netns()
        return cls(folder, keys, auth, runtime, free_port(), free_port(), netns)

    def start_broker(self, repo: Path, extra: list[str]) -> Proc:
        """The broker on tcp:// with CurveZMQ, serving ``repo``."""
        self.broker = self.start("broker", [
            "-m", "zeroserve.broker.server.main", "--model-dir", str(repo),
            "--runtime-dir", str(self.runtime), *extra,
            "--frontend", f"tcp://0.0.0.0:{self.frontend_port}",
            "--backend", f"tcp://0.0.0.0:{self.backend_port}",
            "--curve-secret-key", str(self.keys / "broker.key_secret"),
            "--curve-authorized-keys", str(self.auth)])
        return self.broker

    @property
    def host_ip(self) -> str:
        """The broker's address as the workers here reach it (the veth's, when there is one)."""
        return self.netns.host_ip if self.netns else "127.0.0.1"

    @property
    def control(self) -> str:
        return f"ipc://{self.runtime}/control"

    def start(self, name: str, argv: list[str], prefix: list[str] | None = None) -> Proc:
        log_path = self.folder / f"{name}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([*(prefix or []), sys.executable, *argv], stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        return Proc(name, proc, log_path)

    def start_worker(self, index: int, key: str, in_netns: bool = False,
                     extra: list[str] | None = None) -> Proc:
        prefix = self.netns.prefix() if in_netns and self.netns else None
        worker = self.start(f"worker{index}", [
            "-m", "zeroserve.workers.main", "--index", str(index), "--threads", "1",
            "--runtime-dir", str(self.runtime),
            "--backend", f"tcp://{self.host_ip}:{self.backend_port}",
            "--curve-server-key", str(self.keys / "broker.key"),
            "--curve-secret-key", str(self.keys / f"{key}.key_secret"), *(extra or [])],
            prefix)
        self.workers[f"w{index}"] = worker
        return worker

    def client_keys(self, name: str) -> curve.ClientKeys:
        return curve.ClientKeys(curve.load_public(self.keys / "broker.key"),
                                curve.load_pair(self.keys / f"{name}.key_secret"))

    def frontend(self) -> str:
        return f"tcp://{self.host_ip}:{self.frontend_port}"

    def call(self, verb: str) -> Any:
        with Client(self.control, timeout_s=10) as c:
            return c.control(verb)

    def worker_ids(self) -> set[str]:
        return {w["id"] for w in self.call("status")["workers"]}

    def print_logs(self, tail: int = 0) -> None:
        """Each process's log (its last ``tail`` characters; 0: all), for a failure."""
        for proc in [self.broker, *self.workers.values()]:
            if proc is not None:
                print(f"--- {proc.name}\n{proc.log()[-tail:]}")

    def close(self) -> None:
        """Every process stopped and reaped, the namespace and the folder removed."""
        for proc in [*self.workers.values(), self.broker]:
            if proc is not None:
                proc.stop()
        if self.netns is not None:
            self.netns.remove()
        shutil.rmtree(self.folder, ignore_errors=True)


def batches_run(cluster: Cluster) -> dict[str, float]:
    """Batches each worker ran, from its own metrics (as the broker relays them)."""
    out = {}
    for wid, text in cluster.call("metrics")["workers"].items():
        found = re.search(r'zeroserve_worker_batch_seconds_count\{model="slow"\} (\S+)', text or "")
        out[wid] = float(found.group(1)) if found else 0.0
    return out


def refused(cluster: Cluster, socket: str) -> float:
    text = cluster.call("metrics")["broker"]
    found = re.search(rf'zeroserve_curve_refused_total{{socket="{socket}"}} (\S+)', text)
    return float(found.group(1)) if found else 0.0


def write_slow(repo: Path) -> None:
    (repo / "slow" / "1").mkdir(parents=True)
    (repo / "slow" / "1" / "model.py").write_text(SLOW)
    (repo / "slow" / "config.json").write_text(json.dumps(
        {**linear_config("slow", n_out=4, mbs=4), "platform": "python"}))


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    folder = short_tmpdir("zscurve")
    repo = folder / "repo"
    write_slow(repo)
    c = Cluster.create(folder, ("w0", "w1", "client", "gateway"), ("intruder",))
    runtime = c.runtime
    try:
        c.start_broker(repo, ["--heartbeat-s", "0.25", "--worker-expiry-s", "1.0"])
        c.start_worker(0, "w0")
        c.start_worker(1, "w1", in_netns=True)
        wait_for(lambda: len(c.call("models")["models"]["slow"]["workers"]) == 2
                 if os.path.exists(runtime / "control") else False, 90,
                 "both workers to hold the model")
        yield c
    except AssertionError:
        c.print_logs()
        raise
    finally:
        c.close()


def x(value: float) -> dict[str, np.ndarray]:
    return {"input": np.full((1, 4), value, np.float32)}


def test_two_workers_serve_over_curve(cluster: Cluster) -> None:
    workers = {w["id"]: w for w in cluster.call("status")["workers"]}
    host = next(iter(workers)).split("/")[0]
    assert set(workers) == {f"{host}/0", f"{host}/1"}  # ids stay <host>/<index>
    with Client(cluster.frontend(), curve_keys=cluster.client_keys("client")) as c:
        assert np.allclose(c.infer("slow", x(3)).outputs["output"], 6)
    before = batches_run(cluster)
    client = RawClient(cluster.frontend(), cluster.client_keys("client"))
    try:  # many at once, so that both workers take batches
        for i in range(80):
            client.send(str(i), i)
        wait_for(lambda: client.collect(10) or len(client.answers) == 80, 60, "every answer")
    finally:
        client.close()
    # the workers' figures come with their heartbeats: wait for the ones after the load
    wait_for(lambda: all(batches_run(cluster).get(w, 0) > before.get(w, 0) for w in workers),
             10, f"batches on both workers (before: {before}, now: {batches_run(cluster)})")


def established_peers(port: int) -> set[str]:
    """Remote IPv4 addresses of established connections to a local port (/proc/net/tcp)."""
    peers = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, remote, state = line.split()[1:4]
        if state == "01" and int(local.split(":")[1], 16) == port:
            raw = bytes.fromhex(remote.split(":")[0])[::-1]
            peers.add(".".join(str(b) for b in raw))
    return peers


def test_the_namespaced_worker_talks_over_the_veth(cluster: Cluster) -> None:
    if cluster.netns is None:
        pytest.skip(f"no network namespace: {netns_unavailable()}")
    peers = established_peers(cluster.backend_port)
    assert cluster.netns.ns_ip in peers, peers   # the worker in the namespace
    assert cluster.netns.host_ip in peers, peers  # the one here, through the veth's address


def test_a_gateway_on_another_host_serves_over_curve(cluster: Cluster) -> None:
    """A gateway (in the namespace, when there is one) whose frontend is the broker's
    tcp:// one: HTTP in over the veth, Curve to the broker."""
    host = cluster.netns.ns_ip if cluster.netns else "127.0.0.1"
    port = free_port()
    gateway = cluster.start("gateway", [
        "-m", "zeroserve.gateway.serve", "--http-host", host, "--http-port", str(port),
        "--runtime-dir", str(cluster.folder / "gw-rt"), "--frontend", cluster.frontend(),
        "--curve-server-key", str(cluster.keys / "broker.key"),
        "--curve-secret-key", str(cluster.keys / "gateway.key_secret")],
        cluster.netns.prefix() if cluster.netns else None)
    try:
        def ready() -> bool:
            assert gateway.proc.poll() is None, gateway.log()
            try:
                return http("GET", f"http://{host}:{port}/v2/health/ready", timeout=2)[0] == 200
            except OSError:
                return False
        wait_for(ready, 30, "the gateway to be ready")
        status, _, body = http("POST", f"http://{host}:{port}/v2/models/slow/infer", json.dumps(
            {"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32",
                         "data": [1, 2, 3, 4]}]}).encode())
        assert status == 200, body
        assert json.loads(body)["outputs"][0]["data"] == [2, 4, 6, 8]
        status, _, body = http("GET", f"http://{host}:{port}/v2/models/slow")  # read-only
        assert status == 200 and json.loads(body)["name"] == "slow", body
    finally:
        gateway.stop()


def test_a_client_without_an_authorized_key_gets_nothing_through(cluster: Cluster) -> None:
    before = refused(cluster, "frontend")
    with Client(cluster.frontend(), curve_keys=cluster.client_keys("intruder"),
                connect_timeout_s=5) as c:
        with pytest.raises(InferError) as err:
            c.infer("slow", x(1))
    assert err.value.code is ErrorCode.UNAUTHORIZED
    wait_for(lambda: refused(cluster, "frontend") == before + 1, 10, "the refusal counted")
    # a client that speaks no Curve: refused before it could send, within its bound
    started = time.monotonic()
    with Client(f"tcp://127.0.0.1:{cluster.frontend_port}", connect_timeout_s=2) as c:
        with pytest.raises(InferError) as err:
            c.infer("slow", x(1))
    assert err.value.code is ErrorCode.UNAVAILABLE and time.monotonic() - started < 10
    assert "refused a CurveZMQ client on the frontend" in cluster.broker.log()  # type: ignore[union-attr]


def test_a_worker_with_a_bad_key_is_refused_until_its_key_is_added(cluster: Cluster) -> None:
    before = refused(cluster, "backend")
    intruder = cluster.start_worker(2, "intruder")
    try:
        # refused at each of its attempts (it starts a new connection when it hears nothing)
        wait_for(lambda: refused(cluster, "backend") >= before + 2, 60, "two refusals")
        assert len(cluster.worker_ids()) == 2
        intruder_pub = curve.load_public(cluster.keys / "intruder.key").decode()
        assert f"its public key {intruder_pub} is not authorized" in cluster.broker.log()  # type: ignore[union-attr]
        assert "was our key refused?" in intruder.log()
        # the folder is read again when it changes: its next attempt gets in
        shutil.copy(cluster.keys / "intruder.key", cluster.auth)
        wait_for(lambda: len(cluster.worker_ids()) == 3, 30, "the third worker to join")
    finally:
        (cluster.auth / "intruder.key").unlink(missing_ok=True)
        intruder.stop()
        cluster.workers.pop("w2", None)
    wait_for(lambda: len(cluster.worker_ids()) == 2, 30, "the third worker to be gone")


class RawClient:
    """A DEALER with Curve that sends requests and counts every answer to each, so a
    duplicate answer would show (the library's clients keep the first only)."""

    def __init__(self, endpoint: str, keys: curve.ClientKeys) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        curve.secure_client(self.sock, keys, endpoint)
        self.sock.connect(endpoint)
        self.answers: dict[str, list[Any]] = {}

    def send(self, rid: str, value: float) -> None:
        req = p.InferRequest(rid, "slow", [p.from_numpy("input", x(value)["input"])])
        self.sock.send_multipart(p.encode_request(req), copy=False)

    def collect(self, wait_ms: int) -> None:
        while self.sock.poll(wait_ms):
            kind, header, bufs = p.unpack(self.sock.recv_multipart(copy=False))
            if kind is p.Kind.REPLY:
                reply = p.decode_reply(header, bufs)
                self.answers.setdefault(reply.request_id, []).append(reply)
            elif kind is p.Kind.ERROR:
                err = p.decode_error(header)
                self.answers.setdefault(err.request_id, []).append(err)
            wait_ms = 0

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def test_a_stopped_worker_loses_nothing_its_work_moves(cluster: Cluster) -> None:
    stopped = cluster.workers["w1"]  # the one in the namespace, when there is one
    stopped_id = next(w for w in cluster.worker_ids() if w.endswith("/1"))
    client = RawClient(cluster.frontend(), cluster.client_keys("client"))
    n = 240
    try:
        for i in range(n // 2):
            client.send(str(i), i)
        wait_for(lambda: client.collect(10) or len(client.answers) >= 20, 60, "some answers")
        stopped.signal(signal.SIGSTOP)   # mid-load: batches of it are in flight
        for i in range(n // 2, n):
            client.send(str(i), i)
        wait_for(lambda: client.collect(10) or len(client.answers) == n, 120, "every answer")
        assert stopped_id not in cluster.worker_ids()  # expired by its heartbeats
        client.collect(500)  # a late duplicate would come now
        counts = {rid: len(a) for rid, a in client.answers.items()}
        assert counts == {str(i): 1 for i in range(n)}
        # the batch it was running is not sent elsewhere (it may be what stopped the
        # worker: see DESIGN.md); it fails with a typed, retryable error. Its queued
        # batches move to the other worker.
        failed = [rid for rid, (a,) in client.answers.items() if isinstance(a, p.ErrorReply)]
        assert len(failed) <= 4, failed  # one batch at most (max_batch_size 4)
        for rid in failed:
            (err,) = client.answers.pop(rid)
            assert err.code is ErrorCode.WORKER_LOST and err.code.retryable, err
            client.send(rid, int(rid))   # the client's retry: nothing is lost
        wait_for(lambda: client.collect(10) or len(client.answers) == n, 60, "the retries")
        for rid, (answer,) in client.answers.items():
            assert isinstance(answer, p.InferReply), answer
            assert np.allclose(p.to_numpy(answer.tensors[0]), 2 * int(rid))
        # woken up, it hears it is unknown, registers again and serves
        stopped.signal(signal.SIGCONT)
        wait_for(lambda: stopped_id in cluster.worker_ids(), 30, "the worker to rejoin")
    finally:
        stopped.signal(signal.SIGCONT)
        client.close()


def test_serve_with_a_curve_backend_gives_its_own_workers_the_broker_pair(
        serve: Any, tiny_repo: Path) -> None:
    """`zeroserve serve` with a tcp:// backend beyond loopback: its local worker connects
    with the broker's own key pair, so remote workers could join the same backend."""
    keys = short_tmpdir("zskeys")
    try:
        _, secret = curve.generate(keys, "broker")
        port = free_port()
        server = serve(tiny_repo, extra=["--backend", f"tcp://0.0.0.0:{port}",
                                         "--curve-secret-key", str(secret)])
        status, _, body = http("POST", f"{server.url}/v2/models/linear/infer", json.dumps(
            {"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32",
                         "data": [1, 2, 3, 4]}]}).encode())
        assert status == 200, body
        assert "(CurveZMQ on tcp://)" in server.log()
    finally:
        shutil.rmtree(keys, ignore_errors=True)
