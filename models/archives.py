"""What a model file's zip archive holds, read from its directory and small text members
without torch: the broker plans memory and tells formats apart with these, and the
worker checks an AOTInductor package with them before handing it to torch.

* TorchScript (``model.pt``): tensor storages are ``<top>/data/<n>``.
* torch.export (``model.pt2`` from ``torch.export.save``): the graph is
  ``<top>/models/<name>.json``, tensors ``<top>/data/weights/`` and ``<top>/data/constants/``.
* AOTInductor package (``model.pt2`` from ``aoti_compile_and_package``): the compiled
  model is ``<top>/data/aotinductor/<name>/`` (a ``.so``, its C++ source and a
  ``*_metadata.json``); the weights live inside the ``.so``, and the C++ wrapper lists
  each constant's ``data_size`` and checks each input's dims against their ranges.
"""

from __future__ import annotations

import json
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ArchiveError", "BatchRange", "aoti_batch_range", "aoti_metadata",
           "aoti_min_sizes", "aoti_weights_bytes", "is_aoti_package", "is_exported_program",
           "members", "storage_bytes"]


class ArchiveError(ValueError):
    """A model file that is not the archive it should be; the message names the file."""


def members(path: Path) -> list[str]:
    """The archive's member names; ArchiveError when it is no readable zip."""
    try:
        with zipfile.ZipFile(path) as archive:
            return archive.namelist()
    except (OSError, zipfile.BadZipFile, EOFError) as exc:
        raise ArchiveError(f"{path}: not a readable zip archive (corrupt or truncated?): "
                           f"{exc}") from None


def is_aoti_package(names: list[str]) -> bool:
    return any(n.split("/")[1:3] == ["data", "aotinductor"] for n in names)


def is_exported_program(names: list[str]) -> bool:
    return any(len(parts := n.split("/")) == 3 and parts[1] == "models"
               and parts[2].endswith(".json") for n in names)


_SPEC_TYPE = re.compile(r'\\?"type\\?": \\?"([A-Za-z_][\w.]*)')
_TORCH_KNOWN = ("builtins.", "collections.", "torch.")


def output_types(path: Path) -> list[str]:
    """The classes an exported program's outputs are built of, other than the ones torch
    always knows (tuple, list, dict, its own): torch only rebuilds such a class where its
    module has been imported, so a worker that has not fails the load with nothing said."""
    try:
        with zipfile.ZipFile(path) as archive:
            texts = [archive.read(n).decode(errors="replace") for n in archive.namelist()
                     if len(parts := n.split("/")) == 3 and parts[1] == "models"
                     and parts[2].endswith(".json")]
    except (OSError, zipfile.BadZipFile, EOFError):
        return []
    found: list[str] = []
    for text in texts:
        at = text.find("out_spec")
        if at < 0:
            continue
        end = text.find("forward_arg_names", at)
        for name in _SPEC_TYPE.findall(text[at:end if end > 0 else at + 20000]):
            if not name.startswith(_TORCH_KNOWN) and name not in found:
                found.append(name)
    return found


def _is_storage(parts: list[str]) -> bool:
    if len(parts) == 3 and parts[1] == "data" and parts[2].isdigit():
        return True   # TorchScript: <top>/data/0, <top>/data/1, ...
    return (len(parts) == 4 and parts[1] == "data" and parts[2] in ("weights", "constants")
            and not parts[3].endswith(".json"))   # torch.export (.pt2)


def storage_bytes(path: Path) -> int | None:
    """The summed size of the tensor storages of a TorchScript or torch.export archive
    (exact: what the weights take once loaded, same dtypes); None if not an archive."""
    try:
        with zipfile.ZipFile(path) as archive:
            return sum(info.file_size for info in archive.infolist()
                       if _is_storage(info.filename.split("/")))
    except (OSError, zipfile.BadZipFile, EOFError):
        return None


def graph_bytes(path: Path) -> int | None:
    """The bytes of an archive's graph: a TorchScript archive's ``code/`` (its source and
    debug tables), an exported program's ``models/`` (its serialized graph); None if not
    an archive."""
    try:
        with zipfile.ZipFile(path) as archive:
            return sum(info.file_size for info in archive.infolist()
                       if info.filename.split("/")[1:2] in (["code"], ["models"]))
    except (OSError, zipfile.BadZipFile, EOFError):
        return None


