"""The device suite's parts (tests/gpu/suite.py), one process each:

    python -m tests.gpu.parts NAME --device cuda:0 --out FILE.json [--quick]

Each writes ``{"figures": {...}, "checks": [...], "notes": [...]}``: its figures with
the in-process baseline measured in the same run, and each of the issue's targets as a
check (value, target, verdict). SIGTERM (the suite's budget) stops a part cleanly: the
servers it started are stopped on the way out. ``--quick`` shortens every load (the
rehearsal on a CPU host).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Callable

from tests.conftest import ROOT, ZEROSERVE, Server
from zeroserve.broker.client import Client

# the gpu-marked tests, and the files that hold them
GPU_TESTS = ["tests/models/test_aoti.py", "tests/workers/test_memory.py",
             "tests/workers/test_memplan.py", "tests/workers/test_hosttier_gpu.py",
             "tests/e2e/test_gpu_bert.py"]
# tests of any host that mean more on a GPU: two workers sharing one device
DEVICE_TESTS = ["tests/workers/test_device_map.py"]


def check(name: str, value: float | None, target: str, ok: bool | None) -> dict[str, Any]:
    return {"check": name, "value": value, "target": target, "ok": ok}


def at_least(name: str, value: float | None, bound: float, unit: str = "") -> dict[str, Any]:
    return check(name, value, f">= {bound:g}{unit}", None if value is None else value >= bound)


def at_most(name: str, value: float | None, bound: float, unit: str = "") -> dict[str, Any]:
    return check(name, value, f"<= {bound:g}{unit}", None if value is None else value <= bound)


class GpuSampler:
    """The worker's device as its heartbeats report it (``zeroserve status``: NVML's
    utilization and memory), sampled in a thread, so the suite reads the same signal an
    operator does and holds no CUDA context of its own."""

    def __init__(self, srv: Server, every_s: float = 0.25) -> None:
        self.samples: list[tuple[float, dict[str, Any]]] = []
        self._srv, self._every_s = srv, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with Client(self._srv.control, timeout_s=5) as c:
            while not self._stop.wait(self._every_s):
                for w in c.control("status")["workers"]:
                    if w.get("memory", {}).get("gpu"):
                        self.samples.append((time.monotonic(), w["memory"]["gpu"]))

    def __enter__(self) -> "GpuSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(10)

    def busy(self, start: float, end: float) -> float | None:
        seen = [g["utilization"] for t, g in self.samples
                if start <= t <= end and g.get("utilization") is not None]
        return round(sum(seen) / len(seen), 3) if seen else None


def gpu_signals(srv: Server, sampler: GpuSampler) -> dict[str, Any]:
    """What the workers' GPU signals looked like: status samples, the last reading, and
    which of their series the one scrape of /metrics holds."""
    with urllib.request.urlopen(srv.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return {"status_samples": len(sampler.samples),
            "last": sampler.samples[-1][1] if sampler.samples else None,
            "metrics": [m for m in ("zeroserve_gpu_utilization_ratio",
                                    "zeroserve_gpu_driver_memory_bytes") if m in text]}


def worker_device(srv: Server) -> str:
    with Client(srv.control, timeout_s=10) as c:
        return str(c.control("status")["workers"][0]["device"])


# -- the parts ---------------------------------------------------------------------------
def environment(device: str, quick: bool) -> dict[str, Any]:
    code = """
import json, torch
out = {"torch": torch.__version__, "cuda": torch.version.cuda,
       "cudnn": torch.backends.cudnn.version(), "gpu_count": torch.cuda.device_count()}
if torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    out.update(gpu_name=props.name, capability=f"{props.major}.{props.minor}",
               gpu_memory_bytes=props.total_memory)
try:
    import pynvml
    pynvml.nvmlInit()
    out["driver"] = pynvml.nvmlSystemGetDriverVersion()
except Exception as exc:   # no binding, no driver: said, not fatal
    out["driver"] = None
    out["nvml"] = f"{type(exc).__name__}: {exc}"
# what the parts need beyond torch: a part whose package is missing fails on its own
from importlib import metadata
out["packages"] = {}
for name in ("zeroserve", "nvidia-ml-py", "transformers", "tokenizers", "openai",
             "tritonclient", "pytest", "pytest-timeout", "hypothesis"):
    try:
        out["packages"][name] = metadata.version(name)
    except metadata.PackageNotFoundError:
        out["packages"][name] = None
