"""The end-to-end path on ``mlp``: HTTP (wrk) and the direct client at concurrency 1,
16 and 64, beside the model called in-process in the same run.

    .venv/bin/python -m tests.bench.bench_e2e [--seconds 20] [--warmup 3]
"""

from __future__ import annotations

import argparse
import os

from tests.bench import harness as h
from zeroserve.broker.client import Client


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--concurrency", default="1,16,64")
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    threads = max(1, (os.cpu_count() or 1) - 1)  # what zeroserve serve picks
    srv = h.start(h.example_repo({"mlp": {}}), workers=1, threads=threads)
    try:
        body = h.v2_body_file("mlp")
        runs = []
        for c in levels:
            runs.append(h.wrk_load(srv.url + "/v2/models/mlp/infer", body, c,
                                   warmup_s=args.warmup, duration_s=args.seconds,
                                   label=f"HTTP v2 JSON (wrk), C={c}"))
        for c in levels:
            runs.append(h.direct_load(srv.frontend, "mlp", c, warmup_s=args.warmup,
                                      duration_s=args.seconds, label=f"direct client, C={c}"))
        with Client(srv.control) as ctl:
            text = ctl.control("metrics")["broker"]
        batches = h.broker_metric(text, "zeroserve_inference_batch_size_count")
        samples = h.broker_metric(text, "zeroserve_inference_batch_size_sum")
    finally:
        srv.stop()
    mean_batch = samples / batches if batches else 1.0
    sizes = sorted({1, max(1, round(mean_batch)), 16, 64})
    inproc = h.in_process("mlp", sizes, threads)
    print(f"\nmlp, 1 worker with {threads} torch threads; load generator on the same "
          f"{os.cpu_count()} cores")
    print(h.HEADER)
    for run in runs:
        print(h.wrk_row(run) if run.extra else run.row())
    print(f"\nmean batch formed: {mean_batch:.1f} samples over {batches:.0f} batches")
    print("in-process (torch.jit, same threads, no server):")
    for b, ms in inproc.items():
        print(f"  batch {b:>3}: {ms:7.3f} ms/call  ({b / ms * 1000:8.0f} samples/s)")


if __name__ == "__main__":
    main()
