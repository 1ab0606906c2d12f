"""The CPU the HTTP layer and the infer route spend on a request, without sockets:
uvicorn's httptools protocol (the gateway's, gateway/http1.py) fed keep-alive requests
shaped as ``zeroserve bench`` sends them (mlp's body, 256 FP32 values) on a transport
that only counts writes, and

* an app that answers a fixed body, ASGI's way (``http.request``/``http.response.*``
  messages), against the OneWrite's (the body taken at once, the answer in one call):
  the HTTP layer alone;
* the gateway's own infer route (gateway/fastpath.py, gateway/routes/infer.py: the
  door, the tenant gate, the JSON parse and checks, the tensors, the answer, the
  metrics) with the broker client played by an object that answers at once: all the
  gateway spends on a request but the trip to the broker (the client's encoding, ZeroMQ,
  the wake-up) and the system calls.

    .venv/bin/python -m tests.bench.bench_http1 [--requests 20000] [--repeats 5]

CPU time of this process (``time.process_time``), the best of ``--repeats``: on a
shared host, what another process takes from the cores does not count here. No
syscall is made, so this is the Python (and C) work per request of the layer alone.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import uvicorn
import uvloop
from uvicorn.server import ServerState

import numpy as np

from zeroserve.broker import protocol as p
from zeroserve.broker.tensors import from_numpy
from zeroserve.gateway.fastpath import InferFastPath
from zeroserve.gateway.http1 import ONE_WRITE, InferHttpProtocol
from zeroserve.gateway.inference import InferencePath
from zeroserve.gateway.routes.infer import InferEndpoint
from zeroserve.gateway.shm import SharedMemory
from zeroserve.gateway.tenantgate import TenantGate
from zeroserve.gateway.tracing import for_gateway

BODY_IN = b'{"inputs":[{"name":"input","datatype":"FP32","shape":[1,256],"data":[' + \
    b",".join([b"0.123456789"] * 256) + b"]}]}"
# as zeroserve bench sends it (broker/bench/http.py)
REQUEST = (b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: 127.0.0.1:8080\r\n"
           b"Connection: keep-alive\r\nContent-Length: %d\r\n"
           b"Content-Type: application/json\r\n\r\n" % len(BODY_IN)) + BODY_IN
ANSWER = b'{"model_name":"mlp","model_version":"1","outputs":[{"name":"output",' \
    b'"datatype":"FP32","shape":[1,10],"data":[0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1.0]}]}'
HEADERS = [(b"zeroserve-model-version", b"1")]


class Counting(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, data: Any) -> None:
        self.writes += 1

    def writelines(self, data: Any) -> None:
        self.writes += 1

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 5000), "sockname": ("127.0.0.1", 8080)}.get(
            name, default)

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def asgi_way(scope: Any, receive: Any, send: Any) -> None:
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", b"%d" % len(ANSWER)), *HEADERS]})
    await send({"type": "http.response.body", "body": ANSWER})


async def one_write_way(scope: Any, receive: Any, send: Any) -> None:
    one = scope[ONE_WRITE]
    if one.body() is None:
        raise RuntimeError("the body was expected whole")
    one.answer(200, b"application/json", ANSWER, HEADERS)


class AnsweringClient:
    """The broker client's infer call, answered at once with mlp's output."""

    def __init__(self) -> None:
        self.out = [from_numpy("output", np.linspace(0, 1, 10, dtype=np.float32)[None])]
        self.infer_rows = self.stream = None

    async def infer_tensors(self, model: str, tensors: Any, **kwargs: Any) -> p.InferReply:
        return p.InferReply("1", model, 1, self.out)


async def no_tenants(verb: str, **kwargs: Any) -> dict[str, Any]:
    return {"tenants": False}


class _State:
    infer: InferEndpoint


class _App:   # what InferFastPath reads of the Starlette app: state.infer
    state = _State()


def gateway_route() -> Any:
    path = InferencePath(AnsweringClient(), no_tenants,  # type: ignore[arg-type]
                         TenantGate(no_tenants, "", []), for_gateway(None, False))
    app = _App()
    app.state.infer = InferEndpoint(path, SharedMemory(False), 64 << 20)
    return InferFastPath(app, "127.0.0.1,::1")  # type: ignore[arg-type]


async def run(app: Any, n: int) -> tuple[float, int]:
    config = uvicorn.Config(app, access_log=False, log_config=None, lifespan="off",
                            proxy_headers=False)
    config.load()
    proto = InferHttpProtocol(config, ServerState(), {})
    transport = Counting()
    proto.connection_made(transport)
    start = time.process_time()
    for _ in range(n):
        proto.data_received(REQUEST)
        while proto.tasks:   # the request's task and its answer
            await asyncio.sleep(0)  # noqa: sleep-ok (one turn of the loop: the task runs)
    took = time.process_time() - start
    proto.connection_lost(None)
    return took / n * 1e6, transport.writes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    for label, app in (("HTTP layer, ASGI messages", asgi_way),
                       ("HTTP layer, OneWrite", one_write_way),
                       ("the gateway's infer route, broker answered at once", gateway_route())):
        runs = [uvloop.run(run(app, args.requests)) for _ in range(args.repeats)]
        best = min(r[0] for r in runs)
        print(f"{label}: {best:.1f} µs CPU a request (all: "
              f"{', '.join(f'{r[0]:.1f}' for r in runs)}), "
              f"{runs[0][1] / args.requests:.0f} write(s) a request")


if __name__ == "__main__":
    main()
