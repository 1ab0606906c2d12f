"""The in-process baseline of ``zeroserve bench``: load a model version as a worker does
(zeroserve.models.loader) and time direct calls at given batch sizes; print one JSON
line. A process of its own, so the bench (in broker/, torch-free) never holds torch::

    python -m zeroserve.workers.inprocess --model-dir DIR --model mlp --batch-sizes 1,16,64
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from zeroserve.models import loader
from zeroserve.models.repository import ConfigError, list_versions, load_config
from zeroserve.workers.memory import rss_bytes


def _inputs(model: loader.LoadedModel, batch: int) -> list[torch.Tensor]:
    """Random data of the declared shapes (zeros, as warm-up uses, can take fast paths)."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for t in loader.sample_inputs(model.config, batch, model.device, model.min_sizes):
        if t.is_floating_point():
            out.append(torch.randn(t.shape, generator=gen, dtype=t.dtype).to(model.device))
        elif t.dtype == torch.bool:
            out.append(torch.randint(0, 2, t.shape, generator=gen).bool().to(model.device))
        else:
            out.append(torch.randint(0, 100, t.shape, generator=gen, dtype=t.dtype)
                       .to(model.device))
    return out


def _call(model: loader.LoadedModel, args: list[torch.Tensor]) -> Any:
    if model.handler is not None:
        return model.fn({s.name: a for s, a in zip(model.config.inputs, args)})
    return model.fn(*args)


def time_batches(model: loader.LoadedModel, batches: list[int], seconds: float
                 ) -> list[dict[str, Any]]:
    results = []
    cap = model.config.max_batch_size
    with torch.inference_mode():
        for b in batches:
            b = min(b, cap) if cap > 0 else 1
            args = _inputs(model, b)
            for _ in range(3):
                _call(model, args)
            n, start = 0, time.perf_counter()
            while (took := time.perf_counter() - start) < seconds or n < 3:
                _call(model, args)
                if model.device.startswith("cuda"):
                    torch.cuda.synchronize()
                n += 1
            results.append({"batch": b, "calls": n, "ms_per_call": round(took / n * 1000, 4),
                            "samples_per_s": round(n * b / took, 1)})
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zeroserve.workers.inprocess",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", required=True, help="the model repository")
    ap.add_argument("--model", required=True)
    ap.add_argument("--version", type=int, default=None, help="default: the newest")
    ap.add_argument("--batch-sizes", default="1", help="comma-separated, e.g. 1,16,64")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seconds", type=float, default=1.0, help="timed per batch size")
    args = ap.parse_args(argv)
    try:
        batches = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
        if not batches or min(batches) < 1:
            raise ValueError(args.batch_sizes)
    except ValueError:
        ap.error(f"--batch-sizes {args.batch_sizes!r}: expected positive integers, 1,16,64")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    folder = Path(args.model_dir) / args.model
    try:
        cfg = load_config(folder)
        versions = list_versions(folder, cfg)
        version = args.version if args.version is not None else max(versions, default=0)
        if version not in versions:
            raise ConfigError(f"{folder}: no version {version} (found {versions})")
        model = loader.load(cfg, version, folder / str(version), args.device, rss_bytes)
    except (ConfigError, loader.LoadError, OSError) as exc:
        print(f"inprocess: {exc}", file=sys.stderr)
        return 1
    out = {"model": args.model, "version": version, "device": args.device,
           "threads": torch.get_num_threads(), "load_s": round(model.load_s, 3),
           "results": time_batches(model, batches, args.seconds)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
