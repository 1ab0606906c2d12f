"""Decoding a KServe v2 JSON infer body in-process: the old way (orjson.loads, then
np.asarray of the data list, kept here as the baseline) against gateway/v2json.loads
(simdjson, the data straight into numpy), in the same run, interleaved, medians.

    .venv/bin/python tests/bench/bench_json_decode.py [--iterations 400]

Bodies as tests/bench/harness.py sends them (json.dumps of the flat float32 list), for
mlp (FP32 [1,256]) and cnn (FP32 [1,3,64,64]), and cnn with nested data. "whole" is
v2.decode_request (document, checks, tensor) on the new path. A few seconds in all.
The gateway reads a body under v2.SIMDJSON_FROM_BYTES the old way: "whole" shows what it
does at each size.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any, Callable

import numpy as np
import orjson

from zeroserve.gateway import v2, v2json


def body(shape: tuple[int, ...], nested: bool) -> bytes:
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    data = x.tolist() if nested else x.reshape(-1).tolist()
    return json.dumps({"inputs": [{"name": "input", "shape": list(shape),
                                   "datatype": "FP32", "data": data}]}).encode()


def old(text: bytes) -> np.ndarray:
    doc = orjson.loads(text)
    return np.asarray(doc["inputs"][0]["data"], dtype=np.float32)


def new(text: bytes) -> np.ndarray:
    data = v2json.loads(text)["inputs"][0]["data"]
    assert isinstance(data, np.ndarray)
    return data


def whole(text: bytes) -> Any:
    return v2.decode_request(text, None)


def medians(text: bytes, ways: list[Callable[[bytes], Any]], n: int) -> list[float]:
    """Median µs of each way, the ways taking turns so drift hits them alike."""
    times: list[list[float]] = [[] for _ in ways]
    for _ in range(n):
        for i, way in enumerate(ways):
            t0 = time.perf_counter()
            way(text)
            times[i].append(time.perf_counter() - t0)
    return [float(np.median(t)) * 1e6 for t in times]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=400)
    args = ap.parse_args()
    cases = [("FP32 [1,64]", (1, 64), False), ("mlp FP32 [1,256]", (1, 256), False),
             ("FP32 [1,1024]", (1, 1024), False),
             ("cnn FP32 [1,3,64,64]", (1, 3, 64, 64), False),
             ("cnn nested data", (1, 3, 64, 64), True)]
    print(f"{'body':<22} {'bytes':>8} {'old µs':>8} {'new µs':>8} {'old/new':>8} {'whole µs':>9}")
    for label, shape, nested in cases:
        text = body(shape, nested)
        np.testing.assert_array_equal(old(text).reshape(shape), new(text).reshape(shape))
        for way in (old, new, whole):   # warm
            way(text)
        o, w, a = medians(text, [old, new, whole], args.iterations)
        print(f"{label:<22} {len(text):>8} {o:>8.1f} {w:>8.1f} {o / w:>7.2f}x {a:>9.1f}")


if __name__ == "__main__":
    main()
