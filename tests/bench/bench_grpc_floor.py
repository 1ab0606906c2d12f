"""The floor of gRPC in Python on this host: a grpc.aio server on uvloop whose
ModelInfer answers empty bytes at once (no decoding, no broker, no model), loaded by a
grpc.aio client at C=1 and C=64 from another process, as ``zeroserve bench --transport
grpc`` loads the gateway. What the gateway's gRPC figures are read beside
(docs/grpc.md)::

    python -m tests.bench.bench_grpc_floor [--seconds 4]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import time
from typing import Any

import grpc
import uvloop

from tests.conftest import free_port

METHOD = "/inference.GRPCInferenceService/ModelInfer"


def serve(port: int, ready: Any) -> None:
    async def main() -> None:
        async def echo(request: bytes, context: Any) -> bytes:
            return b""
        handler = grpc.method_handlers_generic_handler(
            "inference.GRPCInferenceService",
            {"ModelInfer": grpc.unary_unary_rpc_method_handler(echo)})
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((handler,))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        ready.set()
        await server.wait_for_termination()
    uvloop.run(main())


async def load(port: int, concurrency: int, seconds: float) -> float:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    call = channel.unary_unary(METHOD)
    body = b"x" * 1100   # about mlp's request: 256 FP32 values and the header
    done = 0
    end = time.monotonic() + seconds

    async def stream() -> None:
        nonlocal done
        while time.monotonic() < end:
            await call(body, timeout=10)
            done += 1
    await asyncio.gather(*[stream() for _ in range(concurrency)])
    await channel.close()
    return done / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=4.0)
    args = ap.parse_args()
    port, ready = free_port(), mp.get_context("spawn").Event()
    proc = mp.get_context("spawn").Process(target=serve, args=(port, ready))
    proc.start()
    try:
        ready.wait(30)
        for c in (1, 64):
            print(f"C={c}: {asyncio.run(load(port, c, args.seconds)):,.0f} calls/s "
                  "(grpc.aio echo, client and server on this host)")
    finally:
        proc.terminate()
        proc.join()


if __name__ == "__main__":
    main()
