"""A handler that calls models (BLS) chaining two models, against the client calling the
same two models one after the other, in the same run, beside the two models in-process.

    .venv/bin/python -m tests.bench.bench_bls [--seconds 5] [--concurrency 1,16]
        [--transports direct,http]

One ``zeroserve serve`` with one worker (so every call runs on the handler's own worker).
Models: ``pre`` (a Python handler, x * 2 + 1), ``linear`` (TorchScript nn.Linear(16, 16)),
and ``chain`` (a Python handler calling pre, then linear). At concurrency C, C loops of
one AsyncClient (or C keep-alive HTTP connections, KServe v2 JSON) send requests back
to back for ``--seconds``: ``bls`` sends one request to chain; ``client-chained`` awaits
pre's answer, then sends linear's. The load shares the machine's cores with the server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from tests.conftest import Server, linear_config, short_tmpdir, write_model
from zeroserve.broker.bench.http import HttpConnection, Url, request_bytes
from zeroserve.broker.client import AsyncClient

PRE = '''
class Model:
    def load(self, version_dir, device):
        pass

    def predict(self, inputs):
        return {"output": inputs["input"] * 2.0 + 1.0}
'''

CHAIN = '''
class Model:
    def load(self, version_dir, device, models):
        self.models = models

    def predict(self, inputs):
        s = self.models.infer("pre", {"input": inputs["input"]})["output"]
        return {"output": self.models.infer("linear", {"input": s})["output"]}
'''


def repo() -> tuple[Path, Path]:
    root = short_tmpdir("zsbenchbls")
    vdir = write_model(root, "linear", 1, "nn.Linear(16, 16)",
                       linear_config("linear", 16, 16, mbs=64))
    for name, code in (("pre", PRE), ("chain", CHAIN)):
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.py").write_text(code)
        cfg = {**linear_config(name, 16, 16, mbs=64), "platform": "python"}
        (root / name / "config.json").write_text(json.dumps(cfg))
    return root, vdir


async def load(frontend: str, concurrency: int, seconds: float, chained: bool
               ) -> tuple[float, list[float]]:
    x = np.ones((1, 16), np.float32)
    lat: list[float] = []
    async with AsyncClient(frontend) as c:
        assert await c.wait_connected(10)
        stop = time.monotonic() + seconds

        async def loop() -> None:
            while (t := time.monotonic()) < stop:
                if chained:
                    s = (await c.infer("pre", {"input": x})).outputs["output"]
                    await c.infer("linear", {"input": s})
                else:
                    await c.infer("chain", {"input": x})
                lat.append(time.monotonic() - t)
        for _ in range(2):   # warm-up: first calls, latency model
            await c.infer("chain", {"input": x})
        start = time.monotonic()
        await asyncio.gather(*(loop() for _ in range(concurrency)))
        return len(lat) / (time.monotonic() - start), lat


def _v2(url: Url, model: str, data: list[float]) -> bytes:
    body = json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 16],
                                   "data": data}]}).encode()
    return request_bytes(url, "POST", f"/v2/models/{model}/infer", body,
                         {"Content-Type": "application/json"})


async def http_load(base: str, concurrency: int, seconds: float, chained: bool
                    ) -> tuple[float, list[float]]:
    url = Url.parse(base)
    ones = [1.0] * 16
    lat: list[float] = []
    conns = [await HttpConnection.open(url) for _ in range(concurrency)]
    try:
        async def call(conn: HttpConnection, model: str, data: list[float]) -> list[float]:
            r = await conn.send(_v2(url, model, data))
            assert r.status == 200, r.body[:300]
            out: list[float] = json.loads(r.body)["outputs"][0]["data"]
            return out

        async def loop(conn: HttpConnection) -> None:
            while (t := time.monotonic()) < stop:
                if chained:
                    await call(conn, "linear", await call(conn, "pre", ones))
                else:
                    await call(conn, "chain", ones)
                lat.append(time.monotonic() - t)
        await call(conns[0], "chain", ones)
        stop = time.monotonic() + seconds
        start = time.monotonic()
        await asyncio.gather(*(loop(conn) for conn in conns))
        return len(lat) / (time.monotonic() - start), lat
    finally:
        for conn in conns:
            conn.close()


def in_process(vdir: Path, seconds: float = 1.0) -> float:
    module = torch.jit.load(str(vdir / "model.pt"))
    x = torch.ones((1, 16))
    n, start = 0, time.monotonic()
    with torch.inference_mode():
        while time.monotonic() - start < seconds:
            module(x * 2.0 + 1.0)
            n += 1
    return (time.monotonic() - start) / n


def row(name: str, c: int, rps: float, lat: list[float]) -> str:
    q = statistics.quantiles(lat, n=100) if len(lat) > 1 else [lat[0]] * 99
    return (f"{name:<22} C={c:<3} {rps:>9.0f} {statistics.median(lat) * 1000:>9.2f} "
            f"{q[98] * 1000:>9.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--transports", default="direct,http")
    args = ap.parse_args()
    root, vdir = repo()
    srv = Server(root, workers=1).wait_ready()
    try:
        print(f"in-process pre+linear, batch 1: {in_process(vdir) * 1e6:.1f} us")
        print(f"{'path':<22} {'C':<5} {'req/s':>9} {'p50 ms':>9} {'p99 ms':>9}")
        for transport in args.transports.split(","):
            for c in [int(v) for v in args.concurrency.split(",")]:
                for name, chained in (("bls", False), ("client-chained", True)):
                    if transport == "http":
                        rps, lat = asyncio.run(http_load(srv.url, c, args.seconds, chained))
                    else:
                        rps, lat = asyncio.run(load(srv.frontend, c, args.seconds, chained))
                    print(row(f"{transport} {name}", c, rps, lat), flush=True)
    finally:
        srv.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
