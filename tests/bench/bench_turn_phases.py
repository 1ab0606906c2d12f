"""Where a worker's turn of load on demand goes, phase by phase: the worker's own unload
into the host-memory tier and load back from it (``Loader.unload_version`` and
``Loader.load_version``, the real code, in this process, no broker), and the first batch
of the model taken back, beside a batch of a model that stayed loaded. On the device a
worker takes here (``--device`` to choose).

    .venv/bin/python -m tests.bench.bench_turn_phases [--turns 300] [--device cuda:0]

On an H200 a turn cost the worker 4.2 ms of CPU against 0.6 ms on a CPU host
(docs/many-models.md); this names the phase, and the functions under it (cProfile, by
own time: a wait for the device shows as the call that waits, e.g. ``to`` or
``empty_cache``). Five models of 8 MB, four loaded and one parked; each turn takes the
parked one back, runs a batch of 1 on it, and parks the next.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import shutil
import statistics
import time
from typing import Any, Callable

import torch

from tests.bench import bench_many_models as mm
from tests.conftest import linear_config
from zeroserve.broker import protocol as p
from zeroserve.workers.worker import Worker

MODELS = 5


def timed(fn: Callable[[], Any], wall: list[float], cpu: list[float]) -> Any:
    w, c = time.perf_counter(), time.thread_time()
    out = fn()
    cpu.append((time.thread_time() - c) * 1e6)
    wall.append((time.perf_counter() - w) * 1e6)
    return out


def measure(device: str, turns: int, profile_top: int = 14) -> dict[str, Any]:
    """Each phase's median wall and CPU time in microseconds, and the profile's top lines."""
    torch.set_num_threads(1)
    repo = mm.repo_of(MODELS, mm.SIZES["8 MB"])
    try:
        worker = Worker("ipc:///nonexistent", "bench/0", device=device)
        names = [f"m{i}" for i in range(MODELS)]
        msgs = {n: p.LoadModel(n, 1, str(repo / n / "1"), linear_config(n)) for n in names}
        for n in names:   # each read from disk once, then known by its content
            reply = worker.loader.load_version(msgs[n])
            assert reply.ok, reply.error
            msgs[n] = p.LoadModel(n, 1, msgs[n].path, msgs[n].config, sha256=reply.sha256)
        x = torch.from_numpy(mm.X).to(device)
        cuda = device.startswith("cuda")

        def batch(name: str) -> float:
            with torch.inference_mode():
                out = worker.models[(name, 1)].fn(x)
                value = float(out[0, 0].item())   # a copy back: waits for the device
            if cuda:
                torch.cuda.synchronize()
            return value

        for n in names:
            batch(n)
        worker.loader.unload_version(names[0], 1)
        phases: dict[str, tuple[list[float], list[float]]] = {
            k: ([], []) for k in ("park", "take back", "first batch", "kept batch")}
        profile = cProfile.Profile()
        # timed first, then the same turns again under the profiler (its cost stays out
        # of the figures)
        for i in range(turns + turns // 2):
            take, park = names[i % MODELS], names[(i + 1) % MODELS]
            kept = names[(i + 2) % MODELS]
            if i == turns:
                profile.enable()
            reply = timed(lambda: worker.loader.load_version(msgs[take]), *phases["take back"])
            got = timed(lambda: batch(take), *phases["first batch"])
            timed(lambda: worker.loader.unload_version(park, 1), *phases["park"])
            timed(lambda: batch(kept), *phases["kept batch"])
            assert reply.ok and got == float(take[1:]), (reply, got)
        profile.disable()
        for wall, cpu in phases.values():
            del wall[turns:], cpu[turns:]
        hits = worker.loader.host_cache.hits
    finally:
        shutil.rmtree(repo, ignore_errors=True)
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(profile_top)
    lines = out.getvalue().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("ncalls"))
    return {"device": device, "torch": torch.__version__, "turns": turns, "host_hits": hits,
            "phases": {name: {"wall_us": round(statistics.median(wall), 1),
                              "cpu_us": round(statistics.median(cpu), 1)}
                       for name, (wall, cpu) in phases.items()},
            "profile": [line for line in lines[start:] if line.strip()]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--turns", type=int, default=300)
    ap.add_argument("--device", default=mm.worker_device())
    ap.add_argument("--profile-top", type=int, default=14)
    args = ap.parse_args()
    got = measure(args.device, args.turns, args.profile_top)
    print(f"device {args.device}, torch {got['torch']}; {args.turns} turns of 5 models "
          f"of 8 MB, {got['host_hits']} taken back from host memory; medians")
    print(f"  {'phase':<12} {'wall us':>9} {'CPU us':>9}")
    for name, row in got["phases"].items():
        print(f"  {name:<12} {row['wall_us']:>9.0f} {row['cpu_us']:>9.0f}")
    print(f"under a turn (cProfile, own time, {args.turns // 2} turns):")
    print("\n".join("  " + line for line in got["profile"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
