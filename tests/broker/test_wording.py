"""Triton's wording of the errors a request's tensors provoke (catalog.check_inputs) and
of the gateway's version and JSON refusals: the exact texts of triton-inference-server
core's InferenceRequest::Normalize, in its order of checks."""

from __future__ import annotations

import pytest

from zeroserve.broker import wording
from zeroserve.broker.protocol import TensorMeta
from zeroserve.broker.server.catalog import RequestError, check_inputs
from zeroserve.gateway import v2
from zeroserve.gateway.http import BadRequest, parse_version
from zeroserve.models.repository import parse_config


def config(mbs: int = 8, inputs: int = 2) -> object:
    return parse_config({
        "name": "m", "platform": "pytorch_torchscript", "max_batch_size": mbs,
        "inputs": [{"name": n, "datatype": "FP32", "shape": [4]} for n in "ab"[:inputs]],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [3]}]}, "<test>")


def refusal(cfg: object, metas: list[TensorMeta], outputs: list[str] | None = None) -> str:
    with pytest.raises(RequestError) as err:
        check_inputs(cfg, metas, outputs)  # type: ignore[arg-type]
    return str(err.value)


A, B = TensorMeta("a", "FP32", (2, 4)), TensorMeta("b", "FP32", (2, 4))
NO_ID = "[request id: <id_unknown>] "


def test_a_well_formed_request_gives_its_batch_size() -> None:
    assert check_inputs(config(), [B, A], ["y"]) == 2  # type: ignore[arg-type]
    assert check_inputs(config(mbs=0), [TensorMeta("a", "FP32", (4,)),  # type: ignore[arg-type]
                                        TensorMeta("b", "FP32", (4,))], None) == 1


@pytest.mark.parametrize("metas, outputs, expected", [
    ([A, B], ["z"], "unexpected inference output 'z' for model 'm'"),
    ([A], None, NO_ID + "expected 2 inputs but got 1 inputs for model 'm'. Got input(s) "
     "['a'], but missing required input(s) ['b']. Please provide all required input(s)."),
    ([B, TensorMeta("c", "FP32", (2, 4)), A], None, NO_ID + "expected 2 inputs but got 3 "
     "inputs for model 'm'. Got input(s) ['a','b','c'], but missing required input(s) []. "
     "Please provide all required input(s)."),
    ([A, TensorMeta("c", "FP32", (2, 4))], None,
     "unexpected inference input 'c' for model 'm'"),
    ([A, A], None, NO_ID + "input 'a' already exists in request"),
    ([A, TensorMeta("b", "FP32", ())], None,
     NO_ID + "input 'b' has no shape but model requires batch dimension for 'm'"),
    ([A, TensorMeta("b", "FP32", (3, 4))], None,
     NO_ID + "input 'b' batch size does not match other inputs for 'm'"),
    ([TensorMeta("a", "FP32", (9, 4)), TensorMeta("b", "FP32", (9, 4))], None,
     NO_ID + "inference request batch-size must be <= 8 for 'm'"),
    ([A, TensorMeta("b", "INT32", (2, 4))], None,
     NO_ID + "inference input 'b' data-type is 'INT32', but model 'm' expects 'FP32'"),
    ([A, TensorMeta("b", "FP32", (2, 5))], None,
     NO_ID + "unexpected shape for input 'b' for model 'm'. Expected [-1,4], got [2,5]. "
     + wording.BATCH_NOTE),
])
def test_each_refusal_in_triton_words(metas, outputs, expected) -> None:
    assert refusal(config(), metas, outputs) == expected


def test_an_unbatched_model_names_its_full_shape_without_the_note() -> None:
    got = refusal(config(mbs=0, inputs=1), [TensorMeta("a", "FP32", (1, 4))])
    assert got == NO_ID + "unexpected shape for input 'a' for model 'm'. Expected [4], " \
        "got [1,4]. "


def test_the_front_end_puts_in_the_request_id() -> None:
    msg = wording.batch_too_large(8, "m")
    assert wording.with_request_id(msg, "r-1") == \
        "[request id: r-1] inference request batch-size must be <= 8 for 'm'"
    assert wording.with_request_id(msg, None) == msg
    plain = wording.unknown_model("m")
    assert wording.with_request_id(plain, "r-1") == plain   # Triton gives it no prefix


@pytest.mark.parametrize("raw, expected", [
    ("abc", "failed to get model version from specified version string 'abc' (details: "
     "stol), version should be an integral value > 0"),
    ("1.5", wording.bad_version("1.5")), ("²", wording.bad_version("²")),
    ("99999999999", wording.bad_version("99999999999")),
    ("-3", "invalid model version specified '-3' , version should be an integral value > 0"),
    ("0", wording.invalid_version("0")),
])
def test_a_version_that_is_not_a_positive_number(raw, expected) -> None:
    with pytest.raises(BadRequest) as err:
        parse_version(raw)
    assert str(err.value) == expected
    assert parse_version("7") == 7 and parse_version("+7") == 7 and parse_version(None) is None


@pytest.mark.parametrize("body, expected", [
    (b"{not json", "failed to parse the request JSON buffer: unexpected character, expected "
     "a string key at 1"),
    (b"", "failed to parse the request JSON buffer: Input is a zero-length, empty document "
     "at 0"),
])
def test_bad_json_in_triton_words(body, expected) -> None:
    with pytest.raises(v2.DecodeError) as err:
        v2.decode_request(body, None)
    assert str(err.value) == expected
