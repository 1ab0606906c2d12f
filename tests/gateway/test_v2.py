"""The v2 codec against tritonclient's own encoder and decoder (no server needed)."""

from __future__ import annotations

import numpy as np
import orjson
import pytest
import tritonclient.http as triton
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import examples
from zeroserve.broker import protocol as p
from zeroserve.gateway import simple, v2


def client_body(inputs, outputs=None, **kw):
    body, json_size = triton.InferenceServerClient.generate_request_body(
        inputs, outputs=outputs, **kw)
    return body, json_size


def bytes_input(arr, binary):
    inp = triton.InferInput("text", list(arr.shape), "BYTES")
    inp.set_data_from_numpy(arr, binary_data=binary)
    return inp


@pytest.mark.parametrize("binary", [True, False])
def test_bytes_round_trip_through_the_codec(binary):
    values = [b"hello", b"", "ünïcode".encode()] + ([b"\x00\xff raw"] if binary else [b"x"])
    arr = np.array(values, dtype=object).reshape(2, 2)
    body, json_size = client_body([bytes_input(arr, binary)], request_id="b1")
    req = v2.decode_request(body, json_size)
    (t,) = req.tensors
    assert t.meta == p.TensorMeta("text", "BYTES", (2, 2))
    assert p.unpack_bytes_elements(t.data) == values
    # the same tensor out again, binary or JSON, read back by tritonclient
    out = [triton.InferRequestedOutput("text", binary_data=binary)]
    req = v2.decode_request(*client_body([bytes_input(arr, True)], outputs=out))
    resp, hlen = v2.encode_response("m", 1, "b1", [t], req)
    result = triton.InferenceServerClient.parse_response_body(resp, header_length=hlen)
    got = result.as_numpy("text")
    # tritonclient hands JSON BYTES back as str, binary ones as bytes
    expected = values if binary else [v.decode() for v in values]
    assert got.shape == (2, 2) and list(got.reshape(-1)) == expected
    assert result.get_response()["id"] == "b1"


def test_every_numeric_datatype_round_trips_binary_and_json():
    for datatype, dtype in [("BOOL", np.bool_), ("UINT8", np.uint8), ("UINT16", np.uint16),
                            ("UINT32", np.uint32), ("UINT64", np.uint64), ("INT8", np.int8),
                            ("INT16", np.int16), ("INT32", np.int32), ("INT64", np.int64),
                            ("FP16", np.float16), ("FP32", np.float32), ("FP64", np.float64)]:
        x = (np.arange(6) % 3).astype(dtype).reshape(2, 3)
        for binary in (True, False):
            inp = triton.InferInput("x", [2, 3], datatype)
            inp.set_data_from_numpy(x, binary_data=binary)
            out = [triton.InferRequestedOutput("x", binary_data=binary)]
            req = v2.decode_request(*client_body([inp], outputs=out))
            (t,) = req.tensors
            np.testing.assert_array_equal(p.to_numpy(t), x)
            resp, hlen = v2.encode_response("m", 1, None, [t], req)
            got = triton.InferenceServerClient.parse_response_body(
                resp, header_length=hlen).as_numpy("x")
            assert got.dtype == x.dtype, datatype
            np.testing.assert_array_equal(got, x)


@pytest.mark.parametrize("body, hlen, needle", [
    (b'{"inputs": [{"name": "t", "shape": [1], "datatype": "BYTES", '
     b'"parameters": {"binary_data_size": 3}}]}\x05\x00\x00', None,
     "failed to parse the request JSON buffer"),
    (b'{"inputs": [{"name": "t", "shape": [1], "datatype": "BYTES", '
     b'"parameters": {"binary_data_size": 6}}]}\x05\x00\x00\x00ab', 101, "runs past"),
    (b'{"inputs": [{"name": "t", "shape": [1], "datatype": "BYTES", "data": [1]}]}', None,
     "BYTES data must be strings"),
    (b'{"inputs": [{"name": "t", "shape": [1], "datatype": "BF16", "data": [1.0]}]}', None,
     "binary tensor extension"),
    # found by schemathesis: a datatype that is not a string was a TypeError (HTTP 500)
    (b'{"inputs": [{"name": "t", "shape": [1], "datatype": [1, {}], "data": [1]}]}', None,
     "unknown datatype"),
])
def test_bad_bodies_are_decode_errors(body, hlen, needle):
    with pytest.raises(v2.DecodeError, match=needle):
        v2.decode_request(body, hlen)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**63 - 1) | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=20)
input_like = st.fixed_dictionaries({}, optional={
    "name": st.sampled_from(["input", ""]) | json_values,
    "datatype": st.sampled_from(sorted(p.DTYPES)) | json_values,
    "shape": st.lists(st.integers(-2, 4), max_size=3) | json_values,
    "data": json_values, "parameters": json_values})
body_like = st.fixed_dictionaries({}, optional={
    "inputs": st.lists(input_like, max_size=3) | json_values, "id": json_values,
    "parameters": json_values,
    "outputs": st.lists(st.fixed_dictionaries({"name": json_values},
                                              optional={"parameters": json_values}),
                        max_size=2) | json_values})


@settings(max_examples=examples(300))
@given(doc=body_like | json_values)
def test_any_json_body_is_decoded_or_refused_with_a_decode_error(doc):
    try:
        req = v2.decode_request(orjson.dumps(doc), None)
    except v2.DecodeError:
        return
    for t in req.tensors:
        assert t.meta.datatype in p.DTYPES


@settings(max_examples=examples(300))
@given(doc=body_like | json_values)
def test_any_json_body_fits_the_simple_codecs_or_is_refused(doc):
    info = simple.ModelInfo({"input": ("FP32", 2), "text": ("BYTES", 2)}, ["output"], True)
    for decode in (simple.decode_seed, simple.decode_torchserve):
        try:
            decode(doc, info)
        except simple.SimpleError:
            pass
