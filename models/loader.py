"""Load a model version into its own namespace (torch lives here and in workers only)."""

from __future__ import annotations

import gc
import importlib
import logging
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

import torch

from zeroserve.models import archives, formats, handlers
from zeroserve.models.footprint import fit_activation, weights_bytes
from zeroserve.models.repository import ModelConfig, version_sha256
from zeroserve.models.shapes import rule as shape_rule

__all__ = ["LoadError", "LoadedModel", "Opened", "Source", "load", "transient",
           "version_sha256", "warm_up"]

logger = logging.getLogger(__name__)

TORCH_DTYPES = {
    "BOOL": torch.bool, "UINT8": torch.uint8, "INT8": torch.int8, "INT16": torch.int16,
    "INT32": torch.int32, "INT64": torch.int64, "FP16": torch.float16, "FP32": torch.float32,
    "FP64": torch.float64, "BF16": torch.bfloat16, "UINT16": torch.uint16,
    "UINT32": torch.uint32, "UINT64": torch.uint64,
}
DATATYPE_OF = {v: k for k, v in TORCH_DTYPES.items()}
# what a packed batch's handler is also given: the offsets of its rows (flash-attention's
# name), INT64 [rows + 1]
CU_SEQLENS = "cu_seqlens"


class LoadError(Exception):
    """A load that failed; ``transient`` when its cause may pass by itself (memory that
    another load held, a volume that answered slowly), so the broker tries it again."""

    def __init__(self, message: str, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


# what may pass by itself: out of memory (host or device), I/O, a timeout. A corrupt
# archive, a handler that raises anything else, a config the files do not match: no.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (MemoryError, torch.OutOfMemoryError,
                                                      OSError, TimeoutError)


def transient(exc: BaseException) -> bool:
    return isinstance(exc, TRANSIENT_ERRORS)


@dataclass
class LoadedModel:
    name: str
    version: int
    config: ModelConfig
    sha256: str
    fn: Callable[..., Any]
    device: str
    memory_bytes: int = 0
    load_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    # python handlers: fn is the handler's predict(dict) -> dict, called with whole batches
    handler: Any = None
    package: str = ""
    version_dir: Path | None = None
    format: str = ""        # which of models/formats.py's formats the file held
    min_sizes: dict[tuple[int, int], int] = field(default_factory=dict)   # see Opened
    probe_before: int = 0   # the memory probe just before the load (to check it comes back)
    # what the memory planner learns (models/footprint.py): resident bytes, the activation
    # term fitted to the warm-up batches' peaks, the footprint at the largest batch
    plan: dict[str, Any] = field(default_factory=dict)
    # seconds of the measured warm-up runs by batch size: the broker's latency model
    # starts from two sizes instead of guessing the slope from one
    warmup_seconds: dict[int, float] = field(default_factory=dict)
    # a handler that calls other models: its batches wait on them, off the compute thread
    calls_models: bool = False

    @property
    def packed(self) -> bool:
        """Whether its batches run packed, not padded (workers/packing.py): a handler
        declaring ``token_cost: "packed"`` with padded inputs (what it packs; the config
        refuses "packed" for any other format, whose code reads no offsets)."""
        batching = self.config.dynamic_batching
        return (batching.token_cost == "packed" and batching.padding is not None
                and self.config.max_batch_size > 0)

    def ref(self) -> "weakref.ref[Any]":
        return weakref.ref(self.handler if self.handler is not None else self.fn)

    def release(self) -> None:
        """Forget a handler's modules. A batch still running keeps its own reference;
        once the caller drops this object too, nothing keeps the version alive."""
        if self.package:
            handlers.unload_package(self.package, self.version_dir)
        self.extra.clear()


@dataclass(frozen=True)
class Source:
    """What a format's loader (models/formats.py names it) reads."""

    cfg: ModelConfig
    version: int
    sha256: str
    version_dir: Path
    path: Path          # the model file
    device: str
    models: Any = None  # a Python handler's client of other models (workers/bls.py)


@dataclass
class Opened:
    """What a format's loader hands back: the callable, and a handler's object and
    package where the format is a Python handler."""

    fn: Callable[..., Any]
    handler: Any = None
    package: str = ""
    # the smallest size of a free dim, by (input, dim in the config's shape), where the
    # model takes no 1 there (warm-up's sample otherwise makes free dims 1)
    min_sizes: dict[tuple[int, int], int] = field(default_factory=dict)
    calls_models: bool = False   # a handler given a models client (workers/bls.py)


def load_torchscript(src: Source) -> Opened:
    module = torch.jit.load(str(src.path), map_location=src.device)  # type: ignore[no-untyped-call]
    module.eval()
    return Opened(module)


def load_export(src: Source) -> Opened:
    try:
        program = torch.export.load(str(src.path))
    except RuntimeError as exc:
        foreign = archives.output_types(src.path)
        if not foreign:
            raise
        raise LoadError(
            f"{src.path}: the program's outputs are {', '.join(foreign)}, which torch only "
            f"rebuilds where that class's module is imported, and a worker does not import "
            f"it: export a forward that returns a tensor or a tuple of tensors "
            f"(docs/models.md)") from exc
    module = program.module()
    if src.device != "cpu":
        module = module.to(src.device)
    return Opened(module)


