"""What a model version will cost in memory, predicted from its files before it loads.

Torch-free, so the broker can plan placements without importing torch. A version's
footprint is three terms:

* **weights**: its parameter and buffer bytes, read by its format's reader
  (models/formats.py, models/archives.py): a TorchScript or torch.export archive's
  tensor storages summed from the zip's directory, an AOTInductor package's constants
  from its wrapper; exact, no tensor data read, and what the weights take once loaded.
* **activations**: the peak memory one batch needs beyond the weights, as
  ``fixed + per_sample * batch``, learned by a worker's warm-up (which runs batches of
  several sizes) and kept by the broker per model, device kind and format, so the next
  version or replica of the model in the same format is predicted with it (another
  format runs other kernels: an AOTInductor package of an exported program holds
  neither its graph nor its activations alike). Before any warm-up, a first guess:
  ``ACTIVATION_FACTOR`` times one sample's input bytes (free dims at ``GUESS_LENGTH``)
  per sample, at the model's largest batch.
* **overhead**: what a loaded version holds beyond its tensors (the TorchScript graph
  and code, kernels and caches its first batches build; large on a CPU, where the
  resident memory counts everything), learned likewise as measured resident bytes less
  the file's weights, and added to later predictions of the model. Before a warm-up, in
  host memory, the files its format maps beside the tensors (an AOTInductor package's
  ``.so``, which holds its constants again).
* **context**: what a device costs once per worker process before any model (the CUDA
  context on a GPU, the runtime's first allocations on a CPU), measured by the worker
  at start and reported in its READY; and a format's **runtime** (torch.export's, about
  100 MB of host memory), which the worker loads and measures into its context on the
  first load of a format that needs it: a prediction for a worker that has not paid it
  yet adds it (what a worker reported, else :data:`RUNTIME_GUESS_BYTES`).

After warm-up the worker reports what it measured, which replaces the prediction.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from zeroserve.models import formats
from zeroserve.models.archives import storage_bytes as archive_tensor_bytes
from zeroserve.models.repository import ModelConfig

__all__ = ["ACTIVATION_FACTOR", "GUESS_LENGTH", "RUNTIME_GUESS_BYTES", "ActivationTerm", "Files",
           "Learned", "Prediction", "archive_tensor_bytes", "facts", "files_of", "first_guess",
           "fit_activation", "predict", "runtime_charge", "size_text", "weights_bytes"]

# A sample's peak activations over its input bytes, before a warm-up measured them: 16 for
# the bundled mlp and 32 for the cnn measured on a CPU (docs/memory.md); the larger, so a
# first placement errs toward room
ACTIVATION_FACTOR = 32
GUESS_LENGTH = 128           # a free (-1) input dim's length for that guess
# A format runtime's host memory before any worker measured it: torch.export's took
# 99-104 MB on a CPU with torch 2.13 (the first exported program of a process,
# docs/memory.md); what a worker measured replaces it
RUNTIME_GUESS_BYTES = {formats.EXPORT_RUNTIME: 100_000_000}
_ITEM_BYTES = {"BOOL": 1, "UINT8": 1, "INT8": 1, "INT16": 2, "UINT16": 2, "FP16": 2,
               "BF16": 2, "INT32": 4, "UINT32": 4, "FP32": 4, "INT64": 8, "UINT64": 8,
               "FP64": 8, "BYTES": 1}


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


def first_guess(cfg: ModelConfig) -> ActivationTerm:
    """The activation term of a model nothing has measured yet (see ACTIVATION_FACTOR)."""
    sample = 0
    for spec in cfg.inputs:
        elements = 1
        for dim in spec.shape:
            elements *= dim if dim > 0 else GUESS_LENGTH
        sample += elements * _ITEM_BYTES.get(spec.datatype, 4)
    return ActivationTerm(ACTIVATION_FACTOR * sample)


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
    say (a Python handler); ``learned`` None: no warm-up of this model in this format
    taught it yet, and the activations are ``guess``'s."""

    weights_bytes: int | None
    learned: Learned | None
    batch: int
    format: str = ""
    guess: ActivationTerm | None = None
    overhead_guess_bytes: int = 0   # before a warm-up taught it (Files.overhead_bytes)
    runtime: str = ""         # the format's runtime, charged below while a worker lacks it
    runtime_bytes: int = 0

    @property
    def activation_bytes(self) -> int:
        act = self.learned.activation if self.learned is not None else self.guess
        return act.at(self.batch) if act is not None else 0

    @property
    def overhead_bytes(self) -> int:
        return self.learned.overhead_bytes if self.learned is not None \
            else self.overhead_guess_bytes

    @property
    def total_bytes(self) -> int:
        return (self.weights_bytes or 0) + self.overhead_bytes + self.activation_bytes \
            + self.runtime_bytes

    def describe(self) -> str:
        weights = size_text(self.weights_bytes) if self.weights_bytes is not None \
            else "unknown"
        runtime = (f" + {size_text(self.runtime_bytes)} for the {self.runtime} runtime (the "
                   "worker's first load of it)") if self.runtime_bytes else ""
        if self.learned is None and self.guess is not None:
            overhead = f" + {size_text(self.overhead_bytes)} overhead" \
                if self.overhead_bytes else ""
            return (f"predicted: {weights} weights{overhead} + "
                    f"{size_text(self.activation_bytes)} activations at batch {self.batch} "
                    f"(first guesses from the files and inputs){runtime}")
        if self.learned is None:
            return (f"predicted: {weights} weights{runtime}; overhead and activations not "
                    "learned yet")
        return (f"predicted: {weights} weights + {size_text(self.overhead_bytes)} overhead + "
                f"{size_text(self.activation_bytes)} activations at batch {self.batch}"
                f"{runtime}")


