"""The response cache as a pure object (broker/server/cache.py): keys, least recently
used out, the byte bound, invalidation, and the bytes it counts against what an entry
really holds."""

from __future__ import annotations

import gc
import tracemalloc

import numpy as np
from hypothesis import given, strategies as st

from zeroserve.broker import protocol as p
from zeroserve.broker.server.cache import ENTRY_OVERHEAD_BYTES, TENSOR_OVERHEAD_BYTES, \
    ResponseCache, answer_bytes, request_digest


def tensors(values: list[float], name: str = "output") -> list[p.Tensor]:
    return [p.from_numpy(name, np.asarray(values, np.float32).reshape(1, -1))]


def key(n: int, model: str = "m", sha: str = "a" * 64) -> tuple[str, str, bytes]:
    return model, sha, request_digest(tensors([float(n)], "input"), None)


def test_a_kept_answer_comes_back_with_its_version_and_bytes() -> None:
    cache = ResponseCache(1 << 20)
    assert cache.get(key(1)) is None
    assert cache.put(key(1), 3, tensors([1.0, 2.0]))
    found = cache.get(key(1))
    assert found is not None and found.version == 3
    (t,) = found.tensors
    assert t.meta == p.TensorMeta("output", "FP32", (1, 2))
    assert np.frombuffer(t.data, np.float32).tolist() == [1.0, 2.0]
    assert cache.nbytes == ENTRY_OVERHEAD_BYTES + TENSOR_OVERHEAD_BYTES + 8


def test_the_answer_is_copied_out_of_the_workers_message() -> None:
    """Kept as bytes of its own: a view would hold the whole batch's frame alive."""
    frame = bytearray(np.arange(8, dtype=np.float32).tobytes())
    view = memoryview(frame)[:8]
    cache = ResponseCache(1 << 20)
    cache.put(key(1), 1, [p.Tensor(p.TensorMeta("output", "FP32", (1, 2)), view)])
    frame[:8] = bytes(8)
    found = cache.get(key(1))
    assert found is not None and type(found.tensors[0].data) is bytes
    assert np.frombuffer(found.tensors[0].data, np.float32).tolist() == [0.0, 1.0]


def test_the_least_recently_used_goes_first() -> None:
    per_entry = answer_bytes(tensors([0.0]))
    cache = ResponseCache(3 * per_entry)
    for n in range(3):
        cache.put(key(n), 1, tensors([float(n)]))
    assert cache.get(key(0)) is not None      # 0 is now the most recent
    cache.put(key(3), 1, tensors([3.0]))
    assert cache.get(key(1)) is None          # the least recently used went
    assert all(cache.get(key(n)) is not None for n in (0, 2, 3))
    assert len(cache) == 3 and cache.evicted == 1


def test_an_answer_larger_than_the_bound_is_not_kept() -> None:
    cache = ResponseCache(4096)
    cache.put(key(0), 1, tensors([0.0]))
    assert not cache.put(key(1), 1, tensors([0.0] * 2048))
    assert cache.get(key(1)) is None and cache.get(key(0)) is not None   # nothing evicted
    assert cache.nbytes <= 4096


def test_bound_zero_keeps_nothing() -> None:
    cache = ResponseCache(0)
    assert not cache.put(key(0), 1, tensors([0.0]))
    assert len(cache) == 0 and cache.nbytes == 0


@given(st.lists(st.integers(0, 300), min_size=1, max_size=200), st.integers(0, 20_000))
def test_the_bytes_never_exceed_the_bound(sizes: list[int], bound: int) -> None:
    """A stream of distinct answers of any size: at every step, the bytes counted are
    within the bound and are the sum of what the entries count."""
    cache = ResponseCache(bound)
    for i, size in enumerate(sizes):
        cache.put(key(i), 1, tensors([1.0] * size))
        assert cache.nbytes <= bound
        assert cache.nbytes == sum(cache.get(key(j)).nbytes  # type: ignore[union-attr]
                                   for j in range(i + 1) if cache.get(key(j)) is not None)


def test_keeping_the_same_key_again_replaces_it() -> None:
    cache = ResponseCache(1 << 20)
    cache.put(key(0), 1, tensors([0.0]))
    cache.put(key(0), 2, tensors([0.0, 1.0]))
    assert len(cache) == 1 and cache.get(key(0)).version == 2  # type: ignore[union-attr]
    assert cache.nbytes == answer_bytes(tensors([0.0, 1.0]))


def test_retain_drops_retired_versions_and_removed_models() -> None:
    cache = ResponseCache(1 << 20)
    cache.put(key(0, "m", "old"), 1, tensors([0.0]))
    cache.put(key(0, "m", "new"), 2, tensors([0.0]))
    cache.put(key(0, "other", "old"), 1, tensors([0.0]))
    assert cache.retain("m", ["new"]) == 1
    assert cache.get(key(0, "m", "old")) is None and cache.get(key(0, "m", "new")) is not None
    assert cache.retain("other", []) == 1
    assert len(cache) == 1 and cache.nbytes == answer_bytes(tensors([0.0]))


def test_the_digest_names_everything_that_changes_the_answer() -> None:
    base = [p.from_numpy("input", np.ones((1, 4), np.float32))]
    d = request_digest(base, None)
    assert d == request_digest([p.Tensor(base[0].meta, bytes(base[0].data))], None)
    others = [
        [p.from_numpy("input", np.full((1, 4), 2.0, np.float32))],       # bytes
        [p.from_numpy("input", np.ones((2, 2), np.float32))],            # shape
        [p.from_numpy("input", np.ones((1, 4), np.int32))],              # datatype
        [p.from_numpy("other", np.ones((1, 4), np.float32))],            # name
    ]
    digests = {d} | {request_digest(t, None) for t in others}
    digests |= {request_digest(base, ["output"]), request_digest(base, [])}
    assert len(digests) == 7


def test_the_bytes_counted_cover_what_an_entry_holds() -> None:
    """The fixed overhead per entry and tensor is not a guess: what the process allocates
    for many entries is no more than the cache counts for them."""
    cache = ResponseCache(1 << 30)
    answers = [tensors([float(n)] * 16) for n in range(2000)]
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for n, t in enumerate(answers):
            cache.put(key(n), 1, t)   # the key too: made per request, held by the entry
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert 0 < held <= cache.nbytes, (held, cache.nbytes)
