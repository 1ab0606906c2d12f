"""``zeroserve compile``: an exported program (``torch.export.save``) and its model's
config into an AOTInductor package, offline and never on the serving path.

The program is exported again from its own graph with the ranges the config implies:
the batch dim from 1 (or 2, where torch's 0/1 specialization will not let 1 through;
the loader then pads a batch of one) to ``max_batch_size``, and each ``-1`` dim of the
config dynamic. The package records the torch that compiled it, which the loader
checks, and is written under a temp name and renamed, so the repository's watcher only
ever sees a whole file.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.fx.experimental._config as fx_config
from torch.export import Dim

from zeroserve.models import archives
from zeroserve.models.aoti import TORCH_VERSION_KEY
from zeroserve.models.loader import TORCH_DTYPES
from zeroserve.models.repository import ConfigError, ModelConfig, parse_config

__all__ = ["CompileError", "compile_package", "run"]

logger = logging.getLogger(__name__)


class CompileError(Exception):
    """Why a program could not be compiled; names the file."""


def _samples(cfg: ModelConfig, device: str) -> tuple[torch.Tensor, ...]:
    # 2, not 1: a sample of 1 would be specialized to 1 whatever the dynamic shape says
    batch = [min(2, cfg.max_batch_size)] if cfg.max_batch_size > 0 else []
    out = []
    for spec in cfg.inputs:
        if spec.datatype == "BYTES":
            raise CompileError(f"input {spec.name!r} is BYTES: a compiled package takes tensors")
        dims = batch + [d if d > 0 else 2 for d in spec.shape]
        out.append(torch.zeros(dims, dtype=TORCH_DTYPES[spec.datatype], device=device))
    return tuple(out)


def _dynamic_shapes(cfg: ModelConfig, low: int) -> tuple[dict[int, Any], ...]:
    mbs = cfg.max_batch_size
    batch = Dim("batch", min=low, max=mbs) if mbs > 1 else None
    offset = 1 if mbs > 0 else 0
    shapes = []
    for spec in cfg.inputs:
        dims: dict[int, Any] = {i + offset: Dim.DYNAMIC
                                for i, d in enumerate(spec.shape) if d == -1}
        if batch is not None:
            dims[0] = batch
        shapes.append(dims)
    return tuple(shapes)


def _export(module: torch.nn.Module, cfg: ModelConfig, device: str) -> Any:
    """The program with the config's ranges: size-oblivious first (a batch of 1 is
    then one of the dynamic sizes), else with the batch from 2."""
    samples = _samples(cfg, device)
    try:
        with fx_config.patch(backed_size_oblivious=True):
            return torch.export.export(module, samples,
                                       dynamic_shapes=_dynamic_shapes(cfg, 1), strict=False)
    except Exception as exc:  # export raises many kinds; the fallback says if it matters
        logger.info("a batch from 1 did not export (%s: %s); trying from 2",
                    type(exc).__name__, exc)
    try:
        return torch.export.export(module, samples, dynamic_shapes=_dynamic_shapes(cfg, 2),
                                   strict=False)
    except Exception as exc:
        raise CompileError(f"the program does not export with the config's shapes "
                           f"(batch up to {cfg.max_batch_size}, -1 dims dynamic): "
                           f"{type(exc).__name__}: {exc}") from None


def _program(path: Path) -> Any:
    try:
        names = archives.members(path)
    except archives.ArchiveError as exc:
        raise CompileError(str(exc)) from None
    if archives.is_aoti_package(names) or not archives.is_exported_program(names):
        raise CompileError(f"{path}: not an exported program (torch.export.save)")
    return torch.export.load(str(path))


def compile_package(program: Path, cfg: ModelConfig, output: Path,
                    device: str = "cpu") -> archives.BatchRange | None:
    """Compile ``program`` for ``device`` into ``output`` (atomically); returns the
    batch sizes the package takes (None: the model has no batch dim)."""
    module = _program(program).module(check_guards=False).to(device)
    exported = _export(module, cfg, device)
    output.parent.mkdir(parents=True, exist_ok=True)
    # a name the watcher skips (a leading dot) that inductor takes (.pt2 at the end)
    temp = output.with_name(f".{output.stem}.{os.getpid()}.pt2")
    try:
        torch._inductor.aoti_compile_and_package(
            exported, package_path=str(temp),
            inductor_configs={"aot_inductor.metadata": {TORCH_VERSION_KEY: torch.__version__}})
        os.replace(temp, output)
    finally:
        temp.unlink(missing_ok=True)
    if cfg.max_batch_size <= 0:
        return None
    return archives.aoti_batch_range(output, len(cfg.inputs))


def _config(path: Path) -> ModelConfig:
    """config.json, or Triton's config.pbtxt; a name left out is the folder's."""
    if path.suffix == ".pbtxt":
        from zeroserve.models import triton_config   # protobuf only for such a config
        raw = triton_config.read(path)
    else:
        try:
            raw = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"{path}: cannot be read as JSON: {exc}") from None
    if isinstance(raw, dict):
        raw.setdefault("name", path.resolve().parent.name)
    return parse_config(raw, str(path))


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(message)s")
    start = time.monotonic()
    try:
        cfg = _config(Path(args.model_config))
        accepted = compile_package(Path(args.program), cfg, Path(args.output), args.device)
    except (CompileError, ConfigError, OSError, ValueError) as exc:
        print(f"zeroserve compile: {exc}", file=sys.stderr)
        return 1
    batch = "no batch dim" if accepted is None else \
        f"batch {accepted.low or 1}..{accepted.high if accepted.high is not None else 'any'}"
    pad = " (a batch of 1 is padded to 2 when served)" if accepted and accepted.low > 1 else ""
    print(f"{args.output}: AOTInductor package for {args.device}, {batch}{pad}, "
          f"compiled in {time.monotonic() - start:.1f}s")
    return 0
