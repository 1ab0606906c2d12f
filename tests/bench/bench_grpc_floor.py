"""The floor of gRPC in Python on this host: a server whose ModelInfer answers empty
bytes at once (no decoding, no broker, no model), loaded at C=1 and C=64 from another
process, as ``zeroserve bench --transport grpc`` loads the gateway. What the gateway's
gRPC figures are read beside (docs/grpc.md)::

    python -m tests.bench.bench_grpc_floor [--seconds 4] [--rounds 2]

Each pairing of server and client runs in turn, ``--rounds`` times:

- server ``aio``: grpc.aio on uvloop, as the gateway serves; ``aio-await``: the same,
  its handler awaiting once before it answers (the gateway's handler awaits the broker);
  ``sync``: grpc.server with a thread pool; ``sync-loop``: the same, each handler
  handing its work to an asyncio loop in another thread and waiting for it (what the
  gateway would do to serve gRPC from a thread pool beside its loop);
- client ``aio``: grpc.aio, as the bench's gRPC sender; ``sync``: the C-core channel's
  futures with callbacks, as tritonclient.grpc's ``async_infer`` uses it.

For each: calls/s, p50 at C=1, and the CPU each side spent per call (process CPU time
over calls answered): on a host where the client shares the cores, what it spends is
taken from the server.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import resource
import statistics
import threading
import time
from concurrent import futures
from typing import Any

from tests.bench.harness import cpu_s
from tests.conftest import free_port

METHOD = "/inference.GRPCInferenceService/ModelInfer"
SERVICE = "inference.GRPCInferenceService"
BODY = b"x" * 1100   # about mlp's request: 256 FP32 values and the header
SERVERS = ("aio", "aio-await", "sync", "sync-loop")
CLIENTS = ("aio", "sync")


def serve(mode: str, port: int, ready: Any) -> None:
    import grpc
    if mode.startswith("sync"):
        if mode == "sync":
            def echo(request: bytes, context: Any) -> bytes:
                return b""
        else:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, daemon=True).start()

            async def work() -> bytes:
                await asyncio.sleep(0)  # noqa: sleep-ok (the loop hand-off measured)
                return b""

            def echo(request: bytes, context: Any) -> bytes:
                return asyncio.run_coroutine_threadsafe(work(), loop).result()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            SERVICE, {"ModelInfer": grpc.unary_unary_rpc_method_handler(echo)}),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        ready.set()
        server.wait_for_termination()
        return
    import uvloop

    async def main() -> None:
        async def echo(request: bytes, context: Any) -> bytes:
            if mode == "aio-await":
                await asyncio.sleep(0)  # noqa: sleep-ok (the one await measured)
            return b""
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            SERVICE, {"ModelInfer": grpc.unary_unary_rpc_method_handler(echo)}),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        ready.set()
        await server.wait_for_termination()
    uvloop.run(main())


def load_aio(port: int, concurrency: int, seconds: float) -> list[float]:
    import grpc
    import uvloop
    took: list[float] = []

    async def run() -> None:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        call = channel.unary_unary(METHOD)
        await channel.channel_ready()
        end = time.monotonic() + seconds

        async def stream() -> None:
            while (t0 := time.monotonic()) < end:
                await call(BODY, timeout=10)
                took.append(time.monotonic() - t0)
        await asyncio.gather(*[stream() for _ in range(concurrency)])
        await channel.close()
    uvloop.run(run())
    return took


def load_sync(port: int, concurrency: int, seconds: float) -> list[float]:
    import grpc
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    call = channel.unary_unary(METHOD)
    grpc.channel_ready_future(channel).result(10)
    took: list[float] = []
    end = time.monotonic() + seconds
    lock = threading.Lock()
    done = threading.Event()
    live = [concurrency]

    def send() -> None:
        t0 = time.monotonic()
        call.future(BODY, timeout=10).add_done_callback(lambda f: answered(f, t0))

    def answered(f: Any, t0: float) -> None:
        f.result()
        now = time.monotonic()
        with lock:
            took.append(now - t0)
        if now < end:
            send()
            return
        with lock:
            live[0] -= 1
            if not live[0]:
                done.set()
    for _ in range(concurrency):
        send()
    done.wait()
    channel.close()
    return took


def client(mode: str, port: int, concurrency: int, seconds: float, out: Any) -> None:
    before = resource.getrusage(resource.RUSAGE_SELF)
    took = (load_aio if mode == "aio" else load_sync)(port, concurrency, seconds)
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    out.put((len(took), statistics.median(took) * 1000, cpu))



def measure(server: str, cmode: str, concurrency: int, seconds: float) -> str:
    ctx = mp.get_context("spawn")
    port, ready, out = free_port(), ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=serve, args=(server, port, ready))
    proc.start()
    try:
        ready.wait(30)
        before = cpu_s([proc.pid])
        load = ctx.Process(target=client, args=(cmode, port, concurrency, seconds, out))
        load.start()
        calls, p50_ms, client_cpu = out.get(timeout=seconds + 60)
        load.join()
        server_cpu = cpu_s([proc.pid]) - before
    finally:
        proc.terminate()
        proc.join()
    return (f"| {server} | {cmode} | {concurrency} | {calls / seconds:,.0f} | {p50_ms:.2f} "
            f"| {server_cpu / calls * 1e6:.0f} | {client_cpu / calls * 1e6:.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--servers", default=",".join(SERVERS))
    ap.add_argument("--clients", default=",".join(CLIENTS))
    args = ap.parse_args()
    print("| server | client | C | calls/s | p50 ms | server µs/call | client µs/call |\n"
          "|---|---|---|---|---|---|---|")
    for _ in range(args.rounds):
        for concurrency in (1, 64):
            for server in args.servers.split(","):
                for cmode in args.clients.split(","):
                    print(measure(server, cmode, concurrency, args.seconds), flush=True)


if __name__ == "__main__":
    main()
