"""models/provenance.py: a version's metadata.json, checked, bounded, and no part of its
sha256."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zeroserve.models import provenance
from zeroserve.models.provenance import ProvenanceError
from zeroserve.models.repository import version_sha256


def test_the_known_fields_and_labels_are_kept_in_their_order() -> None:
    doc = {"labels": {"team": "search"}, "created_by": "alice", "run_id": "r1"}
    assert list(provenance.parse(doc)) == ["run_id", "created_by", "labels"]


@pytest.mark.parametrize("doc, words", [
    ([], "must be a JSON object"),
    ({"colour": "blue"}, "unknown field(s) 'colour'"),
    ({"run_id": 7}, "field 'run_id': must be a string, got int"),
    ({"commit": "x" * 257}, "257 characters, at most 256"),
    ({"labels": ["a"]}, "field 'labels' must be an object of strings"),
    ({"labels": {str(i): "v" for i in range(33)}}, "33 labels, at most 32"),
    ({"labels": {"k" * 65: "v"}}, "a label's name: 65 characters, at most 64"),
    ({"labels": {"k": 1}}, "label 'k': must be a string"),
])
def test_a_bad_document_is_refused_naming_the_field(doc: object, words: str) -> None:
    with pytest.raises(ProvenanceError) as info:
        provenance.parse(doc, "metadata.json")
    assert words in str(info.value)


def test_merge_takes_the_request_over_the_file_label_by_label() -> None:
    merged = provenance.merge({"run_id": "a", "labels": {"x": "1", "y": "2"}},
                              {"run_id": "b", "labels": {"y": "3"}})
    assert merged == {"run_id": "b", "labels": {"x": "1", "y": "3"}}


def test_reading_a_version_folder(tmp_path: Path) -> None:
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "model.pt").write_bytes(b"weights")
    sha = version_sha256(tmp_path / "1")
    assert provenance.read(tmp_path / "1") == {}
    provenance.write(tmp_path / "1", {"commit": "abc", "labels": {"a": "b"}})
    assert provenance.read(tmp_path / "1") == {"commit": "abc", "labels": {"a": "b"}}
    assert version_sha256(tmp_path / "1") == sha          # no part of the build
    (tmp_path / "1" / "sub").mkdir()   # only the top-level file is provenance
    (tmp_path / "1" / "sub" / "metadata.json").write_text("{}")
    assert version_sha256(tmp_path / "1") != sha
    (tmp_path / "2").mkdir()
    (tmp_path / "2" / "metadata.json").write_text("{not json")
    (tmp_path / "3").mkdir()
    (tmp_path / "3" / "metadata.json").write_text(json.dumps({"x": "y" * 20000}))
    found = provenance.of_versions(tmp_path, (1, 2, 3, 4))
    assert found[1]["commit"] == "abc" and 4 not in found
    assert "not JSON" in found[2]["error"]
    assert "larger than 16384 bytes" in found[3]["error"]
