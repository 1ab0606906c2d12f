"""v2json: numeric JSON tensor data straight into numpy, the same values and the same
errors as the old way (orjson.loads, then np.asarray of the list; ``old`` below), unit
by unit and through a real server."""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
import orjson
import pytest
import simdjson
from hypothesis import event, given, settings
from hypothesis import strategies as st

from zeroserve.broker import protocol as p
from zeroserve.gateway import v2, v2json
from tests.conftest import examples, http
from tests.gateway.test_v2 import body_like, json_values

pytestmark = pytest.mark.timeout(180)

NUMERIC = ["FP16", "FP32", "FP64", "INT8", "INT16", "INT32", "INT64",
           "UINT8", "UINT16", "UINT32", "UINT64"]


def doc_of(datatype: Any, shape: Any, data: Any, name: str = "x", **extra: Any) -> bytes:
    return json.dumps({"inputs": [{"name": name, "datatype": datatype, "shape": shape,
                                   "data": data}], **extra}).encode()


def old(text: bytes) -> v2.V2Request | str:
    """The old decode: orjson's lists, np.asarray in v2._json_tensor (or its error)."""
    try:
        doc = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        return f"failed to parse the request JSON buffer: {exc.msg} at {exc.pos}"
    try:
        if not isinstance(doc, dict):
            raise v2.DecodeError("the request must be a JSON object")
        with np.errstate(over="ignore"):   # np.asarray warns of some overflows, not all
            return v2.decode_document(doc, memoryview(b""))
    except v2.DecodeError as exc:
        return str(exc)


def new(text: bytes) -> v2.V2Request | str:
    try:
        with np.errstate(over="ignore"):
            return v2.decode_request(text, None)
    except v2.DecodeError as exc:
        return str(exc)


def assert_same(text: bytes) -> v2.V2Request | str:
    want, got = old(text), new(text)
    if isinstance(want, str) or isinstance(got, str):
        assert got == want
        return got
    assert [t.meta for t in got.tensors] == [t.meta for t in want.tensors]
    for a, b in zip(got.tensors, want.tensors):   # bit-exact: -0.0, NaN-free, rounding
        assert bytes(a.data) == bytes(b.data), a.meta
    return got


def same_value(got: Any, want: Any) -> bool:
    """v2json's document against orjson's: equal, numpy data as np.asarray has it."""
    if isinstance(got, np.ndarray):
        return got.tobytes() == np.asarray(want, got.dtype).tobytes()
    if isinstance(got, dict):
        return isinstance(want, dict) and list(got) == list(want) and all(
            same_value(got[k], want[k]) for k in got)
    if isinstance(got, list):
        return isinstance(want, list) and len(got) == len(want) and all(
            same_value(a, b) for a, b in zip(got, want))
    return type(got) is type(want) and (got == want or got != got and want != want)


def assert_same_document(text: bytes) -> None:
    try:
        want = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        with pytest.raises(orjson.JSONDecodeError, match=re.escape(str(exc))):
            v2json.loads(text)
        return
    with np.errstate(over="ignore"):
        assert same_value(v2json.loads(text), want)


def read_fast(text: bytes) -> np.ndarray:
    data = v2json.loads(text)["inputs"][0]["data"]
    assert isinstance(data, np.ndarray), "a valid numeric tensor went through a list"
    return data


def samples(datatype: str) -> np.ndarray:
    dtype = p.DTYPES[datatype]
    rng = np.random.default_rng(7)
    if dtype.kind == "f":
        specials = [0.0, -0.0, 1.0, -1.5, np.finfo(dtype).max, np.finfo(dtype).min,
                    np.finfo(dtype).tiny, np.finfo(dtype).smallest_subnormal, 0.1, 1 / 3]
        x = np.concatenate([np.array(specials, dtype), rng.standard_normal(14).astype(dtype)])
    else:
        info = np.iinfo(dtype)
        x = np.concatenate([np.array([info.min, info.max, 0, 1], dtype),
                            rng.integers(info.min, info.max, 20, dtype=dtype, endpoint=True)])
    return x.reshape(2, 3, 4)


@pytest.mark.parametrize("datatype", NUMERIC)
@pytest.mark.parametrize("nested", [False, True])
def test_numeric_data_is_bit_exact_and_never_a_list(datatype, nested):
    x = samples(datatype)
    text = doc_of(datatype, [2, 3, 4], x.tolist() if nested else x.reshape(-1).tolist())
    arr = read_fast(text)
    assert arr.dtype == p.DTYPES[datatype] and arr.shape == ((2, 3, 4) if nested else (24,))
    req = assert_same(text)
    assert isinstance(req, v2.V2Request)
    (t,) = req.tensors
    assert p.to_numpy(t).tobytes() == x.tobytes()