def _aoti_text(path: Path, suffix: str) -> str | None:
    """The first AOTInductor member ending in ``suffix`` (the wrapper's source or its
    metadata), as text; None where the package has none."""
    with zipfile.ZipFile(path) as archive:
        for name in archive.namelist():
            if "/data/aotinductor/" in name and name.endswith(suffix):
                return archive.read(name).decode("utf-8", errors="replace")
    return None


def aoti_metadata(path: Path) -> dict[str, str]:
    """The package's metadata: ``AOTI_DEVICE_KEY`` (cpu, cuda, ...) and the rest that
    inductor records, plus what the compile added (``zeroserve compile``: torch_version)."""
    text = _aoti_text(path, "wrapper_metadata.json")
    if text is None:
        return {}
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        return {}
    return {str(k): str(v) for k, v in doc.items()} if isinstance(doc, dict) else {}


_DATA_SIZE = re.compile(r"constants_info_\[\d+\]\.data_size = (\d+);")


def aoti_weights_bytes(path: Path) -> int | None:
    """The constants' bytes an AOTInductor package loads (weights and buffers, compiled
    into its ``.so``), summed from the wrapper source; None if it cannot be read."""
    try:
        text = _aoti_text(path, "wrapper.cpp")
    except (OSError, zipfile.BadZipFile, EOFError):
        return None
    if text is None:
        return None
    return sum(int(n) for n in _DATA_SIZE.findall(text))


def aoti_binary_bytes(path: Path) -> int | None:
    """The bytes of the package's compiled ``.so``, which holds its constants again: a
    loaded package maps the ``.so`` beside the constants it copies out of it (93 MB
    resident for a BERT-mini of 44.7 MB of weights, docs/memory.md); None if it cannot
    be read."""
    try:
        with zipfile.ZipFile(path) as archive:
            return sum(info.file_size for info in archive.infolist()
                       if "/data/aotinductor/" in info.filename
                       and info.filename.endswith(".so"))
    except (OSError, zipfile.BadZipFile, EOFError):
        return None


@dataclass(frozen=True)
class BatchRange:
    """The batch sizes (dim 0 of every input) a package accepts; ``high`` None: no bound."""

    low: int
    high: int | None

    @property
    def fixed(self) -> bool:
        return self.high == self.low


_TOO_SMALL = re.compile(r'input_handles\[(\d+)\]: dim value is too small at (\d+), "\s*'
                        r'<< "expected it to be >= (\d+)')


def aoti_min_sizes(path: Path) -> dict[tuple[int, int], int]:
    """The smallest size each (input, dim) of a package accepts, where it checks one
    (torch specializes 0 and 1, so a dynamic dim often starts at 2)."""
    try:
        text = _aoti_text(path, "wrapper.cpp")
    except (OSError, zipfile.BadZipFile, EOFError):
        return {}
    return {(int(i), int(dim)): int(low) for i, dim, low in _TOO_SMALL.findall(text or "")}


def _dim0(text: str, i: int) -> BatchRange:
    head = rf'input_handles\[{i}\]: '
    fixed = re.search(head + r'unmatched dim value at 0, "\s*<< "expected: (\d+)', text)
    if fixed:
        return BatchRange(int(fixed[1]), int(fixed[1]))
    low = re.search(head + r'dim value is too small at 0, "\s*<< "expected it to be >= (\d+)',
                    text)
    high = re.search(head + r'dim value is too large at 0, "\s*<< "expected to be <= (\d+)',
                     text)
    return BatchRange(int(low[1]) if low else 0, int(high[1]) if high else None)


def aoti_batch_range(path: Path, inputs: int) -> BatchRange | None:
    """The batch sizes every one of the first ``inputs`` inputs accepts, read from the
    input checks inductor writes into the wrapper (run only when AOTI_RUNTIME_CHECK_INPUTS
    is set, written always); None when the package carries no wrapper source."""
    text = _aoti_text(path, "wrapper.cpp")
    if text is None:
        return None
    ranges = [_dim0(text, i) for i in range(inputs)]
    highs = [r.high for r in ranges if r.high is not None]
    return BatchRange(max(r.low for r in ranges), min(highs) if highs else None)
