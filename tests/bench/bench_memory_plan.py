"""Memory prediction against the measured footprint for the bundled models (mlp, cnn)
and a BERT-mini, each as TorchScript and as an exported program (``--compiled``: also
as an AOTInductor package, which takes minutes of compiling).

Two fresh worker processes load both models one after the other, as a worker serving
them would. From the first, the broker's planner learns each model's overhead and
activation term; it then predicts the second worker's footprints (cold: as for a model
never loaded, the archive's weights, the mapped files and the first activations guess;
learned: weights + overhead + activations at the largest batch), which the second
worker measures. A format's runtime (torch.export's) counts in the prediction and the
measurement of the load that brought it into the worker (the worker counts it in its
context, the broker charges it to a worker that has not loaded it): cold, the guess;
learned, what the first worker measured. The activation term, fitted
to warm-up batches of 1 and 8, is also checked against a real batch at the model's
largest size. Prints one table; errors are (predicted - measured) / measured.

    .venv/bin/python tests/bench/bench_memory_plan.py [--device cpu|cuda:0] [--compiled]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from zeroserve.models.footprint import Learned, archive_tensor_bytes, facts, predict, \
    runtime_charge
from zeroserve.models.repository import load_config

WORKER = r'''
import json, sys
from pathlib import Path
import torch
torch.set_num_threads(1)
from zeroserve.broker import protocol as p
from zeroserve.models.loader import sample_inputs
from zeroserve.models.repository import load_config
from zeroserve.workers import memory
from zeroserve.workers.worker import Worker

repo, device, names = Path(sys.argv[1]), sys.argv[2], sys.argv[3].split(",")
probe = memory.settled(lambda: memory.rss_bytes(), device) if device == "cpu" else \
    (lambda: int(torch.cuda.memory_allocated(device)) + int(torch.cuda.memory_reserved(device)))
start = probe() if device == "cpu" else 0
w = Worker("ipc:///nonexistent", "bench/0", device=device)
out = {"context": w.report.context, "models": {}}
for name in names:
    cfg = load_config(repo / name)
    paid = dict(w.report.context.get("runtimes", {}))
    reply = w.loader.load_version(p.LoadModel(name, 1, str(repo / name / "1"), cfg.to_json()))
    assert reply.ok, reply.error
    runtime = sum(w.report.context.get("runtimes", {}).values()) - sum(paid.values())
    lm = w.models[(name, 1)]
    held = [*lm.fn.parameters(), *lm.fn.buffers()] if hasattr(lm.fn, "parameters") else []
    params = sum(t.numel() * t.element_size() for t in held)
    peak = memory.PeakProbe(device)
    real = None
    try:   # a package may refuse the sample's free dims of 1 (it specialized 0 and 1)
        with torch.inference_mode():
            args = sample_inputs(cfg, cfg.max_batch_size, device)
            for _ in range(2):   # the first run at a new size specializes; measure the second
                peak.start()
                lm.fn(*args)
                real = peak.stop()
    except RuntimeError:
        pass
    out["models"][name] = {"plan": reply.memory, "params_bytes": params,
                           "real_activation_at_max_batch": real, "runtime_bytes": runtime,
                           "runtimes_before": paid}
out["worker_growth"] = probe() - start if device == "cpu" else None
print(json.dumps(out))
'''


FORMS = r'''
import json, sys
from pathlib import Path
import torch
sys.path.insert(0, sys.argv[3])
from tests import bert
from zeroserve.models.examples import BUILDERS, CONFIGS

repo = Path(sys.argv[1])
for name in ("mlp", "cnn"):
    torch.manual_seed(0)
    module = BUILDERS[name]().eval()
    shape = CONFIGS[name]["inputs"][0]["shape"]
    batch = torch.export.Dim("batch", min=1, max=CONFIGS[name]["max_batch_size"])
    program = torch.export.export(module, (torch.zeros(2, *shape),),
                                  dynamic_shapes=({0: batch},))
    (repo / f"{name}_export" / "1").mkdir(parents=True)
    torch.export.save(program, str(repo / f"{name}_export" / "1" / "model.pt2"))
    (repo / f"{name}_export" / "config.json").write_text(json.dumps(
        {**CONFIGS[name], "name": f"{name}_export", "platform": "pytorch_export"}))
module = bert.model(bert.MINI)
bert.write(repo, "bert", module)
bert.write(repo, "bert_export", module, "pytorch_export")
if sys.argv[2] == "compiled":
    bert.write(repo, "bert_aoti", module, "pytorch_export", compiled=True)
'''


def build_forms(repo: Path, compiled: bool) -> list[str]:
    """Beside the bundled mlp and cnn: each exported, and a BERT-mini traced and
    exported (and compiled); returns every model's name."""
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", FORMS, str(repo), "compiled" if compiled else "",
                    str(root)], check=True, capture_output=True, timeout=1200)
    names = ["mlp", "cnn", "mlp_export", "cnn_export", "bert", "bert_export"]
    return names + (["bert_aoti"] if compiled else [])