@pytest.mark.parametrize("datatype, data, expected", [
    ("INT32", [1.5, -2.7, 3, 2e9], [1, -2, 3, 2000000000]),   # floats truncate, as before
    ("UINT8", [-0.5, 255.9], [0, 255]),
    ("FP32", [1, -0, 16777217, 2 ** 60 + 2 ** 36 + 1], None),  # ints round once, via double
    ("FP16", [65519, 65520, 1e-8, -0.0], None),                # to inf / 0 as np.asarray does
    ("UINT64", [2 ** 64 - 1, 0], [2 ** 64 - 1, 0]),
    ("INT64", [-2 ** 63, 2 ** 63 - 1], [-2 ** 63, 2 ** 63 - 1]),
    ("FP64", [], []), ("INT8", [[], []], None),
])
def test_edge_values_match_the_old_decode(datatype, data, expected):
    text = doc_of(datatype, [len(data)] if data and not isinstance(data[0], list) else [0], data)
    arr = read_fast(text)
    assert_same(text)
    if expected is not None:
        assert arr.tolist() == expected


@pytest.mark.parametrize("datatype, shape, data, needle", [
    ("FP32", [3], [1, 2], "2 elements for shape [3]"),
    ("FP32", [2], [1, [2]], "inhomogeneous"),
    ("FP32", [2], [[1], [[2]]], "inhomogeneous"),
    ("FP32", [4], [[[1], [2]], [[3, 4], []]], "inhomogeneous"),   # right count, ragged
    ("INT8", [2], [1, 300], "data is not INT8: Python integer 300 out of bounds"),
    ("INT16", [1], [-40000], "data is not INT16"),
    ("UINT8", [1], [-1], "data is not UINT8"),
    ("UINT32", [1], [2 ** 32], "data is not UINT32"),
    ("INT64", [1], [2 ** 63], "data is not INT64"),
    ("UINT64", [1], [2 ** 64], "data is not UINT64"),
    ("INT32", [1], [1e20], "data is not INT32"),
    ("INT32", [1], ["one"], "data is not INT32"),
    ("INT32", [1], [None], "data is not INT32"),
    ("FP32", [1], ["x"], "data is not FP32"),
    ("FP32", [1], [{"a": 1}], "data is not FP32"),
    ("BYTES", [1], [1], "BYTES data must be strings"),
    ("BF16", [1], [1.0], "binary tensor extension"),
    ("FP9", [1], [1.0], "unknown datatype"),
])
def test_bad_data_is_refused_as_before(datatype, shape, data, needle):
    got = assert_same(doc_of(datatype, shape, data))
    assert isinstance(got, str) and needle in got, got


@pytest.mark.parametrize("datatype, data", [
    ("BOOL", [True, False]), ("BYTES", ["a", "b"]), ("FP32", ["1.5", 2]), ("FP32", [None, 1]),
    ("FP32", [True, 2.0]), ("INT8", [1, 300]), ("FP32", [1, [2]]),
])
def test_what_numpy_cannot_take_directly_stays_a_list(datatype, data):
    """Booleans, strings, nulls, out-of-range and ragged data go the old way, which
    also takes "1.5" and null as floats and true as 1: kept so."""
    text = doc_of(datatype, [2], data)
    assert v2json.loads(text)["inputs"][0]["data"] == data
    assert_same(text)


@pytest.mark.parametrize("text", [
    b'{"inputs": [1,', b"", b"[1] [2]", b'{"a": NaN}', b'{"a": Infinity}', b'{"a": 1e400}',
    b"\xef\xbb\xbf" + doc_of("FP32", [1], [1.0]),    # simdjson would skip a BOM, orjson not
    b'{"a": "\\ud800"}', b'{"a": "\xff"}', b"[" * 1025 + b"]" * 1025, b"[1, 2]", b"7",
])
def test_documents_refused_as_before(text):
    assert_same_document(text)
    got = assert_same(text)
    assert isinstance(got, str) and ("failed to parse the request JSON buffer: " in got
                                     or "JSON object" in got)


