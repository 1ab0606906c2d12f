"""The same model as TorchScript, exported program and AOTInductor package, in process:
ms per call at batch 1, 16 and 64, each format loaded by zeroserve's loader (what a
worker runs), the calls interleaved round by round so a busy host slows all alike; with
``--served``, then each format served by one ``zeroserve serve`` (one worker, one torch
thread) and driven by ``zeroserve bench`` over the direct client at C=1 and C=16.

    python tests/bench/bench_formats.py [--rounds N] [--threads N] [--no-bert] [--served]

mlp is the bundled example (models/examples.py, as the shared make_models.py builds it);
bert is BERT-mini (WORKLOADS: hidden 256, 4 layers, 4 heads, random weights, seed 0),
inputs input_ids and attention_mask INT64 of 16 tokens, run when `transformers` is
installed. Compiling the packages takes a minute or more; it is not timed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch.export import Dim

from zeroserve.models.examples import make_mlp
from zeroserve.models.loader import LoadedModel, load
from zeroserve.models.repository import ModelConfig, parse_config
from zeroserve.workers.compile import compile_package
from zeroserve.workers.memory import rss_bytes

ROOT = Path(__file__).resolve().parents[2]
BATCHES = (1, 16, 64)
FORMATS = ("torchscript", "export", "aoti")
TOKENS = 16


def mlp() -> tuple[torch.nn.Module, dict[str, Any], Callable[[int], tuple[torch.Tensor, ...]]]:
    torch.manual_seed(0)
    config = {"name": "mlp", "max_batch_size": 64,
              "inputs": [{"name": "input", "datatype": "FP32", "shape": [256]}],
              "outputs": [{"name": "output", "datatype": "FP32", "shape": [10]}]}
    return make_mlp().eval(), config, lambda b: (torch.randn(b, 256),)


class BertOutputs(torch.nn.Module):
    def __init__(self, bert: torch.nn.Module) -> None:
        super().__init__()
        self.bert = bert

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Any:
        out = self.bert(input_ids=input_ids, attention_mask=attention_mask)
        return out[0], out[1]


def bert() -> tuple[torch.nn.Module, dict[str, Any], Callable[[int], tuple[torch.Tensor, ...]]]:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=30522, hidden_size=256, num_hidden_layers=4,
                     num_attention_heads=4, intermediate_size=1024,
                     max_position_embeddings=512, torchscript=True)
    config = {"name": "bert", "max_batch_size": 64,
              "inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [-1]},
                         {"name": "attention_mask", "datatype": "INT64", "shape": [-1]}],
              "outputs": [{"name": "last_hidden_state", "datatype": "FP32", "shape": [-1, 256]},
                          {"name": "pooler_output", "datatype": "FP32", "shape": [256]}]}

    def inputs(b: int) -> tuple[torch.Tensor, ...]:
        return (torch.randint(0, 30522, (b, TOKENS)), torch.ones(b, TOKENS, dtype=torch.long))
    return BertOutputs(BertModel(cfg)).eval(), config, inputs


def build(root: Path, module: torch.nn.Module, config: dict[str, Any],
          inputs: Callable[[int], tuple[torch.Tensor, ...]], device: str = "cpu"
          ) -> dict[str, LoadedModel]:
    """The three files, each in its own version folder, loaded by zeroserve's loader on
    ``device`` (the package compiled for it)."""
    sample = inputs(2)
    name = config["name"]
    dirs = {f: root / f"{name}_{f}" / "1" for f in FORMATS}
    for d in dirs.values():
        d.mkdir(parents=True)
    with torch.no_grad():
        torch.jit.save(torch.jit.trace(module, sample), str(dirs["torchscript"] / "model.pt"))
    batch = Dim("batch", min=1, max=config["max_batch_size"])
    shapes = tuple({0: batch, **{i + 1: Dim.DYNAMIC for i, d in enumerate(s["shape"])
                                 if d == -1}} for s in config["inputs"])
    program = torch.export.export(module, sample, dynamic_shapes=shapes, strict=False)
    torch.export.save(program, str(dirs["export"] / "model.pt2"))
    cfg = parse_config({**config, "platform": "pytorch_export"}, "bench")
    start = time.monotonic()
    compile_package(dirs["export"] / "model.pt2", cfg, dirs["aoti"] / "model.pt2", device)
    print(f"  {config['name']}: AOTInductor package compiled in {time.monotonic() - start:.0f}s",
          file=sys.stderr)
    configs: dict[str, ModelConfig] = {
        "torchscript": parse_config({**config, "platform": "pytorch_torchscript"}, "bench"),
        "export": cfg, "aoti": cfg}
    for f, c in configs.items():   # a repository for --served
        (dirs[f].parent / "config.json").write_text(json.dumps(
            {**c.to_json(), "name": f"{name}_{f}", "warmup": {"batch_sizes": [1, 16]}}))
    return {f: load(configs[f], 1, dirs[f], device, rss_bytes) for f in FORMATS}


def measure(loaded: dict[str, LoadedModel], inputs: Callable[[int], tuple[torch.Tensor, ...]],
            rounds: int) -> dict[str, dict[int, float]]:
    """Median ms per call, by format and batch; every round calls every format once at
    every batch size."""
    times: dict[str, dict[int, list[float]]] = {f: {b: [] for b in BATCHES} for f in FORMATS}
    device = next(iter(loaded.values())).device
    args = {b: tuple(t.to(device) for t in inputs(b)) for b in BATCHES}
    cuda = device.startswith("cuda")
    with torch.inference_mode():
        for f in FORMATS:   # first-shape costs are not the steady state
            for b in BATCHES:
                loaded[f].fn(*args[b])
        for _ in range(rounds):
            for b in BATCHES:
                for f in FORMATS:
                    t = time.perf_counter()
                    loaded[f].fn(*args[b])
                    if cuda:   # the call's own time, not its launch
                        torch.cuda.synchronize()
                    times[f][b].append((time.perf_counter() - t) * 1000.0)
    return {f: {b: statistics.median(v) for b, v in by.items()} for f, by in times.items()}


def table(name: str, ms: dict[str, dict[int, float]]) -> str:
    head = f"| {name} | " + " | ".join(f"batch {b} ms/call" for b in BATCHES) + " |"
    lines = [head, "|---|" + "---:|" * len(BATCHES)]
    for f in FORMATS:
        lines.append(f"| {f} | " + " | ".join(f"{ms[f][b]:.3f}" for b in BATCHES) + " |")
    return "\n".join(lines)


def served(repo: Path, names: list[str], bodies: dict[str, Path], seconds: float
           ) -> dict[str, dict[str, float]]:
    """Each model served by one worker (one torch thread), driven by zeroserve bench over
    the direct client: p50 at C=1, requests/s at C=16."""
    runtime = Path(tempfile.mkdtemp(prefix="zsbf", dir="/tmp"))
    zs = [sys.executable, str(ROOT / "bin" / "zeroserve")]
    log = open(runtime / "serve.log", "wb")
    proc = subprocess.Popen([*zs, "serve", "--model-dir", str(repo), "--runtime-dir",
                             str(runtime), "--workers", "1", "--threads", "1",
                             "--http-port", str(free_port()), "--grpc-port", str(free_port())],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    out: dict[str, dict[str, float]] = {}
    try:
        for name in names:
            body = bodies.get(name.rsplit("_", 1)[0])
            cmd = [*zs, "bench", "-m", name, "--transport", "direct", "--runtime-dir",
                   str(runtime), "--concurrency", "1,16", "--warmup-s", "2",
                   "--duration-s", str(seconds), "--json", str(runtime / "b.json"), "--quiet"]
            if body is not None:
                cmd += ["--input-data", str(body)]
            deadline = time.monotonic() + 600
            # until the server is up and the model answers every request (a bench run
            # while it still loads exits 0 with errors)
            while subprocess.run(cmd, capture_output=True).returncode != 0 or any(
                    r["error_count"] or r["p50_ms"] is None
                    for r in json.loads((runtime / "b.json").read_text())["levels"]):
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise SystemExit((runtime / "serve.log").read_text()[-3000:])
                time.sleep(1)  # noqa: sleep-ok (polls a loading server until its deadline)
            rows = json.loads((runtime / "b.json").read_text())["levels"]
            out[name] = {"c1_p50_ms": rows[0]["p50_ms"], "c16_rps": rows[1]["throughput_rps"]}
            print(f"  served {name}: C=1 p50 {out[name]['c1_p50_ms']:.3f} ms, "
                  f"C=16 {out[name]['c16_rps']:.0f} req/s", file=sys.stderr)
    finally:
        proc.terminate()
        proc.wait(60)
        shutil.rmtree(runtime, ignore_errors=True)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def bert_body(path: Path) -> Path:
    """One request of 16 tokens: ids from the vocabulary, the mask all ones."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 30522, (1, TOKENS), generator=g).tolist()[0]
    path.write_text(json.dumps({"inputs": [
        {"name": "input_ids", "datatype": "INT64", "shape": [1, TOKENS], "data": ids},
        {"name": "attention_mask", "datatype": "INT64", "shape": [1, TOKENS],
         "data": [1] * TOKENS}]}))
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--no-bert", action="store_true", help="the mlp only")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch's threads, as a worker's --threads sets them (default: 1)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--served", action="store_true", help="also each format served")
    ap.add_argument("--duration-s", type=float, default=8.0, help="--served: per level")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    workloads = [mlp]
    try:
        import transformers  # noqa: F401
        if not args.no_bert:
            workloads.append(bert)
    except ImportError:
        print("transformers is not installed: bert skipped", file=sys.stderr)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{args.rounds} rounds, median", file=sys.stderr)
    results = {}
    with tempfile.TemporaryDirectory(prefix="zsbench") as tmp:
        for make in workloads:
            module, config, inputs = make()
            loaded = build(Path(tmp) / "repo", module, config, inputs)
            results[config["name"]] = measure(loaded, inputs, args.rounds)
            print(json.dumps(results) if args.json else table(config["name"],
                                                              results[config["name"]]))
            print()
            for lm in loaded.values():
                lm.release()
        if args.served:
            names = [f"{m}_{f}" for m in results for f in FORMATS]
            got = served(Path(tmp) / "repo", names, {"bert": bert_body(Path(tmp) / "bert.json")},
                         args.duration_s)
            print("| served, direct | C=1 p50 ms | C=16 req/s |\n|---|---:|---:|")
            for name, row in got.items():
                print(f"| {name} | {row['c1_p50_ms']:.3f} | {row['c16_rps']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
