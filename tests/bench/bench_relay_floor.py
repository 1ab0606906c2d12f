"""What four ZeroMQ hops cost on this host with no zeroserve code in them: the floor
under the direct path (client -> broker -> worker -> broker -> client), beside the
two-hop floor that ``zeroserve bench --transport ping`` measures, in one run.

    .venv/bin/python -m tests.bench.bench_relay_floor [--rounds 3] [--requests 5000]
        [--model-dir DIR]

Three bare pyzmq processes, laid out as zeroserve's are (ipc:// sockets, a ROUTER on
each side of the relay, DEALERs at both ends), each doing nothing but move frames:

* ``2 hops``: the client's message answered by the relay itself (a ping);
* ``4 hops``: the relay forwards it to an echo process and the echo's answer back;
* ``4 hops + model``: the echo process runs the model (``mlp``, batch 1, one torch
  thread) on each message before answering: the model as it runs in a process that
  sleeps between requests, against its in-process time called back to back.

Prints the p50 and p99 of each, in ms, per round, and the in-process model time,
called back to back and each call after a millisecond asleep (what a process on the
path of one request at a time has between requests).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RELAY = r"""
import sys, zmq
ctx = zmq.Context()
front = ctx.socket(zmq.ROUTER); front.bind(sys.argv[1])
back = ctx.socket(zmq.ROUTER); back.bind(sys.argv[2])
poller = zmq.Poller(); poller.register(front, zmq.POLLIN); poller.register(back, zmq.POLLIN)
echo = None
print("ready", flush=True)
while True:
    events = dict(poller.poll())
    if back in events:
        frames = back.recv_multipart(copy=False)
        if len(frames) == 2:            # the echo introducing itself
            echo = frames[0].bytes
            print("echo", flush=True)
        else:
            front.send_multipart(frames[1:], copy=False)
    if front in events:
        frames = front.recv_multipart(copy=False)
        if frames[-1].bytes == b"ping" or echo is None:
            front.send_multipart(frames, copy=False)
        else:
            back.send_multipart([echo, *frames], copy=False)
"""

# a warmed-up batch-1 call of mlp on one torch thread, for the echo and the in-process timing
MODEL = r"""
def load_model(path):
    import torch
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    model = torch.jit.load(path)
    x = torch.randn(1, 256)
    for _ in range(200):
        model(x)
    return lambda: model(x)
"""

ECHO = MODEL + r"""
import sys, zmq
run = load_model(sys.argv[2]) if sys.argv[2] else None
ctx = zmq.Context()
s = ctx.socket(zmq.DEALER); s.connect(sys.argv[1])
s.send(b"hello")
print("ready", flush=True)
while True:
    frames = s.recv_multipart(copy=False)
    if run is not None:
        run()
    s.send_multipart(frames, copy=False)
"""

INPROCESS = MODEL + r"""
import sys, time
call = load_model(sys.argv[1])
n, t = 3000, time.perf_counter()
for _ in range(n):
    call()
hot = (time.perf_counter() - t) / n * 1000
after_idle = []
for _ in range(1000):
    time.sleep(0.001)  # noqa: sleep-ok - the idle moment a process has between requests
    t = time.perf_counter()
    call()
    after_idle.append(time.perf_counter() - t)
after_idle.sort()
print(hot, after_idle[len(after_idle) // 2] * 1000)
"""


def _start(code: str, *args: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "ready":
        raise RuntimeError(f"{code.split()[1]} did not start")
    return proc


def _measure(endpoint: str, body: bytes, n: int) -> tuple[float, float]:
    import zmq

    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.connect(endpoint)
    for _ in range(200):
        s.send_multipart([b"", body])
        s.recv_multipart()
    lat = []
    for _ in range(n):
        t = time.perf_counter()
        s.send_multipart([b"", body])
        s.recv_multipart()
        lat.append(time.perf_counter() - t)
    s.close(linger=0)
    lat.sort()
    return lat[len(lat) // 2] * 1000, lat[int(len(lat) * 0.99)] * 1000


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--model-dir", default=str(Path.home() / ".cache/zeroserve/examples"))
    args = ap.parse_args(argv)
    model = Path(args.model_dir) / "mlp" / "1" / "model.pt"
    if not model.is_file():
        ap.error(f"{model} not found: run `zeroserve serve` once to build the examples")
    body = os.urandom(1024)   # mlp's input: 256 float32
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        front, back = f"ipc://{tmp}/front", f"ipc://{tmp}/back"
        inproc_ms, idle_ms = map(float, subprocess.run(
            [sys.executable, "-c", INPROCESS, str(model)], capture_output=True, text=True,
            check=True).stdout.split())
        for r in range(args.rounds):
            for label, with_model in (("2 hops", None), ("4 hops", ""),
                                      ("4 hops + model", str(model))):
                procs = [_start(RELAY, front, back)]
                try:
                    if with_model is not None:
                        procs.append(_start(ECHO, back, with_model))
                        assert procs[0].stdout is not None
                        if procs[0].stdout.readline().strip() != "echo":
                            raise RuntimeError("the echo did not reach the relay")
                    p50, p99 = _measure(front, b"ping" if with_model is None else body,
                                        args.requests)
                finally:
                    for proc in procs:
                        proc.kill()
                        proc.wait()
                rows.append({"round": r + 1, "path": label, "p50_ms": round(p50, 3),
                             "p99_ms": round(p99, 3)})
                print(f"round {r + 1}  {label:<15} p50 {p50:.3f} ms  p99 {p99:.3f} ms",
                      flush=True)
    print(f"in-process mlp, batch 1: {inproc_ms:.3f} ms called back to back, "
          f"{idle_ms:.3f} ms (p50) each after 1 ms idle")
    print(json.dumps({"inprocess_ms": round(inproc_ms, 4),
                      "inprocess_after_idle_ms": round(idle_ms, 4), "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
