"""A model's traffic split, sticky: a routing key hashes to a point in [0, 100) and each
version owns a contiguous range of the points, newest first, as wide as its weight. So
one key sees one version while the weights hold, and when a canary's weight grows its
range grows from the bottom up: every key already on it stays there."""

from __future__ import annotations

import hashlib
from typing import Mapping


def point(model: str, key: str) -> float:
    """Where ``key`` falls in [0, 100) for ``model`` (the model's name decorrelates one
    model's canary from another's)."""
    digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8,
                             person=model.encode()[:16]).digest()
    return int.from_bytes(digest, "big") * 100.0 / 2.0 ** 64


def pick(weights: Mapping[int, int], at: float) -> int:
    """The version whose range holds ``at`` (weights need not sum to 100: the ranges are
    scaled to the total). ``weights`` is not empty and every weight is positive."""
    total = sum(weights.values())
    mark = at * total / 100.0
    for version in sorted(weights, reverse=True):
        mark -= weights[version]
        if mark < 0:
            return version
    return min(weights)
