"""What a model version will cost in memory, predicted from its files before it loads.

Torch-free, so the broker can plan placements without importing torch. A version's
footprint is three terms:

* **weights**: its parameter and buffer bytes. A TorchScript archive (``model.pt``) is
  a zip whose tensor storages are its ``<top>/data/<n>`` entries (a torch.export
  archive, ``model.pt2``, keeps them under ``<top>/data/weights/`` and
  ``<top>/data/constants/``); summing their sizes from the zip's directory is exact,
  reads no tensor data, and is what the weights take once loaded (same dtypes).
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
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zeroserve.models.repository import ModelConfig

__all__ = ["ActivationTerm", "Learned", "Prediction", "archive_tensor_bytes", "fit_activation",
           "predict", "size_text", "weights_bytes"]


def size_text(n: float) -> str:
    """Bytes for people: MB below a gigabyte, GB above (decimal units)."""
    return f"{n / 1e9:.1f} GB" if abs(n) >= 1e9 else f"{n / 1e6:.1f} MB"


def _is_storage(parts: list[str]) -> bool:
    if len(parts) == 3 and parts[1] == "data" and parts[2].isdigit():
        return True   # TorchScript: <top>/data/0, <top>/data/1, ...
    return (len(parts) == 4 and parts[1] == "data" and parts[2] in ("weights", "constants")
            and not parts[3].endswith(".json"))   # torch.export (.pt2)


def archive_tensor_bytes(path: Path) -> int | None:
    """The summed size of the tensor storages in a TorchScript or torch.export archive;
    None if the file is not such an archive (a Python handler's files, say)."""
    try:
        with zipfile.ZipFile(path) as archive:
            return sum(info.file_size for info in archive.infolist()
                       if _is_storage(info.filename.split("/")))
    except (OSError, zipfile.BadZipFile):
        return None


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
    """The parameter and buffer bytes of a version's model file (None: not an archive).
    ``cache`` remembers them by path, mtime and size, so planning reads each file once."""
    if cfg.platform == "python":
        return None
    path = version_dir / cfg.model_file
    try:
        st = os.stat(path)
    except OSError:
        return None
    key = (str(path), st.st_mtime_ns, st.st_size)
    if cache is not None and key in cache:
        return cache[key]
    value = archive_tensor_bytes(path)
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
