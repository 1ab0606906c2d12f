"""Worker membership as the broker sees it: credits, loaded models, liveness."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from zeroserve.broker.scheduler import Entry


@dataclass
class Inflight:
    """A batch sent to a worker and not yet answered."""

    batch_id: int
    worker: bytes
    model: str
    version: int
    entries: dict[str, Entry]
    samples: int
    reason: str
    sent_s: float
    exec_deadline_s: float = math.inf


@dataclass
class WorkerState:
    identity: bytes
    worker_id: str
    credits: int
    last_seen_s: float
    info: dict[str, Any] = field(default_factory=dict)
    loaded: set[tuple[str, int]] = field(default_factory=set)
    loading: set[tuple[str, int]] = field(default_factory=set)
    load_errors: dict[str, str] = field(default_factory=dict)
    inflight: set[int] = field(default_factory=set)
    draining: bool = False
    exiting: bool = False
    metrics_text: str = ""
    memory: dict[str, Any] = field(default_factory=dict)

    @property
    def free(self) -> int:
        return 0 if self.draining else self.credits - len(self.inflight)

    def holds(self, model: str, version: int | None = None) -> bool:
        if version is None:
            return any(m == model for m, _ in self.loaded)
        return (model, version) in self.loaded

    def versions_of(self, model: str) -> set[int]:
        return {v for m, v in self.loaded if m == model}

    def describe(self, now: float) -> dict[str, Any]:
        return {
            "id": self.worker_id,
            "state": "draining" if self.draining else "ready",
            "credits": self.credits,
            "inflight_batches": len(self.inflight),
            "models": sorted(f"{m}/{v}" for m, v in self.loaded),
            "loading": sorted(f"{m}/{v}" for m, v in self.loading),
            "load_errors": dict(self.load_errors),
            "last_seen_s": round(now - self.last_seen_s, 3),
            "memory": self.memory,
            **{k: v for k, v in self.info.items() if k in ("pid", "host", "device")},
        }


class Membership:
    """Workers by ROUTER identity."""

    def __init__(self) -> None:
        self.workers: dict[bytes, WorkerState] = {}

    def by_id(self, worker_id: str) -> WorkerState | None:
        for w in self.workers.values():
            if w.worker_id == worker_id:
                return w
        return None

    def holders(self, model: str, version: int | None = None) -> list[WorkerState]:
        return [w for w in self.workers.values() if w.holds(model, version)]

    def free_holder(self, model: str) -> WorkerState | None:
        """The least busy worker with a free credit that holds the model."""
        best = None
        for w in self.workers.values():
            if w.free > 0 and w.holds(model):
                if best is None or len(w.inflight) < len(best.inflight):
                    best = w
        return best

    def expired(self, now: float, expiry_s: float) -> list[WorkerState]:
        return [w for w in self.workers.values() if now - w.last_seen_s > expiry_s]
