"""zeroserve beside TorchServe and the bare HTTP ceiling, one run, the same generator.

    python -m tests.bench.bench_peers --torchserve-venv /opt/ts-venv --models mlp,cnn

Per model and concurrency: requests/s, p50 and p99 of
  * zeroserve, ``zeroserve serve --workers N`` for each N of --zeroserve-workers (1 by
    default; TorchServe runs 2 workers), v2 JSON (and --zeroserve-arg extras);
  * TorchServe 0.12 in its own venv (Java 17), batch 32, 5 ms delay, 2 workers, its own
    JSON body, through tests/bench/torchserve_handler.py;
  * the ceiling (mlp only): tests/bench/ceiling_app.py, a Starlette endpoint that only
    parses the body;
all loaded by ``zeroserve bench`` (http-json, http-raw for TorchServe), or with ``--wrk``
by wrk (one thread, tests/bench/post.lua, the same bodies), from this host,
plus CPU milliseconds per request of each server process over the counted window.
TorchServe's venv: python3 -m venv V && V/bin/pip install -c constraints.txt torch
torchserve==0.12.0 torch-model-archiver==0.12.0 pyyaml (and apt-get install openjdk-17-jre).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

from tests.bench.harness import cpu_s, example_repo, sample, start, v2_body_file, wrk_load
from zeroserve.broker.bench.main import scrape
from zeroserve.broker.bench.report import metrics_split
from tests.conftest import free_port, wait_for
from zeroserve.broker.runtime import cache_dir
from zeroserve.workers.supervisor import ensure_examples

HERE = Path(__file__).resolve().parent



def pgrep(pattern: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


def bench_level(argv: list[str], concurrency: int, warmup_s: float, duration_s: float,
                roles: dict[str, Callable[[], list[int]]]) -> dict[str, Any]:
    """One level of ``zeroserve bench``; each role's CPU seconds sampled inside its
    counted window (from 1 s after the warm-up to 0.5 s before the end)."""
    out = Path(tempfile.mkstemp(suffix=".json")[1])
    cmd = [sys.executable, "-m", "zeroserve.broker.bench", *argv, "--concurrency",
           str(concurrency), "--warmup-s", str(warmup_s), "--duration-s", str(duration_s),
           "--json", str(out), "--quiet"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    marks: list[tuple[float, dict[str, float]]] = []
    for at in (1.0 + warmup_s, warmup_s + duration_s - 0.5):
        time.sleep(max(0.0, t0 + at - time.monotonic()))  # noqa: sleep-ok - sampling times
        marks.append((time.monotonic(), {r: cpu_s(f()) for r, f in roles.items()}))
    _, err = proc.communicate(timeout=warmup_s + duration_s + 120)
    if proc.returncode != 0:
        raise SystemExit(f"zeroserve bench failed: {err}")
    row: dict[str, Any] = json.loads(out.read_text())["levels"][0]
    out.unlink()
    (t1, c1), (t2, c2) = marks
    served = row["throughput_rps"] * (t2 - t1)
    row["cpu_ms_per_request"] = {r: 1000 * (c2[r] - c1[r]) / served if served else None
                                 for r in roles}
    return row


def wrk_level(url: str, body: Path, concurrency: int, warmup_s: float, duration_s: float,
              roles: dict[str, Callable[[], list[int]]], model: str = "") -> dict[str, Any]:
    """One level driven by wrk (one thread, tests/bench/post.lua) instead: a warm-up run,
    then the counted run, each role's CPU over it (as bench_level samples it), and for
    zeroserve (``model``) the broker's batch mean over it from /metrics."""
    wrk_load(url, body, concurrency, warmup_s=0.0, duration_s=warmup_s)
    before = scrape(url.split("/v2/")[0], model) if model else None
    t1, c1 = time.monotonic(), {r: cpu_s(f()) for r, f in roles.items()}
    run = wrk_load(url, body, concurrency, warmup_s=0.0, duration_s=duration_s)
    t2, c2 = time.monotonic(), {r: cpu_s(f()) for r, f in roles.items()}
    served = run.extra["rps"] * (t2 - t1)
    row: dict[str, Any] = {"load": concurrency, "throughput_rps": run.extra["rps"],
                           "p50_ms": run.extra["p50"], "p99_ms": run.extra["p99"],
                           "errors": sum(run.errors.values())}
    row["cpu_ms_per_request"] = {r: 1000 * (c2[r] - c1[r]) / served if served else None
                                 for r in roles}
    if model:
        row.update(metrics_split(before, scrape(url.split("/v2/")[0], model)))
    return row


