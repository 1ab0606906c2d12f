"""AOTInductor packages: a ``model.pt2`` compiled ahead of time to a shared library
(``torch._inductor.aoti_compile_and_package``, or ``zeroserve compile``), loaded with
``torch._inductor.aoti_load_package`` on the worker's device.

A package is checked before torch opens it, from what the archive says
(models/archives.py), so a package that cannot serve this worker or this config is
refused with the reason instead of failing inside its library: the device it was
compiled for, the torch that compiled it (where the package records it), and the
batch sizes its inputs accept against the config's ``max_batch_size``.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from zeroserve.models import archives
from zeroserve.models.loader import LoadError, Opened, Source

__all__ = ["PadBatch", "load_package", "minor_version"]

# the metadata key zeroserve compile records (inductor's aot_inductor.metadata)
TORCH_VERSION_KEY = "torch_version"


def minor_version(version: str) -> str:
    """``2.13.0+cu128`` -> ``2.13``: patch releases keep the runtime a package links
    against; the local part names the build (cpu, cuda), which the device check covers."""
    return ".".join(version.split("+")[0].split(".")[:2])


def _check_device(src: Source, meta: dict[str, str]) -> None:
    compiled_for = meta.get("AOTI_DEVICE_KEY")
    here = torch.device(src.device).type
    if compiled_for and compiled_for != here:
        raise LoadError(f"{src.path}: an AOTInductor package compiled for {compiled_for}, "
                        f"but this worker runs on {src.device}: compile it for {here} "
                        f"(zeroserve compile --device {here})")


def _check_torch(src: Source, meta: dict[str, str]) -> None:
    compiled_by = meta.get(TORCH_VERSION_KEY)
    if compiled_by and minor_version(compiled_by) != minor_version(torch.__version__):
        raise LoadError(f"{src.path}: an AOTInductor package compiled by torch "
                        f"{compiled_by}, but this worker runs torch {torch.__version__}: "
                        f"compile it again with this torch (zeroserve compile)")


def _batch_low(src: Source) -> int:
    """The smallest batch the package runs (batches below it are padded up to it);
    LoadError where its batch sizes cannot cover the config's max_batch_size."""
    mbs = src.cfg.max_batch_size
    if mbs <= 0:
        return 0
    accepted = archives.aoti_batch_range(src.path, len(src.cfg.inputs))
    if accepted is None:
        raise LoadError(f"{src.path}: the AOTInductor package holds no wrapper source, so "
                        "the batch sizes it takes are unknown: compile it with "
                        "zeroserve compile")
    if accepted.fixed and mbs > 1:
        raise LoadError(f"{src.path}: the AOTInductor package takes a fixed batch of "
                        f"{accepted.low}, but max_batch_size {mbs} needs a dynamic batch "
                        "dimension: export dim 0 with torch.export.Dim (zeroserve compile "
                        "does)")
    if accepted.high is not None and accepted.high < mbs:
        raise LoadError(f"{src.path}: the AOTInductor package takes batches of at most "
                        f"{accepted.high}, but max_batch_size is {mbs}: compile it for "
                        f"{mbs} or lower max_batch_size")
    return accepted.low


def _cut(out: Any, rows: int) -> Any:
    if isinstance(out, torch.Tensor):
        return out[:rows]
    if isinstance(out, (list, tuple)):
        return type(out)(_cut(t, rows) for t in out)
    return out


class PadBatch:
    """A package whose batch dim starts above 1 (torch specializes sizes 0 and 1, so an
    export's dynamic dim is often ``min=2``) answers smaller batches too: their rows are
    padded with copies of the first row up to its minimum, and the outputs cut back."""

    def __init__(self, runner: Any, low: int) -> None:
        self.runner = runner
        self.low = low

    def __call__(self, *inputs: torch.Tensor) -> Any:
        rows = inputs[0].shape[0]
        if rows >= self.low:
            return self.runner(*inputs)
        padded = [torch.cat([x, x[:1].expand(self.low - rows, *x.shape[1:])])
                  for x in inputs]
        return _cut(self.runner(*padded), rows)


def load_package(src: Source) -> Opened:
    meta = archives.aoti_metadata(src.path)
    _check_device(src, meta)
    _check_torch(src, meta)
    low = _batch_low(src)
    # the package checks its inputs' dtypes, dims and device only with this set: without
    # it, a shape the config allows but the package does not is undefined behaviour in
    # its library; with it, an error that fails the one batch
    os.environ.setdefault("AOTI_RUNTIME_CHECK_INPUTS", "1")
    device = torch.device(src.device)
    index = device.index if device.index is not None else (0 if device.type == "cuda" else -1)
    try:
        runner = torch._inductor.aoti_load_package(str(src.path), device_index=index)
    except Exception as exc:  # torch's loader raises RuntimeError and others
        recorded = "" if TORCH_VERSION_KEY in meta else (
            " (the package does not record which torch compiled it: another version "
            "than this worker's is a likely cause)")
        raise LoadError(f"{src.path}: the AOTInductor package does not load{recorded}: "
                        f"{type(exc).__name__}: {exc}") from None
    offset = 1 if src.cfg.max_batch_size > 0 else 0
    free = {(i, dim - offset): n for (i, dim), n in archives.aoti_min_sizes(src.path).items()
            if dim >= offset}
    return Opened(PadBatch(runner, low) if low > 1 else runner, min_sizes=free)
