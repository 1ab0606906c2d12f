"""Which requests may share a batch, and what a batch of them costs. No torch here: the
broker keys its queue by it from request headers, the worker pads by it.

A batch is formed only from requests whose non-batch dimensions agree (Triton's rule
for its dynamic batcher): that agreement is a request's *shape key*. A model whose
config declares ``dynamic_batching.padding`` has its padded dimension taken out of the
key (padded to the longest in the batch) or replaced by its bucket (padded to the
bucket), so mixed lengths share a batch.

A request's *scale* is what one of its rows costs against one row of the declared shape
with every free dimension 1: the latency model predicts from rows x scale (rows x
elements), so a 512-token batch is not priced as a 16-token one.
"""

from __future__ import annotations

import math
import weakref
from typing import Hashable, Sequence

from zeroserve.models.repository import ModelConfig, PaddedInput, Padding, TensorSpec

__all__ = ["ShapeError", "ShapeRule", "rule"]


class ShapeError(ValueError):
    """A request whose padded inputs disagree in length."""


class ShapeRule:
    """A model's shape keys, scales and padded lengths, built once per config."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.batched = cfg.max_batch_size > 0
        self.padding: Padding | None = cfg.dynamic_batching.padding
        self.buckets = self.padding.buckets if self.padding else ()
        self._inputs: tuple[TensorSpec, ...] = cfg.inputs
        self._padded: dict[str, PaddedInput] = \
            {i.name: i for i in self.padding.inputs} if self.padding else {}
        # a model of fixed shapes has one key: nothing to compute per request
        self.fixed = not any(-1 in s.shape for s in cfg.inputs)
        self._ref = sum(math.prod(d if d > 0 else 1 for d in s.shape) for s in cfg.inputs) or 1

    def padded_length(self, length: int) -> int:
        """The length a request of ``length`` is padded to alone: its bucket, or itself
        past the largest bucket (then only equal lengths share a batch)."""
        for b in self.buckets:
            if b >= length:
                return b
        return length

    def length(self, shapes: dict[str, Sequence[int]]) -> int | None:
        """A request's own length along its padded dimension (None: nothing padded).
        Every padded input of one request has the same length: the cut of the outputs
        needs one."""
        found: tuple[str, int] | None = None
        for name, pad in self._padded.items():
            shape = shapes.get(name)
            if shape is None:
                continue
            n = shape[pad.dim + 1 if self.batched else pad.dim]
            if found is None:
                found = (name, n)
            elif n != found[1]:
                raise ShapeError(f"inputs {found[0]!r} and {name!r} are padded together and "
                                 f"must agree in length: {found[1]} against {n}")
        return found[1] if found else None

    def classify(self, shapes: dict[str, Sequence[int]]) -> tuple[Hashable, float]:
        """A request's shape key and scale, from its tensors' shapes by name."""
        key, scale, _ = self.measure(shapes)
        return key, scale

    def measure(self, shapes: dict[str, Sequence[int]]) -> tuple[Hashable, float, int]:
        """A request's shape key, scale and tokens a row (its own length along the padded
        dimension; 0 for a model that pads nothing): what the scheduler batches by."""
        if self.fixed:
            return None, 1.0, 0
        length = self.length(shapes) if self._padded else None
        target = self.padded_length(length) if length is not None else 0
        key: list[tuple[int, ...]] = []
        elements = 0
        for spec in self._inputs:
            shape = shapes.get(spec.name)
            if shape is None:
                continue
            dims = list(shape[1:] if self.batched else shape)
            pad = self._padded.get(spec.name)
            if pad is not None and pad.dim < len(dims):
                dims[pad.dim] = target
                elements += math.prod(dims)
                if not self.buckets:
                    dims[pad.dim] = -1   # any length: the batch pads to its longest
            else:
                elements += math.prod(dims)
            key.append(tuple(dims))
        return tuple(key), max(elements, 1) / self._ref, length or 0

    def warmup_length(self) -> int:
        """The padded length warm-up runs at: the first bucket (compiled models and CUDA
        graphs specialize on it), else 1 like every free dimension."""
        return self.buckets[0] if self.buckets else 1

    def warmup_scale(self) -> float:
        """The scale of the warm-up's sample inputs, so their timings teach the latency
        model in the same units as requests."""
        shapes: dict[str, Sequence[int]] = {}
        for spec in self._inputs:
            pad = self._padded.get(spec.name)
            dims = [self.warmup_length() if pad is not None and i == pad.dim else max(d, 1)
                    for i, d in enumerate(spec.shape)]
            shapes[spec.name] = [1, *dims] if self.batched else dims
        return self.classify(shapes)[1]


# by the config's id, while it lives: a config is parsed afresh at every rescan, and one
# held here for good (a bounded dict, cleared past 1,024) kept each swapped-out version's
# config and rule in the broker for hours under a version published every 30 s
_RULES: dict[int, tuple[weakref.ref[ModelConfig], ShapeRule]] = {}


def rule(cfg: ModelConfig) -> ShapeRule:
    """The rule of a config, built once (configs are frozen; a new version is a new one)."""
    got = _RULES.get(id(cfg))
    if got is not None and got[0]() is cfg:
        return got[1]
    made = ShapeRule(cfg)   # holds parts of the config, never the config itself
    _RULES[id(cfg)] = (weakref.ref(cfg), made)
    weakref.finalize(cfg, _RULES.pop, id(cfg), None)
    return made
