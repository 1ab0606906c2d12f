"""CurveZMQ without workers: key files, the authorized-keys folder, the broker's refusals,
and a real broker (on a thread, tcp:// on loopback with Curve) answering the read-only
verbs to an authorized client and refusing the others with a clear error."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import zmq
from prometheus_client import Counter

from tests.conftest import ZEROSERVE, free_port, short_tmpdir, wait_for
from zeroserve.broker import curve, options
from zeroserve.broker.client import AsyncClient, Client, InferError
from zeroserve.broker.protocol import ErrorCode
from zeroserve.broker.runtime import Endpoints
from zeroserve.broker.server.broker import Broker
from zeroserve.broker.server.loop import BrokerLoop
from zeroserve.broker.server.lifecycle import LifecycleOptions

pytestmark = pytest.mark.timeout(60)


def keys_generate(folder: Path, name: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*ZEROSERVE, "keys", "generate", name, "--dir", str(folder), *extra],
                          capture_output=True, text=True, timeout=30)


def test_keys_generate_writes_a_public_file_and_a_0600_pair(tmp_path: Path) -> None:
    out = keys_generate(tmp_path / "keys", "worker-a")
    assert out.returncode == 0, out.stderr
    public, secret = tmp_path / "keys" / "worker-a.key", tmp_path / "keys" / "worker-a.key_secret"
    assert secret.stat().st_mode & 0o777 == 0o600
    assert public.stat().st_mode & 0o077 != 0o077  # readable, for copying around
    pair = curve.load_pair(secret)
    assert curve.load_public(public) == pair.public and len(pair.secret) == 40
    assert "secret-key" not in public.read_text()
    # the format is zmq.auth's: its loader reads our files
    assert zmq.auth.load_certificate(str(secret)) == (pair.public, pair.secret)
    again = keys_generate(tmp_path / "keys", "worker-a")
    assert again.returncode == 2 and "--force" in again.stderr
    assert curve.load_pair(secret) == pair  # not replaced
    assert keys_generate(tmp_path / "keys", "worker-a", "--force").returncode == 0
    assert curve.load_pair(secret) != pair


def test_key_files_that_cannot_work_are_refused_by_name(tmp_path: Path) -> None:
    public, secret = curve.generate(tmp_path, "b")
    os.chmod(secret, 0o644)
    with pytest.raises(curve.CurveError, match=r"open to others.*chmod 600"):
        curve.load_pair(secret)
    with pytest.raises(curve.CurveError, match="public key only"):
        curve.load_pair(public)
    (tmp_path / "junk.key").write_text("nothing here\n")
    with pytest.raises(curve.CurveError, match="junk.key"):
        curve.load_public(tmp_path / "junk.key")
    with pytest.raises(curve.CurveError, match="bad key name"):
        curve.generate(tmp_path, "../escape")


def test_the_authorized_folder_is_read_again_when_it_changes(tmp_path: Path) -> None:
    keys, auth = tmp_path / "keys", tmp_path / "auth"
    auth.mkdir()
    a_pub, _ = curve.generate(keys, "a")
    b_pub, _ = curve.generate(keys, "b")
    own = curve.load_public(curve.generate(keys, "own")[0])
    shutil.copy(a_pub, auth)
    (auth / "broken.key").write_text("not a key\n")  # skipped, the others still count
    refused = Counter("refused_for_test", "test", ["socket"], registry=None)
    authorized = curve.AuthorizedKeys(auth, {own}, refused)
    a, b = curve.load_public(a_pub), curve.load_public(b_pub)
    assert authorized.callback("backend", a) and authorized.callback("backend", own)
    assert not authorized.callback("backend", b)
    assert refused.labels("backend")._value.get() == 1
    shutil.copy(b_pub, auth)       # a new key: in at its next handshake
    assert authorized.callback("frontend", b)
    (auth / "a.key").unlink()      # a removed one: out at its next handshake
    assert not authorized.callback("frontend", a)
    assert refused.labels("frontend")._value.get() == 1


def run_broker(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    rt = short_tmpdir("zsrt")
    try:
        return subprocess.run([sys.executable, "-m", "zeroserve.broker.server.main",
                               "--model-dir", str(tmp_path), "--runtime-dir", str(rt), *args],
                              capture_output=True, text=True, timeout=30)
    finally:
        shutil.rmtree(rt, ignore_errors=True)


def test_tcp_beyond_loopback_needs_curve_and_control_never_goes_there(tmp_path: Path) -> None:
    out = run_broker(tmp_path, "--backend", "tcp://0.0.0.0:5555")
    assert out.returncode == 2
    assert "refusing to bind tcp://0.0.0.0:5555" in out.stderr
    assert "--curve-secret-key" in out.stderr
    _, secret = curve.generate(tmp_path / "keys", "broker")
    out = run_broker(tmp_path, "--control", "tcp://0.0.0.0:5557", "--curve-secret-key", str(secret))
    assert out.returncode == 2 and "the control socket" in out.stderr
    out = run_broker(tmp_path, "--curve-authorized-keys", str(tmp_path))
    assert out.returncode == 2 and "needs --curve-secret-key" in out.stderr


def test_the_keys_come_from_the_config_file_like_every_option(tmp_path: Path) -> None:
    _, broker_secret = curve.generate(tmp_path / "keys", "broker")
    _, worker_secret = curve.generate(tmp_path / "keys", "w")
    path = tmp_path / "zeroserve.toml"
    path.write_text(f'''[broker]
backend = "tcp://0.0.0.0:5555"
curve_secret_key = "{broker_secret}"
curve_authorized_keys = "{tmp_path}"
[worker]
backend = "tcp://broker-host:5555"
curve_server_key = "{tmp_path / 'keys' / 'broker.key'}"
curve_secret_key = "{worker_secret}"
''')
    security = curve.server_security(options.parse(["broker", "--config", str(path)]))
    assert security is not None and security.keys.folder == tmp_path
    keys = curve.client_keys(options.parse(["worker", "--config", str(path)]))
    assert keys == curve.ClientKeys(security.pair.public, curve.load_pair(worker_secret))


def test_a_client_beyond_loopback_without_keys_is_told_at_once() -> None:
    with pytest.raises(curve.CurveError, match="beyond loopback.*--curve-server-key"):
        Client("tcp://10.1.2.3:5556")
    with pytest.raises(curve.CurveError, match="needs both"):
        curve.client_keys(type("Args", (), {"curve_server_key": "x", "curve_secret_key": None}))


@contextlib.contextmanager
def curve_broker(tmp_path: Path) -> Iterator[tuple[Broker, Endpoints, Path]]:
    """A real broker loop on a thread; frontend and backend on loopback tcp:// with Curve."""
    keys, auth, repo = tmp_path / "keys", tmp_path / "auth", tmp_path / "repo"
    rt = short_tmpdir("zsrt")
    auth.mkdir()
    repo.mkdir()
    curve.generate(keys, "broker")
    shutil.copy(curve.generate(keys, "client")[0], auth)
    curve.generate(keys, "intruder")
    args = type("Args", (), {"curve_secret_key": str(keys / "broker.key_secret"),
                             "curve_authorized_keys": str(auth)})
    security = curve.server_security(args)
    assert security is not None
    endpoints = Endpoints(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}",
                          f"ipc://{rt}/control")
    ctx: zmq.Context[Any] = zmq.Context()
    loop = BrokerLoop(endpoints, ctx, security)
    b = Broker(repo, to_client=loop.to_client, to_worker=loop.to_worker,
               to_controller=loop.to_controller, ctx=ctx, lifecycle=LifecycleOptions())
    security.register(b.metrics.registry)
    b.load_catalog()
    b.start(loop.poller)
    thread = threading.Thread(target=loop.run, args=(b,), daemon=True)
    thread.start()
    try:
        yield b, endpoints, keys
    finally:
        b.request_stop()
        thread.join(10)
        b.close()
        loop.close(0)
        security.close()
        ctx.destroy(linger=0)
        shutil.rmtree(rt, ignore_errors=True)


