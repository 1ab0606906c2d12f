"""Pinning CPU workers to cores (``zeroserve serve --pin-workers``, ``zeroserve worker
--cpus``).

A CPU worker left to the scheduler wakes on whichever core is free, so each batch
starts with caches that the gateway or the broker just filled; pinned, it keeps its own.
Measured on the 2-core host with ``mlp``, one worker pinned to one core and everything
else free to use both, same runs: direct C=1 p50 1.35 -> 1.15 ms, direct C=64
10,350-10,400 -> 11,050-11,340 req/s, HTTP at C=64 level. It is opt-in: two servers on
one host would pin their workers to the same cores. GPU workers are not pinned here (a
GPU host pins by NUMA node, with systemd's ``CPUAffinity=`` or the Kubernetes CPU
manager).
"""

from __future__ import annotations

import os


def parse_cpus(text: str) -> set[int]:
    """``"0-3,6"`` -> {0, 1, 2, 3, 6}; ValueError with the reason otherwise."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad CPU list {text!r}: expected numbers and ranges, "
                             f"like 0-3,6")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"bad CPU list {text!r}: range {part} runs backwards")
        cpus.update(range(first, last + 1))
    return cpus


def format_cpus(cpus: list[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))


def plan(workers: int, threads: int, usable: list[int]) -> list[list[int]] | None:
    """Each worker's cores, ``threads`` of them, taken from the last usable core down
    (the first cores stay freer for the gateway and the broker, which are not pinned);
    None when the workers' threads outnumber the cores (pinning would stack them)."""
    cores = sorted(usable)
    if workers < 1 or threads < 1 or workers * threads > len(cores):
        return None
    top = len(cores)
    return [cores[top - (i + 1) * threads:top - i * threads] for i in range(workers)]


def pin(cpus: set[int]) -> None:
    """Every thread of this process to ``cpus``, and so every thread they start later
    (ZeroMQ's, torch's); ``import torch`` has started one already. OSError when the
    process may not run there (outside its cpuset)."""
    os.sched_setaffinity(0, cpus)   # first, so a bad set fails before anything changed
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:
            pass   # it ended meanwhile
