"""The device suite: zeroserve measured on the hardware it is for, in one command that
fits a GPU machine's few minutes, with one JSON and one Markdown report.

    python -m tests.gpu.suite --out DIR [--budget-s 480] [--only NAME,...] [--rehearse]

Each part runs as a process of its own (``python -m tests.gpu.parts NAME``), most
important first: the ``gpu``-marked tests, then the figures of issues 47 and 43, each
beside its in-process baseline from the same run. The suite keeps its own time: a part that would
not fit in what is left is left out, and one that runs past its share (twice its
estimate, or what is left) is stopped (its servers with it) and reported as cut, so
the suite ends within ``--budget-s`` and says what it did not do. Without a CUDA device
every device part is skipped by name; ``--rehearse`` runs them on the CPU with short
loads instead, to test the suite itself (its figures then mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.gpu import report

ROOT = Path(__file__).resolve().parents[2]
GRACE_S = 20.0    # what a stopped part gets to stop its servers before it is killed
RESERVE_S = 5.0   # the report's own writing


@dataclass(frozen=True)
class Part:
    name: str
    estimate_s: float   # its time on an H100 or H200, servers' starts included
    what: str
    cuda: bool = True   # skipped without a CUDA device (unless rehearsed)


PARTS = [
    Part("environment", 15, "device, driver, torch and CUDA versions, the commit", cuda=False),
    Part("gpu_tests", 160, "the gpu-marked tests: AOTInductor on CUDA, BERT end to end, "
         "memory returned after an unload and after a move back from the host tier; and "
         "two workers sharing one device (a device map)"),
    Part("data_path", 25, "a worker's batch phase by phase: assembly, host to device, "
         "compute, device to host (the phases a pinned, streamed data path would change)"),
    Part("cnn", 70, "cnn served at C=64 (HTTP binary, direct) against in-process at the "
         "batches formed; GPU busy share (NVML) and p99"),
    Part("memory", 45, "a 1 GiB model unloaded: NVML's used memory back within 5%; a move "
         "back from the host tier within 2x a plain to(device)"),
    Part("turn_phases", 25, "a worker's turn of load on demand, phase by phase, wall and CPU"),
    Part("load_on_demand", 100, "served turns (every request a load, 5 models, a budget "
         "of 4) and Zipf(1.1) over 12 models of 8 MB, a budget of 4, C=16: on demand "
         "against all loaded"),
    Part("bert", 80, "BERT-mini padded, lengths 8-128, C=64 against in-process at the "
         "batches formed"),
    Part("formats", 120, "an AOTInductor package against TorchScript, served, same run"),
    Part("generation", 90, "issue 43's figures on lm (GPT-2, 4 layers, hidden 256): C=32 "
         "tokens/s iterative against request-level and generate on static batches on the "
         "same device; C=8 SSE first token against the prefill in-process, gap p99/p50; a "
         "VIP's first token in steps under full load"),
]


def part_environment(out: Path, python: str = sys.executable) -> dict[str, str]:
    """The environment the parts run in. Where zeroserve is not installed (a bare copy of
    this tree on a device machine), a link named ``zeroserve`` to the tree, on
    PYTHONPATH, makes it importable as an install would (``zeroserve = .``)."""
    env = dict(os.environ)
    probe = subprocess.run([python, "-c", "import zeroserve.broker"], cwd=out,
                           capture_output=True, timeout=60)
    if probe.returncode == 0:
        return env
    shim = out / "pythonpath"
    shim.mkdir(exist_ok=True)
    link = shim / "zeroserve"
    if not link.is_symlink():
        link.symlink_to(ROOT)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(shim), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def run_part(part: Part, device: str, quick: bool, out: Path, timeout_s: float,
             env: dict[str, str] | None = None) -> dict[str, Any]:
    """One part in its own process group; SIGTERM past ``timeout_s`` (the part stops its
    servers), SIGKILL after the grace."""
    result = out / f"{part.name}.json"
    log = out / f"{part.name}.log"
    cmd = [sys.executable, "-m", "tests.gpu.parts", part.name, "--device", device,
           "--out", str(result)] + (["--quick"] if quick else [])
    start = time.monotonic()
    with open(log, "wb") as sink:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout_s)
            cut = False
        except subprocess.TimeoutExpired:
            cut = True
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                rc = proc.wait(GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                rc = proc.wait()
    took = round(time.monotonic() - start, 1)
    tail = log.read_text(errors="replace").splitlines()[-30:]
    if cut:
        return {"status": "cut", "reason": f"ran past its {timeout_s:.0f} s (budget)",
                "wall_s": took, "log_tail": tail}
    if rc != 0 or not result.is_file():
        return {"status": "failed", "reason": f"exit status {rc}", "wall_s": took,
                "log_tail": tail}
    doc: dict[str, Any] = json.loads(result.read_text())
    return {"status": "ran", "wall_s": took, **doc}


def cuda_device() -> str | None:
    """The first CUDA device as torch names it, asked in a child (this process stays
    free of a CUDA context, which would count in the device's memory figures)."""
    code = "import torch; print('cuda:0' if torch.cuda.is_available() else '')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    return out.stdout.strip() or None


def plan(parts: list[Part], has_cuda: bool, rehearse: bool) -> dict[str, str]:
    """Why each part that cannot run here is left out (absent: it may run)."""
    if has_cuda or rehearse:
        return {}
    return {p.name: "no CUDA device on this host: a device part" for p in parts if p.cuda}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for suite.json, suite.md, logs")
    ap.add_argument("--budget-s", type=float, default=480.0,
                    help="the whole suite's wall time (default 480: 8 minutes)")
    ap.add_argument("--only", default="", help="comma-separated part names")
    ap.add_argument("--rehearse", action="store_true",
                    help="without a CUDA device, run the device parts on the CPU with short "
                         "loads (tests the suite; the figures mean nothing)")
    args = ap.parse_args(argv)
    started = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = set(names) - {p.name for p in PARTS}
    if unknown:
        ap.error(f"--only: no part {sorted(unknown)}; parts: {[p.name for p in PARTS]}")
    parts = [p for p in PARTS if not names or p.name in names or p.name == "environment"]
    device = cuda_device()
    env = part_environment(out)
    left_out = plan(parts, device is not None, args.rehearse)
    quick = device is None
    results: dict[str, dict[str, Any]] = {}
    for part in parts:
        entry = {"what": part.what, "estimate_s": part.estimate_s}
        left = args.budget_s - (time.monotonic() - started) - RESERVE_S
        if part.name in left_out:
            results[part.name] = {**entry, "status": "skipped", "reason": left_out[part.name]}
        elif left < part.estimate_s:
            results[part.name] = {**entry, "status": "skipped", "reason":
                                  f"does not fit: about {part.estimate_s:.0f} s on a GPU, "
                                  f"{max(left, 0):.0f} s of the budget left"}
        else:
            print(f"suite: {part.name} ({left:.0f} s left)", flush=True)
            # twice its estimate at most, so that one part that hangs leaves the rest
            # their time
            share = min(left - GRACE_S, 2 * part.estimate_s)
            results[part.name] = {**entry, **run_part(part, device or "cpu", quick, out,
                                                      max(1.0, share), env)}
        print(f"suite: {part.name}: {results[part.name]['status']}"
              f"{': ' + results[part.name]['reason'] if 'reason' in results[part.name] else ''}",
              flush=True)
    doc = {"suite": "zeroserve device suite (issue 47)", "device": device or "cpu",
           "rehearsal": bool(args.rehearse and device is None),
           "budget_s": args.budget_s, "wall_s": round(time.monotonic() - started, 1),
           "parts": results}
    (out / "suite.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out / "suite.md").write_text(report.markdown(doc))
    print(f"suite: {out / 'suite.json'} and {out / 'suite.md'} in {doc['wall_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
