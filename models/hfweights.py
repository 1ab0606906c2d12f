"""A ``save_pretrained`` folder's weights, read without torch for the memory planner:
each safetensors file's header (an 8-byte little-endian length, then JSON naming each
tensor's dtype, shape and byte range), over the folder's shards where an index lists
them. The loader is models/pretrained.py."""

from __future__ import annotations

import json
import struct
from pathlib import Path

__all__ = ["safetensors_bytes", "weights_bytes"]

# a header longer than this is no safetensors file (the format caps it at 100 MB)
MAX_HEADER_BYTES = 100 << 20
SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"


def safetensors_bytes(path: Path) -> int | None:
    """The bytes of a safetensors file's tensors, from its header; None where the file
    is no safetensors file."""
    try:
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) != 8:
                return None
            (size,) = struct.unpack("<Q", head)
            if size > MAX_HEADER_BYTES:
                return None
            header = json.loads(f.read(size))
    except (OSError, ValueError):
        return None
    if not isinstance(header, dict):
        return None
    total = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(isinstance(o, int) for o in offsets) and offsets[1] >= offsets[0]):
            return None
        total += offsets[1] - offsets[0]
    return total


def _shards(folder: Path) -> list[Path] | None:
    """The safetensors files ``from_pretrained`` reads, in its order of preference:
    ``model.safetensors``, else the shards its index lists (another safetensors file
    beside them, an adapter's, is not the model's)."""
    single = folder / SINGLE
    if single.is_file():
        return [single]
    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map")
        except (OSError, ValueError, AttributeError):
            return None
        if not isinstance(weight_map, dict):
            return None
        return [folder / name for name in sorted(set(weight_map.values()))
                if isinstance(name, str) and "/" not in name]
    return None


def weights_bytes(config_file: Path) -> int | None:
    """The bytes a ``save_pretrained`` folder's weights take once loaded (in their saved
    dtype), summed over its safetensors files; None where it holds none (weights in
    ``pytorch_model.bin``, which only torch can read) or one does not read."""
    shards = _shards(config_file.parent)
    if not shards:
        return None
    total = 0
    for shard in shards:
        n = safetensors_bytes(shard)
        if n is None:
            return None
        total += n
    return total