def client_keys(keys: Path, name: str, server: str = "broker") -> curve.ClientKeys:
    return curve.ClientKeys(curve.load_public(keys / f"{server}.key"),
                            curve.load_pair(keys / f"{name}.key_secret"))


def refused_count(endpoint: str, socket: str) -> float:
    with Client(endpoint) as c:
        text = c.control("metrics")["broker"]
    found = re.search(rf'zeroserve_curve_refused_total{{socket="{socket}"}} (\S+)', text)
    return float(found.group(1)) if found else 0.0


@pytest.mark.slow   # waits out 1 s connect bounds
def test_only_authorized_keys_get_through_and_the_others_hear_why(tmp_path: Path) -> None:
    with curve_broker(tmp_path) as (_, ep, keys):
        with Client(ep.frontend, curve_keys=client_keys(keys, "client")) as c:
            assert c.control("ping") == {"ok": True}
        started = time.monotonic()
        with Client(ep.frontend, curve_keys=client_keys(keys, "intruder"),
                    connect_timeout_s=10) as c:
            with pytest.raises(InferError) as err:
                c.control("ping")
        assert err.value.code is ErrorCode.UNAUTHORIZED and "authorized keys" in err.value.message
        assert time.monotonic() - started < 5  # told at once: ZeroMQ never retries it
        assert refused_count(ep.control, "frontend") == 1
        # no Curve at all, or the wrong broker key: a handshake failure, within the bound
        # (3 s: ZeroMQ retries these, so the client waits it out; a full run on a loaded
        # host saw no handshake event within 1 s and heard "not reachable")
        for keys_used in (None, client_keys(keys, "client", server="intruder")):
            with Client(ep.frontend, curve_keys=keys_used, connect_timeout_s=3) as c:
                with pytest.raises(InferError) as err:
                    c.control("ping")
            assert err.value.code is ErrorCode.UNAVAILABLE and "handshake" in err.value.message

        async def async_intruder() -> InferError:
            client = AsyncClient(ep.frontend, curve_keys=client_keys(keys, "intruder"))
            await client.start()
            try:
                assert not await client.wait_connected(1.0)
                with pytest.raises(InferError) as err:
                    await client.control("ping")
                return err.value
            finally:
                await client.close()

        got = asyncio.run(async_intruder())
        assert got.code is ErrorCode.UNAUTHORIZED
        wait_for(lambda: refused_count(ep.control, "frontend") == 2, 5, "the second refusal")