def run_worker(repo: Path, device: str, names: list[str]) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", WORKER, str(repo), device, ",".join(names)],
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def cold_and_measured(repo: Path, name: str, out: dict[str, Any],
                      device: str) -> tuple[int, int, int]:
    """(the first prediction of ``name`` as the broker makes it for the worker that gave
    ``out`` before anything was measured; what that worker's load of it measured, as it
    reports it; the same with a real batch's peak at the model's largest batch in place
    of the activation term its warm-up fitted), each with the format's runtime where
    that load brought it into the worker. The worker's term extrapolates the warm-up's
    batches (1 and 8) to the largest: on a busy CPU the cnn's read 24-41 MB across runs
    where a real batch of 16 peaked at 25 MB each time."""
    cfg, vdir, got = load_config(repo / name), repo / name / "1", out["models"][name]
    host, plan = device == "cpu", got["plan"]
    cold = predict(cfg, vdir, host=host, runtime_bytes=runtime_charge(
        facts(cfg, vdir).runtime, got["runtimes_before"], {}, host)).total_bytes
    real = got["real_activation_at_max_batch"]
    batch = plan["resident_bytes"] + real if real else plan["footprint_bytes"]
    return cold, plan["footprint_bytes"] + got["runtime_bytes"], batch + got["runtime_bytes"]


def pct(pred: float, meas: float) -> str:
    return f"{100.0 * (pred - meas) / meas:+.1f}%" if meas else "-"


def mb(n: float) -> str:
    return f"{n / 1e6:.2f}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--compiled", action="store_true",
                    help="also each model as an AOTInductor package (zeroserve compile)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="zsmem") as tmp:
        repo = Path(tmp) / "models"
        subprocess.run([sys.executable, "-m", "zeroserve.models.examples", str(repo)],
                       check=True, capture_output=True, timeout=120)
        names = build_forms(repo, args.compiled)
        first, second = (run_worker(repo, args.device, names),
                         run_worker(repo, args.device, names))
        rows = []
        for name in names:
            cfg = load_config(repo / name)
            vdir = repo / name / "1"
            a, b = first["models"][name], second["models"][name]
            files = archive_tensor_bytes(vdir / cfg.model_file) or 0
            host, runtime = args.device == "cpu", facts(cfg, vdir).runtime
            cold, meas, real = cold_and_measured(repo, name, second, args.device)
            learned = predict(cfg, vdir, Learned.from_plan(a["plan"]), host=host,
                              runtime_bytes=runtime_charge(runtime, b["runtimes_before"],
                                                           first["context"].get("runtimes", {}),
                                                           host))
            act_pred = learned.activation_bytes
            act_real = b["real_activation_at_max_batch"] or 0
            rows.append((name, cfg.max_batch_size, files, b["params_bytes"], cold,
                         learned.total_bytes, meas, act_pred, act_real,
                         learned.runtime_bytes, real))
    print(f"runtimes (first / second worker): {first['context'].get('runtimes')} / "
          f"{second['context'].get('runtimes')}")
    print(f"device {args.device}; context cost {mb(first['context']['context_bytes'])} / "
          f"{mb(second['context']['context_bytes'])} MB (first / second worker, "
          f"{first['context']['context_method']}); sizes in MB")
    print("| model | max batch | archive tensors | params+buffers | cold prediction | "
          "learned prediction | measured footprint | cold error | learned error | "
          "activations predicted at max batch | measured at max batch | activation error | "
          "measured with a real batch | cold error against it |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, mbs, files, params, cold, learned_b, meas, act_pred, act_real, _, real in rows:
        print(f"| {name} | {mbs} | {mb(files)} | {mb(params)} | {mb(cold)} | {mb(learned_b)} | "
              f"{mb(meas)} | {pct(cold, meas)} | {pct(learned_b, meas)} | {mb(act_pred)} | "
              f"{mb(act_real)} | {pct(act_pred, act_real)} | {mb(real)} | {pct(cold, real)} |")
    if second.get("worker_growth") is not None:
        # between batches a worker holds its context (the runtimes it loaded included)
        # and each version's resident part
        planned = first["context"]["context_bytes"] + sum(r[5] - r[7] - r[9] for r in rows)
        print(f"worker at rest: first worker's context + learned resident predictions "
              f"{mb(planned)} MB; the second worker's resident growth from its start to "
              f"both loaded {mb(second['worker_growth'])} MB "
              f"({pct(planned, second['worker_growth'])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