@pytest.mark.parametrize("text", [
    # integers past 64 bits: simdjson refuses them, orjson (so this server) takes them
    doc_of("FP32", [2], [123456789012345678901234567890, 1]),
    doc_of("FP64", [1], [-9223372036854775809]),
    # a key twice: orjson keeps the last, as before
    b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1], "data": [2]}]}',
    b'{"inputs": [], "inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [3]}]}',
    # a NUL in a key: simdjson's lookup would stop there (and find "data")
    b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1], '
    b'"data\\u0000": [[2]]}]}',
    # a '[' in a string makes the count prove nothing: the data goes the old way
    doc_of("FP32", [2], [1, 2], id="a[b", parameters={"k": ["[", "]"]}),
    doc_of("FP32", [2], [1, [2]], id="\\u005b"),
])
def test_odd_documents_decode_as_before(text):
    assert_same(text)
    assert_same_document(text)


def test_the_result_holds_no_simdjson_object_and_a_live_proxy_is_never_overwritten(
        monkeypatch):
    monkeypatch.setattr(v2json, "_PARSER", simdjson.Parser())   # none of another test's
    text = doc_of("FP32", [2, 2], [[1, 2], [3, 4]], parameters={"a": {"b": [1, {"c": 2}]}},
                  outputs=[{"name": "y", "parameters": {"binary_data": True}}])
    doc = v2json.loads(text)
    stack: list[Any] = [doc]
    while stack:
        v = stack.pop()
        assert not isinstance(v, (simdjson.Array, simdjson.Object))
        stack.extend(v.values() if isinstance(v, dict) else v if isinstance(v, list) else ())
    held = v2json._PARSER.parse(b'{"held": [5, 6]}')   # a proxy someone kept
    np.testing.assert_array_equal(read_fast(text), [[1, 2], [3, 4]])   # parsed elsewhere
    assert held["held"].as_list() == [5, 6]
    del held
    np.testing.assert_array_equal(read_fast(text), [[1, 2], [3, 4]])


def test_a_body_past_the_shared_parser_size_is_read_the_same():
    x = np.random.default_rng(5).standard_normal(v2json._SHARED_PARSER_BYTES // 16)
    text = doc_of("FP64", [x.size], x.tolist())
    assert len(text) > v2json._SHARED_PARSER_BYTES
    assert read_fast(text).tobytes() == x.tobytes()
    assert_same(text)


def test_binary_tensors_stay_views_of_the_body_beside_json_ones():
    x = np.arange(6, dtype=np.float32)
    head = json.dumps({"inputs": [
        {"name": "a", "datatype": "FP32", "shape": [6], "parameters": {"binary_data_size": 24}},
        {"name": "b", "datatype": "INT16", "shape": [2, 2], "data": [[1, -2], [3, 4]]}],
        "id": "r1", "outputs": [{"name": "y"}]}).encode()
    body = head + x.tobytes()
    req = v2.decode_request(body, len(head))
    a, b = req.tensors
    assert isinstance(a.data, memoryview) and a.data.obj is body   # no copy
    assert p.to_numpy(a).tobytes() == x.tobytes()
    assert p.to_numpy(b).tolist() == [[1, -2], [3, 4]] and req.id == "r1"
    assert req.output_names == ["y"]


number = st.one_of(
    st.integers(-300, 300), st.integers(-2 ** 63, 2 ** 64 - 1),
    st.floats(-300, 300), st.floats(allow_nan=False, allow_infinity=False),
    st.floats(allow_nan=False, allow_infinity=False, width=16), st.sampled_from([-0.0, 0.0]))
# rarer: integers past 64 bits (simdjson refuses them), and what is not a number
leaf = number | st.sampled_from([2 ** 64, -2 ** 63 - 1, 10 ** 30, True, False, None, "1.5", "x"])


def nest(values: list[Any], dims: list[int]) -> Any:
    if not dims:
        return values[0]
    if len(dims) == 1:
        return values
    step = int(np.prod(dims[1:]))
    return [nest(values[i * step:(i + 1) * step], dims[1:]) for i in range(dims[0])]


@st.composite
def tensor_data(draw: st.DrawFn) -> tuple[list[int], Any]:
    """(dims, data): regular nested arrays (mostly numbers), sometimes broken: an
    element wrapped, dropped or added; or any JSON at all."""
    if draw(st.integers(0, 9)) == 0:
        return [1], draw(st.recursive(leaf, lambda inner: st.lists(inner, max_size=3),
                                      max_leaves=8))
    dims = draw(st.lists(st.integers(0, 3), max_size=3))
    n = int(np.prod(dims))
    data = nest(draw(st.lists(leaf if draw(st.integers(0, 3)) == 0 else number, min_size=n,
                              max_size=n)), dims)
    inner, outer = data, None
    while isinstance(inner, list) and inner and isinstance(inner[0], list):
        outer, inner = inner, inner[draw(st.integers(0, len(inner) - 1))]
    how = draw(st.integers(0, 7))
    if isinstance(inner, list) and inner and how < 3:
        i = draw(st.integers(0, len(inner) - 1))
        if how == 0:
            inner[i] = [inner[i]]
        elif how == 1:
            del inner[i]
        elif outer is not None:   # to a sibling: the same counts, ragged all the same
            outer[draw(st.integers(0, len(outer) - 1))].append(inner.pop(i))
    elif isinstance(inner, list) and how == 3:
        inner.append(draw(number))
    return dims, data


@settings(max_examples=examples(400))
@given(datatype=st.sampled_from(NUMERIC + ["BOOL", "BYTES"]), dims_data=tensor_data(),
       shape=st.none() | st.lists(st.integers(0, 4), max_size=3))
def test_the_new_decode_and_the_old_agree_on_any_data(datatype, dims_data, shape):
    dims, data = dims_data
    text = doc_of(datatype, dims if shape is None else shape, data)
    assert_same(text)
    assert_same_document(text)
    event("numpy" if isinstance(v2json.loads(text)["inputs"][0]["data"], np.ndarray)
          else "the old way")


@settings(max_examples=examples(300))
@given(doc=body_like | json_values, escaped=st.booleans())
def test_any_document_reads_as_orjson_reads_it(doc, escaped):
    try:   # \u-escaped (NULs, '[' as \u005b...) or raw UTF-8
        text = json.dumps(doc).encode() if escaped else orjson.dumps(doc)
    except orjson.JSONEncodeError:   # a lone surrogate
        return
    assert_same_document(text)
    assert_same(text)


def post(server: Any, model: str, text: bytes, headers: dict[str, str] | None = None
         ) -> tuple[int, Any]:
    status, _, got = http("POST", f"{server.url}/v2/models/{model}/infer", text, headers)
    return status, json.loads(got)


@pytest.mark.parametrize("pad", [0, v2.SIMDJSON_FROM_BYTES])   # orjson's way, simdjson's
def test_json_tensors_through_the_server_match_binary_ones(api_server, pad):
    x = np.random.default_rng(3).standard_normal((2, 4)).astype(np.float32)
    x[0, 0] = -0.0
    head = json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [2, 4],
                                   "parameters": {"binary_data_size": x.nbytes}}]}).encode()
    status, got = post(api_server, "linear", head + x.tobytes(),
                       {"Inference-Header-Content-Length": str(len(head))})
    assert status == 200, got
    for data in (x.reshape(-1).tolist(), x.tolist()):
        # a long id takes the document past the size simdjson reads from
        text = doc_of("FP32", [2, 4], data, "input", **({"id": "p" * pad} if pad else {}))
        status, out = post(api_server, "linear", text)
        assert status == 200 and out["outputs"] == got["outputs"], out
        assert out.get("id", "") == "p" * pad