print(json.dumps(out))
"""
    got = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True,
                                    text=True, check=True, timeout=120).stdout)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain",
                                 "--untracked-files=no"], capture_output=True,
                                text=True).stdout.strip())
    got.update(python=platform.python_version(), cpus=os.cpu_count(), commit=commit,
               dirty=dirty, host=platform.node(), load_avg=os.getloadavg()[0])
    missing = [n for n, v in got["packages"].items() if v is None]
    return {"figures": got, "notes": ([] if got.get("driver") else
                                      [f"no NVML: {got.get('nvml')} (GPU busy shares will "
                                       "be absent)"]) +
            ([f"not installed: {', '.join(missing)} (the parts that need them fail)"]
             if missing else [])}


def _pytest(args: list[str], tests: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    """One pytest run; each test's outcome, time and reason into ``tests``."""
    xml = Path(os.environ.get("TMPDIR", "/tmp")) / f"zs-gpu-tests-{os.getpid()}.xml"
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p",
                          "no:cacheprovider", f"--junitxml={xml}", *args],
                         cwd=ROOT, capture_output=True, text=True)
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        outcome, why = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                why = (node.get("message") or "")[:300]
        tests[name] = {"outcome": outcome, "s": round(float(case.get("time", 0)), 1),
                       **({"why": why} if why else {})}
    xml.unlink(missing_ok=True)
    return out


def gpu_tests(device: str, quick: bool) -> dict[str, Any]:
    tests: dict[str, Any] = {}
    out = _pytest(["-m", "gpu", *GPU_TESTS], tests)
    both = _pytest(DEVICE_TESTS, tests)
    counts = {k: sum(t["outcome"] == k for t in tests.values())
              for k in ("passed", "failed", "error", "skipped")}
    checks = [check(f"test {n}", None, "passes", None if t["outcome"] == "skipped"
                    else t["outcome"] == "passed") for n, t in tests.items()]
    return {"figures": {"counts": counts, "tests": tests,
                        "pytest_exit": [out.returncode, both.returncode]},
            "checks": checks,
            "notes": [line for o in (out, both) for line in o.stdout.strip().splitlines()[-2:]]}


def data_path(device: str, quick: bool) -> dict[str, Any]:
    from tests.gpu import datapath

    return {"figures": datapath.measure(device, reps=10 if quick else 50),
            "notes": ["medians in ms; h2d, compute and d2h from CUDA events, *_wall_ms what "
                      "the thread waited; a data path change is measured against these"]}


def _bench(srv: Server, repo: Path, model: str, transport: str, concurrency: int,
           warmup_s: float, duration_s: float, device: str, sampler: GpuSampler
           ) -> dict[str, Any]:
    """``zeroserve bench`` at one level with its in-process baseline on ``device``; the
    GPU's busy share over the counted window."""
    path = srv.runtime / f"bench-{model}-{transport}.json"
    cmd = [*ZEROSERVE, "bench", "-m", model, "--transport", transport, "--url", srv.url,
           "--endpoint", srv.frontend, "--concurrency", str(concurrency), "--warmup-s",
           str(warmup_s), "--duration-s", str(duration_s), "--in-process",
           "--in-process-device", device, "--model-dir", str(repo), "--json", str(path),
           "--quiet"]
    start = time.monotonic()
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    doc = json.loads(path.read_text())
    (row,) = doc["levels"]
    inproc = row.get("in_process_samples_per_s")
    # the counted window: after the bench's start-up (about a second) and its warm-up
    window = (start + 1.0 + warmup_s, start + 1.0 + warmup_s + duration_s)
    batch, compute_ms = row.get("server_batch_mean"), row.get("server_compute_ms")
    return {"rps": row["throughput_rps"], "p50_ms": row["p50_ms"], "p99_ms": row["p99_ms"],
            "errors": row["error_count"], "batch_mean": batch,
            "in_process_at_batch_per_s": inproc,
            "served_share": round(row["throughput_rps"] / inproc, 3) if inproc else None,
            "gpu_busy": sampler.busy(*window),
            # without NVML: the share of the wall time the worker spent in batches
            # (batches/s x compute per batch), an upper bound of the device's busy share
            "worker_busy_share": round(row["throughput_rps"] / batch * compute_ms / 1000, 3)
            if batch and compute_ms else None}


