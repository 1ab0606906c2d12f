"""Loads that retry: a load that failed for a reason that may pass (out of memory, I/O,
a timeout: the worker says so in ``ModelLoaded.transient``) is tried again after an
exponential backoff with jitter, a bounded number of times; one that cannot pass (a
corrupt file, a config the files do not match) is not, as before.

The unit is the content, ``(model, version, sha256)``, not the worker: while that
content backs off, every load of it (a swap's, a worker joining, a restarted worker's)
is parked here, and the retry runs on one worker at a time; the first that succeeds
releases the others. So a load that fails for want of memory never fails on every GPU at
once again, and the bound counts attempts of that content, whichever worker made them:
a worker killed during a retry does not start the count again.

A pure object: the clock comes in as an argument, the random draw is given; the lifecycle
(lifecycle.py) sends what :meth:`take_due` hands back and checks it is still wanted.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable

from zeroserve.broker import protocol as p

Key = tuple[str, int, str]   # model, version, sha256


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 5          # loads of one content in all, the first included
    base_s: float = 1.0        # the wait after the first failure
    max_s: float = 60.0        # no wait longer

    def delay_s(self, failures: int, draw: float) -> float:
        """The wait after ``failures`` failures: doubling from ``base_s`` up to ``max_s``,
        drawn in its upper half (``draw`` in [0, 1)) so that brokers and contents that
        failed together do not come back together, and never shorter than half."""
        ceiling = min(self.max_s, self.base_s * 2.0 ** (failures - 1))
        return ceiling * (0.5 + 0.5 * draw)


@dataclass
class _Backoff:
    failures: int
    reason: str
    due_s: float
    parked: dict[str, p.LoadModel] = field(default_factory=dict)   # worker id -> LOAD
    trying: str | None = None      # the worker running the retry now


def key_of(msg: p.LoadModel) -> Key:
    return (msg.model, msg.version, msg.sha256)


class LoadRetries:
    """The contents that back off after a transient failure, and the loads parked on
    them."""

    def __init__(self, policy: RetryPolicy | None = None,
                 draw: Callable[[], float] = random.random) -> None:
        self.policy = policy or RetryPolicy()
        self._draw = draw
        self._backoffs: dict[Key, _Backoff] = {}
        self._given_up: list[str] = []

    def __bool__(self) -> bool:
        return bool(self._backoffs)

    def failed(self, worker_id: str, msg: p.LoadModel, error: str, transient: bool,
               now: float) -> str | None:
        """A load of ``msg`` failed on ``worker_id``. Returns the wording of the retry to
        come (the load is parked), or None when there is none: the cause cannot pass, or
        the attempts are spent (then the caller fails it as any failure, and the loads
        parked behind it with it: :meth:`given_up`)."""
        key = key_of(msg)
        state = self._backoffs.get(key)
        if transient and state is not None and state.trying != worker_id:
            # a load sent before the backoff began (a swap loads on every worker at
            # once): the same attempt, not one more
            state.parked[worker_id] = msg
            return self._wording(state, now)
        failures = (state.failures if state is not None else 0) + 1
        if not transient or failures >= self.policy.attempts:
            if state is not None:
                self._given_up.extend(state.parked)
                del self._backoffs[key]
            return None
        due_s = now + self.policy.delay_s(failures, self._draw())
        if state is None:
            state = self._backoffs[key] = _Backoff(failures, error, due_s)
        state.failures, state.reason, state.due_s, state.trying = failures, error, due_s, None
        state.parked[worker_id] = msg
        return self._wording(state, now)

    def _wording(self, state: _Backoff, now: float) -> str:
        return (f"attempt {state.failures} of {self.policy.attempts} failed; tried again "
                f"in {max(0.0, state.due_s - now):.1f} s")

    def park(self, worker_id: str, msg: p.LoadModel) -> bool:
        """Whether ``msg`` is for content that backs off: then it waits here for its turn
        rather than being sent."""
        state = self._backoffs.get(key_of(msg))
        if state is None or state.trying == worker_id:
            return False
        state.parked[worker_id] = msg
        return True

    def given_up(self) -> list[str]:
        """The workers whose parked loads went with the last :meth:`failed` that gave up."""
        out, self._given_up = self._given_up, []
        return out

    def succeeded(self, model: str, version: int, sha256: str
                  ) -> list[tuple[str, p.LoadModel]]:
        """The content loaded: its backoff ends; the loads parked on it, to send now."""
        state = self._backoffs.pop((model, version, sha256), None)
        return list(state.parked.items()) if state is not None else []

    def skip(self, worker_id: str, msg: p.LoadModel) -> None:
        """A retry handed out that is no longer wanted there: the next parked load takes
        the turn (the content goes when none is left)."""
        key = key_of(msg)
        state = self._backoffs.get(key)
        if state is not None and state.trying == worker_id:
            state.trying = None
            if not state.parked:
                del self._backoffs[key]

    def take_due(self, now: float) -> list[tuple[str, p.LoadModel]]:
        """The retries due: one worker per content, while none of it is running."""
        out = []
        for state in self._backoffs.values():
            if state.trying is None and state.parked and state.due_s <= now:
                worker_id = next(iter(state.parked))
                state.trying = worker_id
                out.append((worker_id, state.parked.pop(worker_id)))
        return out

    def next_due(self) -> float | None:
        return min((s.due_s for s in self._backoffs.values() if s.trying is None and s.parked),
                   default=None) if self._backoffs else None   # asked every turn

    def worker_left(self, worker_id: str) -> None:
        """Its parked loads go (it loads again when it joins); a retry it ran gives the
        turn to the next worker, at the due time already set."""
        for state in self._backoffs.values():
            state.parked.pop(worker_id, None)
            if state.trying == worker_id:
                state.trying = None

    def forget(self, model: str) -> None:
        """The model was removed, or an operator's reload starts afresh."""
        for key in [k for k in self._backoffs if k[0] == model]:
            del self._backoffs[key]

    def describe(self, model: str, now: float) -> dict[str, Any]:
        """For ``zeroserve models``: per version backing off, the attempts, the last
        reason and when the next one runs."""
        out = {}
        for (name, version, _), s in sorted(self._backoffs.items()):
            if name == model:
                out[str(version)] = {"attempts": s.failures, "of": self.policy.attempts,
                                     "last_error": s.reason,
                                     "next_in_s": round(max(0.0, s.due_s - now), 3),
                                     "running_on": s.trying}
        return {"load_retries": out} if out else {}