def load_python(src: Source) -> Opened:
    if src.cfg.max_sequences:
        # an iterative model's worker calls join() and step() (workers/sequences.py)
        handler, pkg = handlers.load_handler(src.cfg.name, src.version, src.sha256,
                                             src.version_dir, src.device, src.models,
                                             methods=("join", "step"))
        return Opened(handler.step, handler=handler, package=pkg)
    handler, pkg = handlers.load_handler(src.cfg.name, src.version, src.sha256,
                                         src.version_dir, src.device, src.models)
    return Opened(handlers.sync_predict(handler.predict), handler=handler, package=pkg,
                  calls_models=handlers.calls_models(handler))


def _open(cfg: ModelConfig, model_file: Path) -> tuple[formats.Format,
                                                       Callable[[Source], Opened]]:
    """The file's format and its loader, imported now (a format's module may import
    what only it needs)."""
    try:
        fmt = formats.identify(cfg.platform, model_file)
    except KeyError:
        raise LoadError(f"platform {cfg.platform!r} is not supported by this worker") from None
    except formats.FormatError as exc:
        raise LoadError(str(exc)) from None
    module, _, attr = fmt.loader.partition(":")
    opener: Callable[[Source], Opened] = getattr(importlib.import_module(module), attr)
    return fmt, opener


def sample_inputs(cfg: ModelConfig, batch: int, device: str,
                  min_sizes: dict[tuple[int, int], int] | None = None) -> list[torch.Tensor]:
    """Zeros of each declared input, free dims as 1 (or the model's ``min_sizes``; a
    padded one at its first bucket: the shapes requests will run at), for warm-up."""
    out = []
    pads = {i.name: i.dim for i in cfg.dynamic_batching.padding.inputs} \
        if cfg.dynamic_batching.padding is not None else {}
    length = shape_rule(cfg).warmup_length()
    for i, spec in enumerate(cfg.inputs):
        if spec.datatype == "BYTES":
            raise LoadError("warm-up cannot make BYTES inputs")
        least = min_sizes or {}
        dims = [d if d > 0 else max(length if pads.get(spec.name) == axis else 1,
                                    least.get((i, axis), 1))
                for axis, d in enumerate(spec.shape)]
        if cfg.max_batch_size > 0:
            dims = [batch] + dims
        out.append(torch.zeros(dims, dtype=TORCH_DTYPES[spec.datatype], device=device))
    return out


class Probe(Protocol):
    """Peak memory of one batch (workers/memory.py): ``start()`` then ``stop() -> bytes``."""

    def start(self) -> None: ...

    def stop(self) -> int: ...


def _warm_sizes(cfg: ModelConfig) -> list[int]:
    if cfg.max_batch_size <= 0:
        return [1]
    return [min(b, cfg.max_batch_size) for b in cfg.warmup.get("batch_sizes", [])]


def _run(loaded: LoadedModel, batch: int) -> None:
    args = sample_inputs(loaded.config, batch, loaded.device, loaded.min_sizes)
    named = {s.name: t for s, t in zip(loaded.config.inputs, args)}
    if loaded.config.max_sequences:
        _run_sequences(loaded, named, batch)
    elif loaded.config.decoupled:
        # a batch of one-row requests, run to its first response (what a deadline bounds)
        rows = [slice(i, i + 1) for i in range(batch)] if loaded.config.max_batch_size > 0 \
            else [slice(None)]
        gen = loaded.fn(named, rows)
        if not isinstance(gen, Iterator):
            raise LoadError(f"{loaded.name}/{loaded.version}: predict() of a decoupled model "
                            f"returned {type(gen).__name__}: it must be a generator (yield)")
        try:
            next(gen, None)
        finally:
            close = getattr(gen, "close", None)
            if close is not None:
                close()
    elif loaded.packed:
        loaded.fn(_packed_sample(loaded.config, args))
    elif loaded.handler is not None:
        loaded.fn(named)
    else:
        loaded.fn(*args)
    del args, named