class TorchServe:
    """TorchServe 0.12 from its own venv: archives the model, starts in the foreground
    in its own session, registers the model with batching, always stopped."""

    def __init__(self, venv: Path, model: str, workers: int, batch: int, delay_ms: int) -> None:
        self.work = Path(tempfile.mkdtemp(prefix="zs-ts-"))
        store = self.work / "store"
        store.mkdir()
        src = ensure_examples(cache_dir()) / model
        env = {**os.environ, "PATH": f"{venv / 'bin'}:{os.environ['PATH']}"}
        subprocess.run([str(venv / "bin" / "torch-model-archiver"), "--model-name", model,
                        "--version", "1.0", "--serialized-file", str(src / "1" / "model.pt"),
                        "--handler", str(HERE / "torchserve_handler.py"), "--extra-files",
                        str(src / "config.json"), "--export-path", str(store)],
                       check=True, env=env)
        self.port, mgmt, metrics = free_port(), free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        (self.work / "config.properties").write_text(
            f"inference_address=http://127.0.0.1:{self.port}\n"
            f"management_address=http://127.0.0.1:{mgmt}\n"
            f"metrics_address=http://127.0.0.1:{metrics}\n"
            f"model_store={store}\ndisable_token_authorization=true\n"
            "enable_model_api=true\n")
        self.proc = subprocess.Popen(
            [str(venv / "bin" / "torchserve"), "--start", "--foreground", "--ncs",
             "--disable-token-auth", "--ts-config", str(self.work / "config.properties"),
             "--model-store", str(store)], cwd=self.work, env=env, start_new_session=True,
            stdout=open(self.work / "ts.log", "wb"), stderr=subprocess.STDOUT)
        try:
            wait_for(lambda: self._get(f"http://127.0.0.1:{self.port}/ping"), 90,
                     "TorchServe to answer /ping")
            req = urllib.request.Request(
                f"http://127.0.0.1:{mgmt}/models?url={model}.mar&batch_size={batch}"
                f"&max_batch_delay={delay_ms}&initial_workers={workers}&synchronous=true",
                method="POST")
            urllib.request.urlopen(req, timeout=180).read()
        except BaseException:
            self.stop()
            raise

    @staticmethod
    def _get(url: str) -> bool:
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def pids(self) -> list[int]:
        out = subprocess.run(["pgrep", "-s", str(self.proc.pid)], capture_output=True,
                             text=True)
        return [int(x) for x in out.stdout.split()]

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


class Ceiling:
    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "tests.bench.ceiling_app:app", "--port",
             str(self.port), "--loop", "uvloop", "--http", "httptools", "--no-access-log",
             "--log-level", "warning"], start_new_session=True)
        wait_for(lambda: TorchServe._get(f"{self.url}/v2/models/mlp"), 30,
                 "the ceiling app to answer")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def ts_body(model: str) -> Path:
    path = Path(tempfile.mkstemp(prefix=f"ts-{model}-", suffix=".json")[1])
    path.write_text(json.dumps({"data": sample(model).reshape(-1).tolist()}))
    return path


