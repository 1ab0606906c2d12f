"""What a model version will cost in memory, predicted from its files before it loads.

Torch-free, so the broker can plan placements without importing torch. A version's
footprint is three terms:

* **weights**: its parameter and buffer bytes, read by its format's reader
  (models/formats.py, models/archives.py): a TorchScript or torch.export archive's
  tensor storages summed from the zip's directory, an AOTInductor package's constants
  from its wrapper; exact, no tensor data read, and what the weights take once loaded.
* **activations**: the peak memory one batch needs beyond the weights, as
  ``fixed + per_sample * batch``, learned by a worker's warm-up (which runs batches of
  several sizes) and kept by the broker per model and device kind, so the next version
  or replica of the model is predicted with it.
* **overhead**: what a loaded version holds beyond its tensors (the TorchScript graph
  and code, kernels and caches its first batches build; large on a CPU, where the
  resident memory counts everything), learned likewise as measured resident bytes less
  the file's weights, and added to later predictions of the model.
* **context**: what a device costs once per worker process before any model (the CUDA
  context on a GPU, the runtime's first allocations on a CPU), measured by the worker
  at start and reported in its READY.

After warm-up the worker reports what it measured, which replaces the prediction.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zeroserve.models import formats
from zeroserve.models.archives import storage_bytes as archive_tensor_bytes
from zeroserve.models.repository import ModelConfig

__all__ = ["ActivationTerm", "Learned", "Prediction", "archive_tensor_bytes", "fit_activation",
           "predict", "size_text", "weights_bytes"]


def size_text(n: float) -> str:
    """Bytes for people: MB below a gigabyte, GB above (decimal units)."""
    return f"{n / 1e9:.1f} GB" if abs(n) >= 1e9 else f"{n / 1e6:.1f} MB"


@dataclass(frozen=True)
class ActivationTerm:
    """Peak memory of one batch above the weights: ``fixed_bytes + per_sample_bytes * b``."""

    per_sample_bytes: int
    fixed_bytes: int = 0

    def at(self, batch: int) -> int:
        return self.fixed_bytes + self.per_sample_bytes * max(1, batch)

    def to_json(self) -> dict[str, int]:
        return {"activation_bytes_per_sample": self.per_sample_bytes,
                "activation_fixed_bytes": self.fixed_bytes}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> "ActivationTerm | None":
        per, fixed = doc.get("activation_bytes_per_sample"), doc.get("activation_fixed_bytes", 0)
        if not isinstance(per, int) or not isinstance(fixed, int):
            return None
        return cls(max(0, per), max(0, fixed))


def fit_activation(peaks: dict[int, int]) -> ActivationTerm | None:
    """The line through the smallest and largest warm-up batch's peak (bytes above the
    level before the batch). One size: all of it per sample. A falling line (noise: a
    peak of the small batch inflated by something else) counts the large batch alone."""
    sizes = sorted(b for b in peaks if b > 0)
    if not sizes:
        return None
    lo, hi = sizes[0], sizes[-1]
    peak_lo, peak_hi = max(0, peaks[lo]), max(0, peaks[hi])
    if hi == lo or peak_hi < peak_lo:
        return ActivationTerm(-(-peak_hi // hi))
    per = (peak_hi - peak_lo) // (hi - lo)
    return ActivationTerm(per, max(0, peak_hi - per * hi))


@dataclass(frozen=True)
class Learned:
    """What a warm-up of a model taught, applied to its next versions and replicas."""

    activation: ActivationTerm | None
    overhead_bytes: int = 0

    @classmethod
    def from_plan(cls, plan: dict[str, Any]) -> "Learned":
        """From a worker's measured plan (see models/loader.py ``_plan``)."""
        overhead = plan.get("overhead_bytes", 0)
        return cls(ActivationTerm.from_json(plan),
                   max(0, overhead) if isinstance(overhead, int) else 0)


@dataclass(frozen=True)
class Prediction:
    """A version's footprint before it loads. ``weights_bytes`` None: the files do not
    say (a Python handler); ``learned`` None: no warm-up of this model taught it yet."""

    weights_bytes: int | None
    learned: Learned | None
    batch: int

    @property
    def activation_bytes(self) -> int:
        act = self.learned.activation if self.learned is not None else None
        return act.at(self.batch) if act is not None else 0

    @property
    def overhead_bytes(self) -> int:
        return self.learned.overhead_bytes if self.learned is not None else 0

    @property
    def total_bytes(self) -> int:
        return (self.weights_bytes or 0) + self.overhead_bytes + self.activation_bytes

    def describe(self) -> str:
        weights = size_text(self.weights_bytes) if self.weights_bytes is not None \
            else "unknown"
        if self.learned is None:
            return f"predicted: {weights} weights; overhead and activations not learned yet"
        return (f"predicted: {weights} weights + {size_text(self.overhead_bytes)} overhead + "
                f"{size_text(self.activation_bytes)} activations at batch {self.batch}")


WeightsCache = dict[tuple[str, int, int], "int | None"]


def weights_bytes(cfg: ModelConfig, version_dir: Path,
                  cache: WeightsCache | None = None) -> int | None:
    """The parameter and buffer bytes of a version's model file (None: its format does
    not say). ``cache`` remembers them by path, mtime and size, so planning reads each
    file once."""
    path = version_dir / cfg.model_file
    try:
        st = os.stat(path)
    except OSError:
        return None
    key = (str(path), st.st_mtime_ns, st.st_size)
    if cache is not None and key in cache:
        return cache[key]
    value = formats.weights_bytes(cfg.platform, path)
    if cache is not None:
        if len(cache) > 4096:  # a long-running broker sees many versions come and go
            cache.clear()
        cache[key] = value
    return value


def predict(cfg: ModelConfig, version_dir: Path, learned: Learned | None = None,
            cache: WeightsCache | None = None) -> Prediction:
    """The prediction for one version folder: its files' weights, plus the overhead and
    the activation term (at the model's largest batch) learned for the model, if any."""
    return Prediction(weights_bytes(cfg, version_dir, cache), learned,
                      max(1, cfg.max_batch_size))
