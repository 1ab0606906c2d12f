"""What a registration left out, found at its trial load by running the model on zeros.

The seed's registration body gives ``input_shape`` and no ``outputs``, so the worker
that trial-loads it fills both in before warm-up, and the broker writes the result
into the published ``config.json`` (later loads read it and run nothing extra):

- Inputs whose datatype was not given run as FP32; if the model raises, as INT64 (token
  ids); the first that runs is declared. Neither: the load fails, saying how to declare.
- Outputs are what the model returns: ``output__0``, ``output__1``... for a tensor or a
  tuple (Triton's PyTorch names), the keys for a dict (a Python handler's names).
  The datatype is the returned dtype.
- Shapes come from two runs: the first with a batch of 2 and every free input dim
  (-1) 2 long, the second with a batch of 3 and free dims 5 long. A dim that differs
  between the runs is -1; with ``max_batch_size`` > 0 dim 0 must be the batch and is
  left out, as in every config.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Sequence

import numpy as np
import torch

from zeroserve.broker.tensors import DTYPES
from zeroserve.models.loader import DATATYPE_OF, TORCH_DTYPES, LoadedModel, LoadError
from zeroserve.models.repository import ModelConfig, TensorSpec

# (batch rows, length of every free input dim) of the two trial runs
RUNS = ((2, 2), (3, 5))
FALLBACK = ("FP32", "INT64")
_NUMPY_DATATYPE = {dt: name for name, dt in DTYPES.items() if dt is not None}


def complete(loaded: LoadedModel, guessed: Sequence[str]) -> ModelConfig:
    """``loaded.config`` with the ``guessed`` inputs' datatypes settled and, where it has
    none, its outputs found. Raises LoadError saying what to declare."""
    cfg = loaded.config
    where = f"{cfg.name}/{loaded.version}"
    failures: list[str] = []
    for datatype in FALLBACK if guessed else ("",):
        trial = _with_datatype(cfg, guessed, datatype)
        try:
            first = _run(loaded, trial, *RUNS[0])
            break
        except LoadError as exc:
            raise LoadError(f"{where}: {exc}") from None
        except Exception as exc:  # the model's code raises anything
            failures.append(f"{datatype or 'the trial run'}: {_why(exc)}")
    else:
        raise LoadError(_refusal(where, cfg, guessed, failures))
    if trial.outputs:
        return trial
    try:
        second = _run(loaded, trial, *RUNS[1])
    except LoadError as exc:
        raise LoadError(f"{where}: {exc}") from None
    except Exception as exc:
        raise LoadError(f"{where}: the second trial run (batch {RUNS[1][0]}, free dims "
                        f"{RUNS[1][1]}) failed: {_why(exc)}") from None
    return dataclasses.replace(trial, outputs=_outputs(where, trial, first, second))


def _with_datatype(cfg: ModelConfig, guessed: Sequence[str], datatype: str) -> ModelConfig:
    if not datatype:
        return cfg
    inputs = tuple(TensorSpec(s.name, datatype, s.shape) if s.name in guessed else s
                   for s in cfg.inputs)
    return dataclasses.replace(cfg, inputs=inputs)


# what torch says when a tensor's shape, not its dtype, is what the model refuses
_SHAPE_WORDS = re.compile(r"shape|size|dimension|cannot be multiplied", re.I)
_DTYPE_WORDS = re.compile(r"dtype|scalar type|Float|Long|Int\b|Half|Bool", re.I)


def _shape_refusal(cfg: ModelConfig, why: str) -> str | None:
    """Advice about the declared shapes when ``why`` is a shape error (a datatype would
    not help: the wrong datatype is not what the model refused)."""
    if not _SHAPE_WORDS.search(why) or _DTYPE_WORDS.search(why):
        return None
    batch = [1] if cfg.max_batch_size > 0 else []
    shapes = ", ".join(f"{s.name}: {batch + list(s.shape)}" for s in cfg.inputs)
    return (f"the model refused inputs of the declared shapes ({shapes}"
            f"{', the batch dimension first' if batch else ''}): {why}. Check the "
            "shapes in input_shape (or inputs): one sample's shape, after the batch "
            "dimension when max_batch_size > 0")


def _refusal(where: str, cfg: ModelConfig, guessed: Sequence[str],
             failures: list[str]) -> str:
    for failure in failures:   # FP32 refused as a datatype, INT64 for its shape: a shape
        shape = _shape_refusal(cfg, failure.split(": ", 1)[-1])
        if shape is not None:
            return f"{where}: {shape}"
    if not guessed:
        return f"{where}: {failures[0]}"
    example = {s.name: {"shape": ([1] if cfg.max_batch_size > 0 else []) + list(s.shape),
                        "datatype": "INT64"} for s in cfg.inputs if s.name in guessed}
    return (f"{where}: the model runs neither on FP32 nor on INT64 inputs "
            f"({'; '.join(failures)}). Declare each input's datatype in the registration: "
            f'"input_shape": {json.dumps(example)} (any KServe datatype), or give '
            f'"inputs" with datatypes')


def _why(exc: Exception) -> str:
    """One line: a TorchScript error carries the graph's whole traceback, and its last
    line holds the error itself."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    if len(lines) > 1 and "Traceback of TorchScript" in str(exc):
        return lines[-1][:300]
    return f"{type(exc).__name__}: {lines[0][:300] if lines else ''}"