def run_model(model: str, args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    levels = [int(c) for c in args.concurrency.split(",")]
    w, d = args.warmup_s, args.duration_s
    results: dict[str, list[dict[str, Any]]] = {}
    for n in [int(x) for x in args.zeroserve_workers.split(",")]:
        server = start(example_repo({model: {}}), workers=n, extra=args.zeroserve_arg)
        try:
            roles = {r: (lambda r=r: server.pids(r)) for r in ("gateway", "broker", "worker")}
            results[zeroserve_name(n)] = [
                wrk_level(f"{server.url}/v2/models/{model}/infer", v2_body_file(model), c, w,
                          d, roles, model) if args.wrk else
                bench_level(["-m", model, "--url", server.url], c, w, d, roles) for c in levels]
            for row in results[zeroserve_name(n)]:
                batch = max(1, round(row.get("server_batch_mean") or 1))
                row["model_cpu_ms_per_request"] = model_cpu_ms(model, batch) / batch
                row["model_batch"] = batch
        finally:
            server.stop()
    if args.torchserve_venv:
        ts = TorchServe(Path(args.torchserve_venv), model, 2, 32, 5)
        try:
            raw = ["-m", model, "--url", ts.url, "--transport", "http-raw", "--raw-path",
                   f"/predictions/{model}", "--body-file", str(ts_body(model))]
            results["TorchServe"] = [
                wrk_level(f"{ts.url}/predictions/{model}", ts_body(model), c, w, d,
                          {"all": ts.pids}) if args.wrk else
                bench_level(raw, c, w, d, {"all": ts.pids}) for c in levels]
        finally:
            ts.stop()
    if model == "mlp" and not args.no_ceiling:
        ceiling = Ceiling()
        try:
            results["ceiling"] = [
                wrk_level(f"{ceiling.url}/v2/models/{model}/infer", v2_body_file(model), c,
                          w, d, {"all": lambda: [ceiling.proc.pid]}) if args.wrk else
                bench_level(["-m", model, "--url", ceiling.url], c, w, d,
                            {"all": lambda: [ceiling.proc.pid]}) for c in levels]
        finally:
            ceiling.stop()
    return results


def zeroserve_name(workers: int) -> str:
    return "zeroserve" if workers == 1 else f"zeroserve --workers {workers}"


def cell(row: dict[str, Any]) -> str:
    return f"{row['throughput_rps']:,.0f} req/s, p50 {row['p50_ms']:.1f}, p99 {row['p99_ms']:.1f}"


def cpu_cell(row: dict[str, Any]) -> str:
    return ", ".join(f"{r} {v:.2f}" for r, v in row["cpu_ms_per_request"].items()
                     if v is not None)


def table(model: str, results: dict[str, list[dict[str, Any]]]) -> str:
    names = list(results)
    ours = [n for n in names if n.startswith("zeroserve")]
    peer = "TorchServe" in results
    lines = [f"\n{model}: " + " | ".join(names),
             "| C | " + " | ".join(names) + "".join(f" | {n} / TorchServe" for n in ours
                                                    if peer) + " |",
             "|---" * (len(names) + 1 + len(ours) * peer) + "|"]
    for i, row in enumerate(results[ours[0]]):
        ratios = "".join(
            f" | {results[n][i]['throughput_rps'] / results['TorchServe'][i]['throughput_rps']:.2f}"
            "x"
            for n in ours) if peer else ""
        lines.append(f"| {int(row['load'])} | " + " | ".join(cell(results[n][i]) for n in names)
                     + ratios + " |")
    lines.append("CPU ms per request over the counted window:")
    for n in names:
        lines.append(f"  {n}: " + "; ".join(f"C={int(r['load'])}: {cpu_cell(r)}"
                                            for r in results[n]))
    lines += outside_lines(results, ours)
    return "\n".join(lines)


MODEL_CPU = """
import sys, time, torch
torch.set_num_threads(1)
model = torch.jit.load(sys.argv[1]).eval()
x = torch.randn(int(sys.argv[2]), *map(int, sys.argv[3].split(",")))
with torch.inference_mode():
    for _ in range(5):
        model(x)
    n, start = 0, time.thread_time()
    while time.thread_time() - start < 1.0 or n < 5:
        model(x)
        n += 1
print((time.thread_time() - start) / n * 1000)
"""


def model_cpu_ms(model: str, batch: int) -> float:
    """CPU ms of one call of the model at ``batch``, in a process of its own with one
    torch thread (as the worker runs here): CPU time, which the host's other load
    leaves about as it is, where wall time grew threefold on this shared host."""
    path = ensure_examples(cache_dir()) / model / "1" / "model.pt"
    shape = ",".join(map(str, sample(model).shape[1:]))
    out = subprocess.run([sys.executable, "-c", MODEL_CPU, str(path), str(batch), shape],
                         capture_output=True, text=True, check=True, timeout=120)
    return float(out.stdout.split()[-1])


def outside_lines(results: dict[str, list[dict[str, Any]]], ours: list[str]) -> list[str]:
    """Every server process's CPU a request less the model's own CPU at the batch size
    zeroserve formed (TorchServe, batching up to 32, is charged the same model time,
    which flatters it where its batches are larger)."""
    lines = ["CPU ms per request outside the model (all processes less the model's own "
             "CPU at zeroserve's batch size):"]
    for i, row in enumerate(results[ours[0]]):
        model = row["model_cpu_ms_per_request"]
        cells = {}
        for n in [*ours, "TorchServe"]:
            if n in results:
                used = [v for v in results[n][i]["cpu_ms_per_request"].values() if v is not None]
                cells[n] = sum(used) - model
        text = ", ".join(f"{n} {v:.3f}" for n, v in cells.items())
        if "TorchServe" in cells and cells["TorchServe"] > 0:
            text += "".join(f", {n} / TorchServe {cells[n] / cells['TorchServe']:.2f}x"
                            for n in ours)
        lines.append(f"  C={int(row['load'])} (model {model:.3f} ms at batch "
                     f"{row['model_batch']}): {text}")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="mlp,cnn")
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--warmup-s", type=float, default=3.0)
    ap.add_argument("--duration-s", type=float, default=20.0)
    ap.add_argument("--torchserve-venv", default=None, help="skip TorchServe when not given")
    ap.add_argument("--no-ceiling", action="store_true")
    ap.add_argument("--zeroserve-arg", action="append", default=[],
                    help="extra `zeroserve serve` argument (repeat), e.g. --http-workers=2")
    ap.add_argument("--zeroserve-workers", default="1",
                    help="worker counts to run zeroserve with, each a column (e.g. 1,2: "
                         "TorchServe runs 2)")
    ap.add_argument("--wrk", action="store_true",
                    help="load every server with wrk (one thread, the same bodies) instead "
                         "of zeroserve bench")
    ap.add_argument("--json", default=None, help="write every level's row")
    args = ap.parse_args()
    if args.duration_s < 3:
        raise SystemExit("--duration-s must be at least 3 (CPU is sampled inside the window)")
    every: dict[str, Any] = {}
    for model in args.models.split(","):
        every[model] = run_model(model, args)
        print(table(model, every[model]), flush=True)
    print(f"\nload generator and servers share this host's {os.cpu_count()} cores; "
          "one server runs at a time")
    if args.json:
        Path(args.json).write_text(json.dumps(every, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
