"""The model formats zeroserve serves: one entry each, the one place a format is declared.

An entry says which ``platform`` of ``config.json`` it serves (and the other names that
platform goes by: Triton's, the seed's), which file of a version folder holds the model,
how to tell it from another format in the same file (``model.pt2`` holds either an
exported program or an AOTInductor package), the loader the worker calls (named, not
imported: this module stays torch-free, since the gateway and the broker read it), the
reader of its weights' bytes for the memory planner, and what Triton's gRPC
``ModelConfig`` reports for it. Adding a format is adding an entry to :data:`FORMATS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from zeroserve.models import archives, hfweights

__all__ = ["EXPORT_RUNTIME", "FORMATS", "Format", "FormatError", "canonical", "identify",
           "model_file",
           "platforms", "triton_names", "weights_bytes"]


class FormatError(ValueError):
    """A model file that is none of its platform's formats; the message names the file."""


@dataclass(frozen=True)
class Format:
    name: str                      # the format, as logs and errors say it
    platform: str                  # config.json's platform it serves
    file: str                      # the model file in a version folder
    loader: str                    # "module:function" the worker imports and calls
    triton_platform: str           # Triton's ModelConfig.platform and .backend for it
    triton_backend: str
    aliases: tuple[str, ...] = ()  # other names of the platform (the first entry's count)
    # is this file this format? (from the zip's member names); None: the platform's only one
    detect: Callable[[list[str]], bool] | None = None
    # the bytes its weights take once loaded; None: the files do not say
    weights: Callable[[Path], int | None] | None = None
    # the memory planner's first guess of a loaded version's overhead (host memory
    # beyond its tensors) from its files, before a warm-up measured it
    overhead: Callable[[Path], int | None] | None = None
    # the runtime its loader needs that a worker process loads once, on the first load
    # of a format that names it (the worker measures it into its context), "" for none
    # beyond what every worker loads at start
    runtime: str = ""
    what: str = ""                 # how a user makes such a file, for error messages


# torch.export's deserializer and what it imports (sympy, the FX and inductor packages):
# an AOTInductor package's loader imports the same, so the first of either pays it
EXPORT_RUNTIME = "torch.export"

# A loaded version's overhead per byte of its archive's graph, before a warm-up measured
# it (the interpreter's graph and the optimized copies its first batches make, the
# kernels they build). On a CPU with torch 2.13: TorchScript 60-360 (a BERT-mini 13.4 MB
# for 223 KB of code, the bundled cnn 5.9-11.3 MB for 70 KB, the mlp 2.1 MB for 6 KB),
# exported programs 10-27 (the BERT 4.2 MB for 415 KB, the mlp 0.25 MB for 9 KB); the
# least of each, as the weights and the activations guess carry the small models
TORCHSCRIPT_GRAPH_FACTOR = 60
EXPORT_GRAPH_FACTOR = 10


def _per_graph_byte(path: Path, factor: int) -> int | None:
    graph = archives.graph_bytes(path)
    return None if graph is None else factor * graph


FORMATS: tuple[Format, ...] = (
    Format("TorchScript", "pytorch_torchscript", "model.pt",
           "zeroserve.models.loader:load_torchscript", "pytorch_libtorch", "pytorch",
           aliases=("pytorch_libtorch", "pytorch"), weights=archives.storage_bytes,
           overhead=lambda path: _per_graph_byte(path, TORCHSCRIPT_GRAPH_FACTOR),
           what="torch.jit.save"),
    # an AOTInductor package first: a package that also holds its exported program
    # runs compiled
    Format("AOTInductor package", "pytorch_export", "model.pt2",
           "zeroserve.models.aoti:load_package", "pytorch_export", "pytorch",
           detect=archives.is_aoti_package, weights=archives.aoti_weights_bytes,
           overhead=archives.aoti_binary_bytes, runtime=EXPORT_RUNTIME,
           what="torch._inductor.aoti_compile_and_package, or zeroserve compile"),
    Format("exported program", "pytorch_export", "model.pt2",
           "zeroserve.models.loader:load_export", "pytorch_export", "pytorch",
           detect=archives.is_exported_program, weights=archives.storage_bytes,
           overhead=lambda path: _per_graph_byte(path, EXPORT_GRAPH_FACTOR),
           runtime=EXPORT_RUNTIME,
           what="torch.export.save"),
    Format("Python handler", "python", "model.py", "zeroserve.models.loader:load_python",
           "", "python"),
    # a save_pretrained folder as it is: Hugging Face's config.json marks it (Triton
    # serves such a model through its Python backend)
    Format("transformers folder", "transformers", "config.json",
           "zeroserve.models.pretrained:load_pretrained", "", "python",
           weights=hfweights.weights_bytes, what="save_pretrained"),
)


def _aliases() -> dict[str, str]:
    out: dict[str, str] = {}
    for fmt in FORMATS:
        for name in (fmt.platform, *fmt.aliases):
            out.setdefault(name, fmt.platform)
    return out


_PLATFORM_OF = _aliases()


def platforms() -> list[str]:
    """Every platform name a config may give, aliases included, sorted."""
    return sorted(_PLATFORM_OF)


def canonical(platform: object) -> str | None:
    """zeroserve's name for a platform or one of its aliases; None: no such platform."""
    return _PLATFORM_OF.get(platform) if isinstance(platform, str) else None


def _of(platform: str) -> list[Format]:
    found = [f for f in FORMATS if f.platform == _PLATFORM_OF.get(platform, platform)]
    if not found:
        raise KeyError(platform)
    return found


def model_file(platform: str) -> str:
    return _of(platform)[0].file


def triton_names(platform: str) -> tuple[str, str]:
    """(Triton's platform, backend) that gRPC's ModelConfig reports; an unknown
    platform reports itself."""
    try:
        fmt = _of(platform)[0]
    except KeyError:
        return platform, ""
    return fmt.triton_platform, fmt.triton_backend


def identify(platform: str, path: Path) -> Format:
    """The format of a platform's model file. Where the platform has one format, that
    one (its loader reports a bad file); else the first entry whose ``detect`` accepts
    the archive. FormatError naming the file when it is no archive or none of them."""
    found = _of(platform)
    if len(found) == 1 and found[0].detect is None:
        return found[0]
    try:
        names = archives.members(path)
    except archives.ArchiveError as exc:
        raise FormatError(str(exc)) from None
    for fmt in found:
        if fmt.detect is not None and fmt.detect(names):
            return fmt
    kinds = " nor ".join(f"{'an' if f.name[0].lower() in 'aeiou' else 'a'} {f.name} "
                         f"({f.what})" for f in found)
    raise FormatError(f"{path}: neither {kinds}")


def weights_bytes(platform: str, path: Path) -> int | None:
    """The bytes a model file's weights take once loaded; None: the file does not say
    (a Python handler, a file that is no archive)."""
    try:
        fmt = identify(platform, path)
    except (FormatError, KeyError):
        return None
    return fmt.weights(path) if fmt.weights is not None else None
