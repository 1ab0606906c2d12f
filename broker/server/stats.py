"""Per model version statistics in the shape of Triton's statistics extension.

Measured where the work happens: the queue time by the broker (arrival to the batch
being sent), the compute phases by the worker (``BatchResult.phases_ms``: input
assembly, the model call, output encoding), the total by the broker (arrival to
answer). Response cache hits and misses as Triton counts them (:meth:`cache_hit`).
Triton's counting: a request's queue and compute entries count once per
request and carry the whole batch's phase times; ``batch_stats`` count batches per
batch size (samples); ``inference_count`` counts samples, ``execution_count`` batches.
Cumulative since the version was loaded (``forget`` when it leaves).

A pure class: the request path feeds it, the ``stats`` verb renders it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

PHASES = ("input", "infer", "output")


@dataclass
class Stat:
    count: int = 0
    ns: int = 0

    def add(self, seconds: float, count: int = 1) -> None:
        self.count += count
        ns = int(seconds * 1e9)   # eight times a batch: a test costs less than max()
        if ns > 0:
            self.ns += ns

    def merge(self, other: "Stat") -> None:
        self.count += other.count
        self.ns += other.ns

    def json(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


@dataclass
class VersionStats:
    last_inference_ms: int = 0
    inference_count: int = 0
    execution_count: int = 0
    success: Stat = field(default_factory=Stat)
    fail: Stat = field(default_factory=Stat)
    queue: Stat = field(default_factory=Stat)
    compute: dict[str, Stat] = field(default_factory=lambda: {k: Stat() for k in PHASES})
    batches: dict[int, dict[str, Stat]] = field(default_factory=dict)
    cache_hit: Stat = field(default_factory=Stat)
    cache_miss: Stat = field(default_factory=Stat)

    def merge(self, other: "VersionStats") -> None:
        self.last_inference_ms = max(self.last_inference_ms, other.last_inference_ms)
        self.inference_count += other.inference_count
        self.execution_count += other.execution_count
        for mine, theirs in ((self.success, other.success), (self.fail, other.fail),
                             (self.queue, other.queue), (self.cache_hit, other.cache_hit),
                             (self.cache_miss, other.cache_miss)):
            mine.merge(theirs)
        for k in PHASES:
            self.compute[k].merge(other.compute[k])
        for size, phases in other.batches.items():
            row = self.batches.setdefault(size, {k: Stat() for k in PHASES})
            for k in PHASES:
                row[k].merge(phases[k])


def phase_seconds(phases_ms: dict[str, float], compute_ms: float
                  ) -> tuple[float, float, float]:
    """The seconds of each of :data:`PHASES`, in that order (a tuple: no dict built, twice
    a batch). A worker that does not split its compute time reports it all as ``infer``."""
    if not phases_ms:
        return 0.0, compute_ms / 1000.0, 0.0
    get = phases_ms.get
    return (float(get("input", 0.0)) / 1000.0, float(get("infer", 0.0)) / 1000.0,
            float(get("output", 0.0)) / 1000.0)


class ModelStatistics:
    """Keyed by (model, version); a request failed before its version was chosen is
    kept under version None and shown with the model's default version."""

    def __init__(self, wall_clock: Callable[[], float] = time.time) -> None:
        self._wall = wall_clock
        self._by: dict[tuple[str, int | None], VersionStats] = {}

    def _of(self, model: str, version: int | None) -> VersionStats:
        key = (model, version)
        st = self._by.get(key)
        if st is None:
            st = self._by[key] = VersionStats()
        return st

    # -- feeding (the request path) ------------------------------------------
    def batch_done(self, model: str, version: int, samples: int,
                   phases_ms: dict[str, float], compute_ms: float) -> None:
        st = self._of(model, version)
        st.execution_count += 1
        st.inference_count += samples
        st.last_inference_ms = int(self._wall() * 1000)
        row = st.batches.get(samples)
        if row is None:
            row = st.batches[samples] = {k: Stat() for k in PHASES}
        for k, s in zip(PHASES, phase_seconds(phases_ms, compute_ms)):
            row[k].add(s)

    def request_done(self, model: str, version: int, queue_s: float, total_s: float,
                     phases_ms: dict[str, float], compute_ms: float, count: int = 1) -> None:
        """``count`` requests of one batch answered, ``queue_s`` and ``total_s`` the sums of
        their times (each request counts its batch's whole phase times)."""
        st = self._of(model, version)
        st.success.add(total_s, count)
        st.queue.add(queue_s, count)
        for k, s in zip(PHASES, phase_seconds(phases_ms, compute_ms)):
            st.compute[k].add(s * count, count)

    def cache_hit(self, model: str, version: int, lookup_s: float, total_s: float) -> None:
        """A request answered from the response cache. As Triton counts one: in
        ``success`` and ``queue`` (0 s), not in the compute times, ``inference_count`` or
        ``execution_count``; ``cache_hit`` holds the lookup's time."""
        st = self._of(model, version)
        st.success.add(total_s)
        st.queue.add(0.0)
        st.cache_hit.add(lookup_s)
        st.last_inference_ms = int(self._wall() * 1000)

    def cache_miss(self, model: str, version: int, seconds: float, count: int = 1) -> None:
        """A lookup that found nothing (``count`` 1), or the time to keep its answer once it
        came (``count`` 0): Triton's ``cache_miss`` is the lookup's and the insert's time."""
        self._of(model, version).cache_miss.add(seconds, count)

    def request_failed(self, model: str, version: int | None, total_s: float) -> None:
        self._of(model, version).fail.add(total_s)

    def forget(self, model: str, versions: Iterable[int] | None = None) -> None:
        """A model (or some versions) unloaded: the next load starts from zero."""
        keep = None if versions is None else set(versions)
        for key in [k for k in self._by if k[0] == model]:
            if keep is None or key[1] in keep:
                del self._by[key]

    def retain(self, model: str, versions: Iterable[int]) -> None:
        """Only ``versions`` of the model are served now: the others' figures go (a
        version published and one deleted every 30 s once left a row each for good)."""
        keep = set(versions)
        for key in [k for k in self._by if k[0] == model and k[1] is not None
                    and k[1] not in keep]:
            del self._by[key]

    # -- rendering (the ``stats`` verb) --------------------------------------
    def render(self, model: str, versions: Iterable[int], default: int | None,
               memory: dict[int, list[dict[str, Any]]]) -> list[dict[str, Any]]:
        out = []
        for v in sorted(versions):
            st = VersionStats()
            st.merge(self._by.get((model, v), VersionStats()))
            if v == default:
                st.merge(self._by.get((model, None), VersionStats()))
            out.append(self._json(model, v, st, memory.get(v, [])))
        return out

    @staticmethod
    def _json(model: str, version: int, st: VersionStats,
              memory: list[dict[str, Any]]) -> dict[str, Any]:
        inference = {"success": st.success.json(), "fail": st.fail.json(),
                     "queue": st.queue.json(),
                     **{f"compute_{k}": st.compute[k].json() for k in PHASES},
                     "cache_hit": st.cache_hit.json(), "cache_miss": st.cache_miss.json()}
        return {"name": model, "version": str(version),
                "last_inference": st.last_inference_ms,
                "inference_count": st.inference_count,
                "execution_count": st.execution_count,
                "inference_stats": inference,
                "batch_stats": [{"batch_size": size,
                                 **{f"compute_{k}": row[k].json() for k in PHASES}}
                                for size, row in sorted(st.batches.items())],
                "memory_usage": memory}


def memory_usage(workers: Iterable[Any], model: str) -> dict[int, list[dict[str, Any]]]:
    """Per version, the footprints the workers report in their heartbeats, summed per
    device as Triton's ``memory_usage`` entries (``type`` CPU or GPU, ``id``)."""
    out: dict[int, dict[tuple[str, int], int]] = {}
    for w in workers:
        device = str(w.info.get("device", "cpu"))
        kind = "GPU" if device.startswith("cuda") else "CPU"
        index = int(device.partition(":")[2] or 0) if kind == "GPU" else 0
        for key, size in (w.memory.get("models") or {}).items():
            name, _, v = str(key).rpartition("/")
            if name == model and v.isdigit():
                slot = out.setdefault(int(v), {})
                slot[(kind, index)] = slot.get((kind, index), 0) + int(size)
    return {v: [{"type": t, "id": i, "byte_size": n} for (t, i), n in sorted(slots.items())]
            for v, slots in out.items()}