@dataclass(frozen=True)
class Files:
    """What a version's model file says of its memory."""

    weights_bytes: int | None = None   # its parameters and buffers; None: it does not say
    format: str = ""                   # the format's name; "": the file is none
    overhead_bytes: int = 0            # the overhead's first guess (host memory)
    runtime: str = ""                  # the format's runtime, paid once per worker


WeightsCache = dict[tuple[str, int, int], Files]


def facts(cfg: ModelConfig, version_dir: Path, cache: WeightsCache | None = None) -> Files:
    """What a version's model file says of its memory. ``cache`` remembers it by path,
    mtime and size, so planning reads each file once."""
    path = version_dir / cfg.model_file
    try:
        st = os.stat(path)
    except OSError:
        return Files()
    key = (str(path), st.st_mtime_ns, st.st_size)
    if cache is not None and key in cache:
        return cache[key]
    try:
        fmt = formats.identify(cfg.platform, path)
        value = Files(fmt.weights(path) if fmt.weights is not None else None, fmt.name,
                      (fmt.overhead(path) or 0) if fmt.overhead is not None else 0, fmt.runtime)
    except (formats.FormatError, KeyError):
        value = Files()
    if cache is not None:
        if len(cache) > 4096:  # a long-running broker sees many versions come and go
            cache.clear()
        cache[key] = value
    return value


def files_of(cfg: ModelConfig, version_dir: Path,
             cache: WeightsCache | None = None) -> tuple[int | None, str]:
    """(the parameter and buffer bytes of a version's model file, None where its format
    does not say; the format's name, "" where the file is none)."""
    got = facts(cfg, version_dir, cache)
    return got.weights_bytes, got.format


def runtime_charge(runtime: str, paid: Mapping[str, Any], seen: Mapping[str, int],
                   host: bool) -> int:
    """What a load of a format needing ``runtime`` adds to a worker that has ``paid``
    the runtimes it names (its report): nothing once paid; else what a worker of the same
    device kind measured (``seen``), else the guess (host memory only: 0 on a GPU)."""
    if not runtime or runtime in paid:
        return 0
    if runtime in seen:
        return seen[runtime]
    return RUNTIME_GUESS_BYTES.get(runtime, 0) if host else 0


def weights_bytes(cfg: ModelConfig, version_dir: Path,
                  cache: WeightsCache | None = None) -> int | None:
    return files_of(cfg, version_dir, cache)[0]


def predict(cfg: ModelConfig, version_dir: Path, learned: Learned | None = None,
            cache: WeightsCache | None = None, *, host: bool = True,
            runtime_bytes: int = 0) -> Prediction:
    """The prediction for one version folder: its files' weights, plus the overhead and
    the activation term (at the model's largest batch) learned for the model in this
    format, else the first guess of its activations and, in host memory (``host``), of
    its overhead from its files; plus ``runtime_bytes`` (see :func:`runtime_charge`)."""
    got = facts(cfg, version_dir, cache)
    # a handler's files say nothing: it is planned from what its load measures
    return Prediction(got.weights_bytes, learned, max(1, cfg.max_batch_size), got.format,
                      first_guess(cfg) if got.weights_bytes is not None else None,
                      got.overhead_bytes if host else 0, got.runtime, runtime_bytes)