def cnn(device: str, quick: bool) -> dict[str, Any]:
    from tests.bench import harness

    repo = harness.example_repo({"cnn": {}})
    srv = harness.start(repo)
    figures: dict[str, Any] = {"worker_device": worker_device(srv)}
    checks = []
    try:
        with GpuSampler(srv) as sampler:
            for transport in ("http-binary", "direct"):
                got = _bench(srv, repo, "cnn", transport, 64, 1 if quick else 3,
                             2 if quick else 8, device, sampler)
                figures[transport] = got
                nvml = got["gpu_busy"] is not None
                checks += [at_least(f"{transport}: served / in-process at C=64",
                                    got["served_share"], 0.8),
                           at_least(f"{transport}: GPU busy at C=64 "
                                    f"({'NVML' if nvml else 'worker batch time: no NVML'})",
                                    got["gpu_busy" if nvml else "worker_busy_share"], 0.85)]
        figures["gpu_signals"] = signals = gpu_signals(srv, sampler)
        checks.append(check("GPU signals (NVML) in zeroserve status and /metrics",
                            len(signals["metrics"]), "both series, status samples",
                            bool(signals["status_samples"]) and len(signals["metrics"]) == 2
                            if device.startswith("cuda") else None))
    finally:
        srv.stop()
    return {"figures": figures, "checks": checks,
            "notes": ["in-process: the model alone on the device at the mean batch the "
                      "broker formed, inputs already there (zeroserve bench --in-process)"]}


def memory(device: str, quick: bool) -> dict[str, Any]:
    from tests.gpu import unload

    got = unload.measure(device, (64 << 20) if quick else (1 << 30))
    notes = got.pop("notes")
    # on a CPU the tier keeps the weights resident: the targets are the device's
    cuda = device.startswith("cuda")
    return {"figures": got, "notes": notes, "checks": [
        at_most("device memory used after the unload, over before the load (NVML)",
                got["unload_excess_pct"] if cuda else None, 5.0, "%"),
        at_most("move back from the host tier / plain to(device)",
                got["move_back_ratio"], 2.0)]}


def turn_phases(device: str, quick: bool) -> dict[str, Any]:
    from tests.bench import bench_turn_phases

    got = bench_turn_phases.measure(device, 20 if quick else 200)
    turn_cpu = sum(got["phases"][k]["cpu_us"] for k in ("park", "take back")) + \
        got["phases"]["first batch"]["cpu_us"] - got["phases"]["kept batch"]["cpu_us"]
    got["worker_cpu_per_turn_us"] = round(turn_cpu, 1)
    return {"figures": got, "notes": ["a turn's CPU here: park + take back + (first batch "
                                      "- kept batch), the worker's own functions in process"]}


def load_on_demand(device: str, quick: bool) -> dict[str, Any]:
    from tests.bench import bench_turns
    from tests.bench.bench_broker import Checkout

    tree = {"this tree": Checkout(None)}
    turns = bench_turns.turns(tree, 2 if quick else 4, 50 if quick else 150)["this tree"]
    zipf = bench_turns.zipf(tree, 2 if quick else 4, 1.0 if quick else 3.0)["this tree"]
    return {"figures": {"turns": turns, "zipf": zipf}, "checks": [
        at_most("worker CPU per turn (served, on demand less all loaded)",
                turns["per_turn"]["worker_us"], 1500, " us"),
        at_least("Zipf(1.1), 12 models, budget of 4, C=16: on demand / all loaded",
                 zipf["ratio"], 0.8)]}


def bert(device: str, quick: bool) -> dict[str, Any]:
    import asyncio
    import warnings

    import torch

    from tests import bert as tb
    from tests.bench import bench_bert
    from tests.bench.harness import short_tmpdir
    from zeroserve.broker.bench.http import Url
    from zeroserve.broker.bench.main import scrape
    from zeroserve.broker.bench import report as br

    repo = short_tmpdir("zssbert")
    with warnings.catch_warnings():   # transformers' and the tracer's
        warnings.simplefilter("ignore")
        module = tb.model(tb.MINI)
        tb.write(repo, "bert_pad", module, padding=tb.PADDING, max_queue_delay_ms=5,
                 max_batch_size=64)
    srv = Server(repo, workers=1).wait_ready(300)
    lengths, figures = (8, 128), {"worker_device": worker_device(srv)}
    try:
        with GpuSampler(srv) as sampler:
            before = scrape(srv.url, "bert_pad")
            start = time.monotonic()
            warm, secs = (1.0, 2.0) if quick else (3.0, 8.0)
            got = asyncio.run(bench_bert.closed_loop(Url.parse(srv.url), "bert_pad", lengths,
                                                     64, warm, secs))
            busy = sampler.busy(start + warm, start + warm + secs)
            split = br.metrics_split(before, scrape(srv.url, "bert_pad"))
    finally:
        srv.stop()
    batch = max(1, round(split.get("server_batch_mean") or 1))
    module.to(device)
    torch.set_num_threads(1)
    inproc = bench_bert.in_process(module, batch, lengths, tb.PADDING, 1.0 if quick else 3.0,
                                   device)
    share = got["rps"] / inproc if inproc else None
    figures.update(rps=round(got["rps"], 1), p50_ms=got["p50_ms"], p99_ms=got["p99_ms"],
                   errors=got["errors"], batch_mean=split.get("server_batch_mean"),
                   in_process_at_batch_per_s=round(inproc, 1), gpu_busy=busy)
    return {"figures": figures, "checks": [
        at_least("bert padded, lengths 8-128, C=64: served / in-process", share, 0.8)],
        "notes": ["HTTP binary tensors; in-process: the same BERT-mini on the device at the "
                  "mean batch formed, lengths from the same draw, padded"]}


