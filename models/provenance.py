"""Provenance: where a version came from, in ``<model>/<version>/metadata.json`` beside its
files (written by hand, by a pipeline, or by a push from its fields).

The file is left out of the version's sha256 (``repository.version_sha256``): the build id
names the files that compute, so the same weights pushed twice with other metadata are
the same build, and correcting a typo in the metadata reloads nothing. Its fields are
bounded so that it costs the broker nothing to hold and to answer with every model's
metadata. Pure and torch-free: the broker reads it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FILE = "metadata.json"
FIELDS = ("source", "run_id", "data_version", "commit", "created_by", "created_at")
MAX_FILE_BYTES = 16 << 10
MAX_VALUE_CHARS = 256
MAX_LABELS = 32
MAX_LABEL_KEY_CHARS = 64


class ProvenanceError(ValueError):
    pass


def _text(where: str, value: Any, limit: int) -> str:
    if not isinstance(value, str):
        raise ProvenanceError(f"{where}: must be a string, got {type(value).__name__}")
    if len(value) > limit:
        raise ProvenanceError(f"{where}: {len(value)} characters, at most {limit}")
    return value


def parse(doc: Any, where: str = FILE) -> dict[str, Any]:
    """The provenance a document declares, checked: the known fields as strings, and
    ``labels``, a flat map of strings. Raises ProvenanceError naming the field."""
    if not isinstance(doc, dict):
        raise ProvenanceError(f"{where}: must be a JSON object")
    unknown = sorted(set(doc) - set(FIELDS) - {"labels"})
    if unknown:
        raise ProvenanceError(f"{where}: unknown field(s) {', '.join(map(repr, unknown))} "
                              f"(known: {', '.join(FIELDS)}, labels; free-form ones go "
                              "in labels)")
    out: dict[str, Any] = {f: _text(f"{where}: field {f!r}", doc[f], MAX_VALUE_CHARS)
                           for f in FIELDS if doc.get(f) is not None}
    labels = doc.get("labels")
    if labels is not None:
        if not isinstance(labels, dict):
            raise ProvenanceError(f"{where}: field 'labels' must be an object of strings")
        if len(labels) > MAX_LABELS:
            raise ProvenanceError(f"{where}: {len(labels)} labels, at most {MAX_LABELS}")
        out["labels"] = {
            _text(f"{where}: a label's name", k, MAX_LABEL_KEY_CHARS):
            _text(f"{where}: label {k!r}", v, MAX_VALUE_CHARS) for k, v in labels.items()}
    return out


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over``'s fields in place of ``base``'s; labels merged key by key."""
    labels = {**base.get("labels", {}), **over.get("labels", {})}
    out = {**base, **over}
    if labels:
        out["labels"] = labels
    return out


def read(version_dir: Path) -> dict[str, Any]:
    """A version's provenance: {} without a file; ProvenanceError for one that is too
    large, not JSON or not of this shape (the version still serves: this is not its
    code)."""
    path = version_dir / FILE
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise ProvenanceError(f"{path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise ProvenanceError(f"{path}: larger than {MAX_FILE_BYTES} bytes")
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise ProvenanceError(f"{path}: not JSON: {exc}") from None
    return parse(doc, str(path))


def write(version_dir: Path, provenance: dict[str, Any]) -> None:
    """In the fields' own order, as it is shown."""
    (version_dir / FILE).write_text(json.dumps(parse(provenance), indent=2) + "\n")


def of_versions(model_dir: Path, versions: tuple[int, ...]) -> dict[int, dict[str, Any]]:
    """Each version's provenance; one that cannot be read shows as ``{"error": why}``."""
    out: dict[int, dict[str, Any]] = {}
    for v in versions:
        try:
            found = read(model_dir / str(v))
        except ProvenanceError as exc:
            found = {"error": str(exc)}
        if found:
            out[v] = found
    return out