def _packed_sample(cfg: ModelConfig, args: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Warm-up's sample as a packed batch: each padded input's rows one after the other
    in one row, and their offsets."""
    assert cfg.dynamic_batching.padding is not None
    pads = {i.name: i.dim for i in cfg.dynamic_batching.padding.inputs}
    named, length, rows = {}, 1, 1
    for spec, t in zip(cfg.inputs, args):
        dim = pads.get(spec.name)
        if dim is not None:
            rows, length = t.shape[0], t.shape[dim + 1]
            t = torch.cat(t.unbind(0), dim=dim).unsqueeze(0)
        named[spec.name] = t
    named[CU_SEQLENS] = torch.arange(0, rows * length + 1, length, dtype=torch.int64,
                                     device=args[0].device)
    return named


def _run_sequences(loaded: LoadedModel, named: dict[str, torch.Tensor], batch: int) -> None:
    """An iterative model's warm-up: ``batch`` sequences joined (each a one-row request)
    and one step of them all (its ``advance`` too), then they leave."""
    handler = loaded.handler
    batched = loaded.config.max_batch_size > 0
    ids = [-1 - i for i in range(min(batch, loaded.config.max_sequences))]   # not a request's
    states = {}
    try:
        for i, seq in enumerate(ids):
            rows = slice(i, i + 1) if batched else slice(None)
            states[seq] = handler.join(seq, {k: v[rows] for k, v in named.items()})
        out = handler.step(states)
        advance = getattr(handler, "advance", None)
        if advance is not None:   # the decode a split step runs after sending
            advance({k: v for k, v in states.items() if not out.get(k, (None, False))[1]})
    finally:
        leave = getattr(handler, "leave", None)
        if leave is not None:
            for seq in states:
                leave(seq)


def warm_up(loaded: LoadedModel, probe: Probe | None = None) -> dict[int, int]:
    """Run the warm-up batches; with a ``probe``, run the smallest and largest once more,
    measured (the first runs also compile and specialize, which would blur the peak):
    returns the peak bytes per batch size."""
    cfg = loaded.config
    if any(s.datatype == "BYTES" for s in cfg.inputs):
        return {}
    sizes = _warm_sizes(cfg)
    peaks: dict[int, int] = {}
    with torch.inference_mode():
        for b in sizes:
            _run(loaded, b)
        if probe is not None and sizes:
            for b in sorted({min(sizes), max(sizes)}):
                probe.start()
                t = time.perf_counter()
                _run(loaded, b)
                loaded.warmup_seconds[b] = time.perf_counter() - t
                peaks[b] = probe.stop()
    return peaks


def _plan(cfg: ModelConfig, version_dir: Path, resident: int,
          peaks: dict[int, int]) -> dict[str, Any]:
    batch = max(1, cfg.max_batch_size)
    term = fit_activation(peaks)
    weights = weights_bytes(cfg, version_dir)
    plan: dict[str, Any] = {"resident_bytes": resident, "batch": batch,
                            "weights_bytes": weights,
                            "overhead_bytes": resident - (weights or 0),
                            "warmup_peaks": {str(b): n for b, n in sorted(peaks.items())}}
    if term is not None:
        plan.update(term.to_json())
    plan["footprint_bytes"] = resident + (term.at(batch) if term is not None else 0)
    return plan


def load(cfg: ModelConfig, version: int, version_dir: Path, device: str,
         memory_probe: Callable[[], int], peak_probe: Probe | None = None,
         settle: Callable[[LoadedModel], ModelConfig] | None = None,
         models: Any = None) -> LoadedModel:
    """Load, warm up and measure one version (with ``peak_probe``, the warm-up batches'
    peaks too, into ``plan``). ``settle`` completes a registration's config from the
    loaded model before warm-up (workers/discovery.py). ``models``: the client a Python
    handler may ask for to call other models (workers/bls.py); such a handler is not
    warmed up, as its warm-up would call models that may not be served yet. Raises
    LoadError with the reason."""
    model_file = version_dir / cfg.model_file
    if not model_file.is_file():
        raise LoadError(f"{model_file} does not exist")
    fmt, opener = _open(cfg, model_file)
    start = time.monotonic()
    gc.collect()
    before = memory_probe()
    sha = version_sha256(version_dir)
    loaded = None
    try:
        opened = opener(Source(cfg, version, sha, version_dir, model_file, device, models))
        loaded = LoadedModel(cfg.name, version, cfg, sha, opened.fn, device,
                             handler=opened.handler, package=opened.package,
                             version_dir=version_dir, format=fmt.name,
                             min_sizes=opened.min_sizes, calls_models=opened.calls_models)
        del opened
        if settle is not None:
            loaded.config = settle(loaded)
        peaks = {} if loaded.calls_models else warm_up(loaded, peak_probe)
    except Exception as exc:  # a broken file or model raises anything
        if loaded is not None:
            loaded.release()
        if isinstance(exc, (handlers.HandlerError, LoadError)):
            raise LoadError(str(exc)) from None
        raise LoadError(f"{cfg.name}/{version}: {type(exc).__name__}: {exc}",
                        transient(exc)) from None
    loaded.probe_before = before
    # a floor of its weights: on a CPU the resident set's rise can miss them where the
    # load reuses pages an unload just gave back (a full CI run read 0.1 MB for an 8 MB
    # model, and load on demand then held three models in a budget of two)
    loaded.memory_bytes = max(0, memory_probe() - before, weights_bytes(cfg, version_dir) or 0)
    if peak_probe is not None:
        loaded.plan = _plan(cfg, version_dir, loaded.memory_bytes, peaks)
        loaded.plan["warmup_seconds"] = {str(b): t for b, t in
                                         sorted(loaded.warmup_seconds.items())}
    loaded.load_s = time.monotonic() - start
    return loaded