def test_fp16_json_through_the_server(api_server):
    x = np.array([[-1.5, 0.25, 65504.0, -0.0]], np.float16)
    status, got = post(api_server, "half", doc_of("FP16", [1, 4], x.tolist(), "input"))
    assert status == 200, got
    out = np.array(got["outputs"][0]["data"], np.float16)
    assert out.tobytes() == np.maximum(x, 0).tobytes()


@pytest.mark.parametrize("text, needle", [
    (doc_of("FP32", [1, 2], [[1], [[2]]], "input"), "inhomogeneous"),
    (doc_of("INT8", [1, 2], [1, 300], "input"), "data is not INT8"),
    (doc_of("FP32", [1, 3], [1, 2], "input"), "2 elements for shape [1, 3]"),
    (b'{"inputs": [', "failed to parse the request JSON buffer: "),
    (b"\xef\xbb\xbf{}", "failed to parse the request JSON buffer: "),
])
def test_bad_json_tensors_are_400s_through_the_server(api_server, text, needle):
    status, got = post(api_server, "linear", text)
    assert status == 400 and needle in got["error"], got


def test_small_documents_go_through_orjson_and_large_ones_through_simdjson():
    """Below SIMDJSON_FROM_BYTES a list is cheaper than simdjson's fixed cost."""
    small = doc_of("FP32", [1, 4], [1.0, 2.0, 3.0, 4.0], "input")
    doc, _ = v2.parse_document(small, None)
    assert isinstance(doc["inputs"][0]["data"], list)
    n = v2.SIMDJSON_FROM_BYTES // 4
    large = doc_of("FP32", [1, n], [0.5] * n, "input")
    doc, _ = v2.parse_document(large, None)
    data = doc["inputs"][0]["data"]
    assert isinstance(data, np.ndarray) and data.dtype == np.float32 and data.shape == (n,)