def formats(device: str, quick: bool) -> dict[str, Any]:
    import tempfile

    from tests.bench import bench_formats as bf

    with tempfile.TemporaryDirectory(prefix="zssfmt") as tmp:
        module, config, inputs = bf.mlp()
        loaded = bf.build(Path(tmp) / "repo", module, config, inputs, device)
        in_proc = bf.measure(loaded, inputs, 10 if quick else 50)
        for lm in loaded.values():
            lm.release()
        served = bf.served(Path(tmp) / "repo", ["mlp_torchscript", "mlp_aoti"], {},
                           2.0 if quick else 6.0)
    ts, aoti = served["mlp_torchscript"]["c16_rps"], served["mlp_aoti"]["c16_rps"]
    return {"figures": {"in_process_ms": in_proc, "served": served}, "checks": [
        at_least("served mlp at C=16: AOTInductor package / TorchScript",
                 round(aoti / ts, 3) if ts else None, 1.0)]}


def generation(device: str, quick: bool) -> dict[str, Any]:
    """Issue 43's three figures on WORKLOADS' ``lm`` served by a worker on this device,
    each beside its baseline from this run, by the benchmarks' own functions with loads
    that fit the suite: (1) bench_lm's tokens/s, iterative and request-level, against
    ``generate`` on static batches in this process on the same device; (2)
    bench_openai_sse's C=8 streams against the prefill in-process on the device; (3)
    bench_vip's arrivals, the VIP's beside the default priority's."""
    import argparse
    import random
    import shutil

    from tests.bench import bench_lm, bench_openai_sse, bench_vip
    from tests.bench.bench_openai_sse import pct
    from tests.conftest import short_tmpdir
    from tests.lm import prompt_ids, write_lm

    # the rehearsal (a CPU): a smaller model and loads, the figures meaning nothing
    hidden, layers = (64, 2) if quick else (256, 4)
    low, high = (4, 16) if quick else (16, 256)   # max_tokens, uniform
    figures: dict[str, Any] = {"in_process_device": device, "model": f"GPT-2 {layers} "
                               f"layers hidden {hidden}", "max_tokens": [low, high]}
    checks = []
    repos = [short_tmpdir(p) for p in ("zsglm", "zsgsse", "zsgvip")]
    try:
        # (1) C=32, prompts 16-128 tokens: served two ways, then generate in-process
        folder, tokenizer = bench_lm.make_repo(repos[0], hidden, layers, 32)
        rng = random.Random(0)
        asks = [(prompt_ids(tokenizer, i, rng.randint(16, 128)), rng.randint(low, high))
                for i in range(32 if quick else 64)]
        lm: dict[str, Any] = {"concurrency": 32, "requests": len(asks),
                              "asked_tokens": sum(m for _, m in asks)}
        srv = Server(repos[0], workers=1).wait_ready(300)
        try:
            figures["worker_device"] = worker_device(srv)
            for name, model in (("iterative", "lm"), ("request_level", "lm_batches")):
                bench_lm.served(srv, model, asks[:32], 32)   # warm
                rate, ttft, got = bench_lm.served(srv, model, asks, 32)
                lm[name] = {"tokens_per_s": round(rate, 1),
                            "ttft_p50_ms": round(ttft * 1000, 1), "tokens": got}
        finally:
            srv.stop()
        rate, useful = bench_lm.in_process(folder, asks, 32, device)
        lm["in_process_generate"] = {"tokens_per_s": round(rate, 1), "tokens": useful}
        figures["tokens_per_s"] = lm
        served = lm["iterative"]["tokens_per_s"]
        checks += [at_least("C=32 tokens/s: iterative / request-level", round(
                       served / lm["request_level"]["tokens_per_s"], 2), 2.0),
                   at_least("C=32 tokens/s: iterative / generate on static batches of 32, "
                            "in-process on the same device", round(served / rate, 2), 1.2)]

        # (2) C=8 streams over HTTP SSE (the openai client), new requests joining
        folder, tokenizer = write_lm(repos[1], "lm", most=32, hidden=hidden, layers=layers)
        config = json.loads((repos[1] / "lm" / "config.json").read_text())
        config["text"] = {"task": "generate", "max_length": 512}
        (repos[1] / "lm" / "config.json").write_text(json.dumps(config))
        rng = random.Random(5)
        asks = [(prompt_ids(tokenizer, i, rng.randint(16, 128)), rng.randint(low, high))
                for i in range(16 if quick else 48)]
        firsts, gaps, wall = bench_openai_sse.serve(repos[1], asks, 8, None)
        prefill = bench_openai_sse.prefill_s(folder, [ids for ids, _ in asks[:24]], device)
        ttft, gap50, gap99 = (pct(firsts, .5) * 1000, pct(gaps, .5) * 1000,
                              pct(gaps, .99) * 1000)
        figures["sse"] = {"concurrency": 8, "requests": len(asks), "wall_s": round(wall, 1),
                          "ttft_p50_ms": round(ttft, 2),
                          "ttft_p99_ms": round(pct(firsts, .99) * 1000, 2),
                          "prefill_in_process_ms": round(prefill * 1000, 2),
                          "gap_p50_ms": round(gap50, 2), "gap_p99_ms": round(gap99, 2)}
        checks += [at_most("C=8 SSE: time to first token p50 (ms), at most the prefill "
                           "in-process + 5 ms", round(ttft, 2), round(prefill * 1000 + 5, 2),
                           " ms"),
                   at_most("C=8 SSE: gap between tokens p99 / p50", round(gap99 / gap50, 2),
                           2.0)]

        # (3) every slot held at the default priority; VIPs and default arrivals in turns
        _, tokenizer = write_lm(repos[2], "lm", most=8, hidden=hidden, layers=layers,
                                dynamic_batching={"priority_levels": 2,
                                                  "default_priority": 2})
        args = argparse.Namespace(slots=8, arrivals=10 if quick else 100,
                                  vip_tokens=4 if quick else 16)
        results, load, wall = bench_vip.measure(repos[2], tokenizer, args, None)
        step = pct(load.gaps, .5)
        vip: dict[str, Any] = {"slots": 8, "arrivals_each": args.arrivals,
                               "wall_s": round(wall, 1), "step_p50_ms": round(step * 1000, 2)}
        for priority, key in ((1, "vip"), (0, "default_priority_baseline")):
            ttfts = [t for t, _ in results[priority]]
            steps = [float(n) for _, n in results[priority]]
            vip[key] = {"ttft_p50_ms": round(pct(ttfts, .5) * 1000, 2),
                        "ttft_p99_ms": round(pct(ttfts, .99) * 1000, 2),
                        "steps_p50": pct(steps, .5), "steps_p99": pct(steps, .99),
                        "steps_max": max(steps)}
        figures["vip"] = vip
        checks.append(at_most(f"VIP under full load: steps to its first token, p99 over "
                              f"{args.arrivals} arrivals", vip["vip"]["steps_p99"], 2.0))
    finally:
        for repo in repos:
            shutil.rmtree(repo, ignore_errors=True)
    return {"figures": figures, "checks": checks, "notes": [
        "one worker, which takes the device itself (worker_device: the first server's); "
        "in-process baselines in this part's process on in_process_device",
        "(1) tests/bench/bench_lm.py, tokens asked over the wall time; (2) "
        "tests/bench/bench_openai_sse.py, prefill: one forward of a prompt, median; (3) "
        "tests/bench/bench_vip.py, steps: the most tokens any slot got meanwhile",
        f"load average {os.getloadavg()[0]:.1f} at the end"]}


PARTS: dict[str, Callable[[str, bool], dict[str, Any]]] = {
    "environment": environment, "gpu_tests": gpu_tests, "data_path": data_path, "cnn": cnn,
    "memory": memory, "turn_phases": turn_phases, "load_on_demand": load_on_demand,
    "bert": bert, "formats": formats, "generation": generation}


def _stop(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt   # the finally blocks stop the servers


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("part", choices=sorted(PARTS))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="short loads (a rehearsal)")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, _stop)
    doc = PARTS[args.part](args.device, args.quick)
    Path(args.out).write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