def _run(loaded: LoadedModel, cfg: ModelConfig, batch: int,
         free: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """One run on zeros: {output name: (datatype, shape)} in the order returned."""
    batch = min(batch, cfg.max_batch_size) if cfg.max_batch_size > 0 else 0
    args = [torch.zeros(([batch] if batch else []) + [d if d > 0 else free for d in s.shape],
                        dtype=TORCH_DTYPES[s.datatype], device=loaded.device)
            for s in cfg.inputs]
    with torch.inference_mode():
        if loaded.handler is not None:
            out = loaded.fn({s.name: t for s, t in zip(cfg.inputs, args)})
            if not isinstance(out, dict):
                raise LoadError(f"predict() returned {type(out).__name__}, expected a dict "
                                "of outputs")
            named = list(out.items())
        else:
            named = _module_outputs(loaded.fn(*args))
    return {str(name): _described(str(name), value) for name, value in named}


def _module_outputs(out: Any) -> list[tuple[str, Any]]:
    if isinstance(out, dict):
        return list(out.items())
    if not isinstance(out, (tuple, list)):
        out = (out,)
    return [(f"output__{i}", t) for i, t in enumerate(out)]


def _described(name: str, value: Any) -> tuple[str, tuple[int, ...]]:
    if isinstance(value, torch.Tensor) and value.dtype in DATATYPE_OF:
        return DATATYPE_OF[value.dtype], tuple(value.shape)
    if isinstance(value, np.ndarray):
        datatype = "BYTES" if value.dtype == object else _NUMPY_DATATYPE.get(value.dtype)
        if datatype is not None:
            return datatype, tuple(value.shape)
    what = type(value).__name__ + (f" of dtype {value.dtype}" if hasattr(value, "dtype")
                                   else "")
    raise LoadError(f"output {name!r} is {what}: outputs are found only from tensors or "
                    "numpy arrays; declare \"outputs\" in the registration")


def _outputs(where: str, cfg: ModelConfig, first: dict[str, tuple[str, tuple[int, ...]]],
             second: dict[str, tuple[str, tuple[int, ...]]]) -> tuple[TensorSpec, ...]:
    if list(first) != list(second):
        raise LoadError(f"{where}: the trial runs returned different outputs ({list(first)}, "
                        f"then {list(second)}); declare \"outputs\" in the registration")
    specs = []
    batches = [min(b, cfg.max_batch_size) for b, _ in RUNS]
    for name, (datatype, a) in first.items():
        b = second[name][1]
        if len(a) != len(b):
            raise LoadError(f"{where}: output {name!r} changed rank between the trial "
                            f"runs ({list(a)}, then {list(b)}); declare \"outputs\"")
        if cfg.max_batch_size > 0:
            if not a or a[0] != batches[0] or b[0] != batches[1]:
                raise LoadError(
                    f"{where}: output {name!r} has shape {list(a)} for a batch of "
                    f"{batches[0]}: with max_batch_size > 0 every output keeps the batch as "
                    "its dim 0 (register with max_batch_size 0 for a model that does not "
                    "batch)")
            a, b = a[1:], b[1:]
        specs.append(TensorSpec(name, datatype, tuple(x if x == y else -1
                                                      for x, y in zip(a, b))))
    if not specs:
        raise LoadError(f"{where}: the trial run returned no outputs")
    return tuple(specs)
