"""The gateway's settings (``zeroserve gateway``'s options), read by the parts the app
builds; nothing here imports a part."""

from __future__ import annotations

from dataclasses import dataclass

from zeroserve.broker import __version__
from zeroserve.broker.curve import ClientKeys
from zeroserve.gateway import readiness
from zeroserve.gateway.tenantgate import DEFAULT_METRICS_ALLOW

__all__ = ["EXTENSIONS", "Settings"]

# exactly what this gateway implements; system_shared_memory only when it is on
EXTENSIONS = ["binary_tensor_data", "schedule_policy", "model_configuration",
              "classification", "logging", "statistics", "model_repository", "trace"]


@dataclass
class Settings:
    frontend: str
    max_body_bytes: int = 64 << 20
    broker_timeout_s: float = 3.0
    admin_token: str = ""      # management routes from anywhere with it; loopback only without
    control: str = ""          # the broker's control socket (default: beside the frontend)
    readiness: str = readiness.STRICT
    server_name: str = "zeroserve"
    server_version: str = __version__
    allow_shared_memory: bool = False
    shed_lag_ms: float = 50.0  # shed at the door while the event loop is this far behind
    max_in_flight: int = 2048  # inference requests in the gateway at most (0: no bound)
    curve_keys: ClientKeys | None = None  # a broker on tcp:// with CurveZMQ (broker/curve.py)
    # with tenants, who may scrape /metrics without the admin token (tenantgate.py)
    metrics_allow: str = DEFAULT_METRICS_ALLOW
    trace_config: tuple[str, ...] = ()   # Triton's --trace-config entries (gateway/tracing.py)
    shared_port: bool = False   # one of several processes on the port: a trace file each

    @property
    def control_endpoint(self) -> str:
        if self.control:
            return self.control
        base, _, _ = self.frontend.rpartition("/")
        return f"{base}/control"

    def extensions(self) -> list[str]:
        return EXTENSIONS + (["system_shared_memory"] if self.allow_shared_memory else [])
