"""The v2 codec against tritonclient's own encoder and decoder (no server needed)."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.http as triton

from zeroserve.broker import protocol as p
from zeroserve.gateway import v2


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
     b'"parameters": {"binary_data_size": 3}}]}\x05\x00\x00', None, "malformed JSON"),
    (b'{"inputs": [{"name": "t", "shape": [1], "datatype": "BYTES", '
     b'"parameters": {"binary_data_size": 6}}]}\x05\x00\x00\x00ab', 101, "runs past"),
    (b'{"inputs": [{"name": "t", "shape": [1], "datatype": "BYTES", "data": [1]}]}', None,
     "BYTES data must be strings"),
    (b'{"inputs": [{"name": "t", "shape": [1], "datatype": "BF16", "data": [1.0]}]}', None,
     "binary tensor extension"),
])
def test_bad_bytes_and_bf16_bodies(body, hlen, needle):
    with pytest.raises(v2.DecodeError, match=needle):
        v2.decode_request(body, hlen)
