#!/usr/bin/env python3
"""The direct client, sync and asyncio, against a running ``zeroserve serve``.

    zeroserve serve &                       # the example models mlp and cnn
    python tests/bench/example_client.py    # [--runtime-dir DIR]

It finds the broker in the runtime folder, sends one request with the sync client,
then 32 concurrent ones with the asyncio client, and retries what the server says
is retryable (overloaded, no worker, worker lost, broker restarting).
"""

from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np

from zeroserve.broker.client import AsyncClient, Client, InferError
from zeroserve.broker.runtime import Endpoints


def infer_with_retry(client: Client, x: np.ndarray, attempts: int = 5) -> np.ndarray:
    for attempt in range(attempts):
        try:
            return client.infer("mlp", {"input": x}, timeout_ms=1000).outputs["output"]
        except InferError as err:
            if not err.retryable or attempt == attempts - 1:
                raise
            time.sleep(err.retry_after_s or 0.1 * 2 ** attempt)  # noqa: sleep-ok (client back-off)
    raise AssertionError("unreachable")


async def many(frontend: str, n: int) -> list[int]:
    async with AsyncClient(frontend) as client:
        if not await client.wait_connected(5):
            raise SystemExit(f"no broker at {frontend}")
        xs = np.random.default_rng(1).standard_normal((n, 1, 256)).astype(np.float32)
        results = await asyncio.gather(*[client.infer("mlp", {"input": x}, priority=1)
                                         for x in xs])
        return [int(r.outputs["output"].argmax()) for r in results]


def main() -> None:
    ap = argparse.ArgumentParser(description="zeroserve direct client example")
    ap.add_argument("--runtime-dir", default=None, help="the broker's runtime folder")
    args = ap.parse_args()
    from pathlib import Path
    endpoints = Endpoints.in_dir(Path(args.runtime_dir) if args.runtime_dir else None)

    x = np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32)
    with Client(endpoints.frontend) as client:
        out = infer_with_retry(client, x)
        print("sync:", out.shape, "classes", out.argmax(axis=1).tolist())
        models = client.control("models")["models"]
        print("models:", {name: m["ready"] for name, m in models.items()})
    print("asyncio, 32 requests:", asyncio.run(many(endpoints.frontend, 32)))


if __name__ == "__main__":
    main()
