import subprocess

from zeroserve.broker.runtime import Endpoints, exposed_endpoints
from tests.conftest import ZEROSERVE


def test_only_tcp_beyond_loopback_is_exposed():
    ok = Endpoints("ipc:///tmp/x/frontend", "tcp://127.0.0.1:5555", "tcp://[::1]:5556")
    assert exposed_endpoints(ok) == []
    bad = Endpoints("tcp://0.0.0.0:5555", "tcp://10.1.2.3:5556", "ipc:///tmp/x/control")
    assert exposed_endpoints(bad) == ["tcp://0.0.0.0:5555", "tcp://10.1.2.3:5556"]


def test_broker_refuses_to_bind_beyond_loopback(tmp_path):
    out = subprocess.run([*ZEROSERVE, "broker",
                          "--model-dir", str(tmp_path), "--backend", "tcp://0.0.0.0:0",
                          "--runtime-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "CurveZMQ" in out.stderr
