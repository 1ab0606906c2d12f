from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import given, strategies as st

from zeroserve.broker import protocol as p


def roundtrip(frames):
    kind, header, bufs = p.unpack([bytes(f) for f in frames])
    return kind, header, bufs


def test_request_roundtrip_keeps_tensors_and_fields():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    req = p.InferRequest("r1", "mlp", [p.from_numpy("input", x)], version=2, priority=1,
                         timeout_ms=12.5, tenant="acme", outputs=["output"])
    kind, header, bufs = roundtrip(p.encode_request(req))
    assert kind is p.Kind.REQUEST
    got = p.decode_request(header, bufs)
    assert (got.request_id, got.model, got.version, got.priority, got.timeout_ms, got.tenant,
            list(got.outputs)) == ("r1", "mlp", 2, 1, 12.5, "acme", ["output"])
    np.testing.assert_array_equal(p.to_numpy(got.tensors[0]), x)


def test_reply_and_error_roundtrip():
    y = np.ones((2, 3), dtype=np.float64)
    kind, header, bufs = roundtrip(p.encode_reply(
        p.InferReply("r", "m", 3, [p.from_numpy("out", y)], {"queue_ms": 1.0})))
    rep = p.decode_reply(header, bufs)
    assert kind is p.Kind.REPLY and rep.version == 3 and rep.stats == {"queue_ms": 1.0}
    np.testing.assert_array_equal(p.to_numpy(rep.tensors[0]), y)
    kind, header, _ = roundtrip(p.encode_error(
        p.ErrorReply("r", p.ErrorCode.OVERLOADED, "full", 2.0)))
    err = p.decode_error(header)
    assert kind is p.Kind.ERROR and err.code is p.ErrorCode.OVERLOADED and err.retry_after_s == 2.0
    assert err.code.retryable


def test_replies_and_parts_name_their_build_and_old_peers_still_decode():
    sha = "ab" * 32
    _, header, bufs = roundtrip(p.encode_reply(p.InferReply("r", "m", 3, [], build=sha)))
    assert p.decode_reply(header, bufs).build == sha
    _, header, bufs = roundtrip(p.encode_reply(p.InferReply("r", "m", 3, [])))
    assert "build" not in header and p.decode_reply(header, bufs).build == ""
    _, header, bufs = roundtrip(p.encode_parts([p.StreamPart("r", "m", 2, 0, True, [], {},
                                                             sha)]))
    assert [x.build for x in p.decode_parts(header, bufs)] == [sha]
    with pytest.raises(p.ProtocolError, match="build"):
        p.decode_reply({"id": "r", "model": "m", "version": 1, "tensors": [], "build": 7}, [])


def test_batch_and_result_roundtrip_keep_item_boundaries():
    a = p.from_numpy("input", np.zeros((2, 4), np.float32))
    b = p.from_numpy("input", np.ones((1, 4), np.float32))
    batch = p.Batch(7, "m", 1, [p.BatchItem("0", [a]), p.BatchItem("1", [b], ["output"])], 50.0)
    kind, header, bufs = roundtrip(p.encode_batch(batch))
    got = p.decode_batch(header, bufs)
    assert kind is p.Kind.BATCH and got.batch_id == 7 and got.timeout_ms == 50.0
    assert [i.request_id for i in got.items] == ["0", "1"]
    assert got.items[1].outputs == ["output"]
    np.testing.assert_array_equal(p.to_numpy(got.items[1].tensors[0]), np.ones((1, 4)))
    result = p.BatchResult(7, [p.InferReply("0", "m", 1, [a]), p.InferReply("1", "m", 1, [b])],
                           3.5)
    kind, header, bufs = roundtrip(p.encode_result(result))
    got_r = p.decode_result(header, bufs, "m", 1)
    assert got_r.compute_ms == 3.5 and [r.request_id for r in got_r.replies] == ["0", "1"]


def test_bytes_tensor_roundtrip():
    arr = np.array([b"a", b"", b"hello world"], dtype=object)
    t = p.from_numpy("s", arr)
    assert t.meta.datatype == "BYTES"
    assert list(p.to_numpy(t)) == [b"a", b"", b"hello world"]


@pytest.mark.parametrize("frames, match", [
    ([b"\x01"], "at least 2 frames"),
    ([b"\xff", b"x"], "unknown message kind"),
    ([b"\x01", b"\xc1"], "not msgpack"),
    ([b"\x01", msgpack.packb([1, 2])], "not a map"),
    ([b"\x01", msgpack.packb({"v": 99})], "protocol version 99"),
])
def test_malformed_envelopes_raise_protocol_error(frames, match):
    with pytest.raises(p.ProtocolError, match=match):
        p.unpack(frames)


@pytest.mark.parametrize("header, frames, match", [
    ({"id": "r", "model": "m"}, [], "missing required field `tensors`"),
    ({"id": "r", "model": "m", "tensors": [["x", "FP32", [2]]]}, [], "1 tensors declared"),
    ({"id": "r", "model": "m", "tensors": [["x", "FP32", [2]]]}, [b"abc"], "expected 8"),
    ({"id": "r", "model": "m", "tensors": [["x", "NOPE", [2]]]}, [b""], "datatype"),
    ({"id": "r", "model": "m", "tensors": [["x", "FP32", [-1]]]}, [b""], "shape"),
    ({"id": "r", "model": "m", "tensors": [["x", "FP32", [True]]]}, [b""], "shape"),
    ({"id": "r", "model": "m", "tensors": [["x", "FP32", [1.0]]]}, [b""], "shape"),
    ({"id": "r", "model": "m", "tensors": [["x", "FP32", [2**40]]]}, [b""], "shape"),
    ({"id": "r", "model": "m", "tensors": [["x", "FP32", 4]]}, [b""], "shape"),
    ({"id": "r", "model": "m", "tensors": [["x", "FP32"]]}, [b""], r"tensors\[0\]': expected"),
    ({"id": "r", "model": "m", "tensors": [[7, "FP32", [1]]]}, [b""], r"'tensors\[0\]\.name'"),
    ({"id": 5, "model": "m", "tensors": []}, [], "'id': expected `str`, got `int`"),
    ({"id": "r", "model": "m", "tensors": [], "priority": True}, [], "priority"),
])
def test_malformed_requests_raise_protocol_error(header, frames, match):
    with pytest.raises(p.ProtocolError, match=match):
        p.decode_request({"v": p.PROTOCOL_VERSION, **header}, frames)


def test_truncated_bytes_element_is_rejected():
    with pytest.raises(p.ProtocolError, match="runs past"):
        p.unpack_bytes_elements(b"\x05\x00\x00\x00abc")


@given(st.binary(max_size=64), st.binary(max_size=64))
def test_arbitrary_garbage_never_escapes_as_another_exception(kind, header):
    try:
        k, h, bufs = p.unpack([kind, header])
        if k is p.Kind.REQUEST:
            p.decode_request(h, bufs)
    except p.ProtocolError:
        pass


def request_header(**fields):
    req = p.InferRequest("r1", "m", [p.from_numpy("input", np.zeros((1, 4), np.float32))])
    kind, header, bufs = p.unpack(p.encode_request(req))
    header.update(fields)
    return header, bufs


@pytest.mark.parametrize("timeout", [float("nan"), float("inf"), -1.0])
def test_nan_infinite_and_negative_timeouts_are_refused(timeout):
    header, bufs = request_header(timeout_ms=timeout)
    with pytest.raises(p.ProtocolError, match="'timeout_ms' must be a finite number >= 0"):
        p.decode_request(header, bufs)


@pytest.mark.parametrize("datatype", [["FP32"], {"a": 1}, 3, None])
def test_a_datatype_of_the_wrong_type_is_a_protocol_error(datatype):
    header, bufs = request_header(tensors=[["input", datatype, [1, 4]]])
    with pytest.raises(p.ProtocolError, match="datatype"):
        p.decode_request(header, bufs)


def test_another_protocol_version_names_the_versions_spoken():
    frames = p.encode_request(p.InferRequest("r1", "m", []))
    header = msgpack.unpackb(frames[1])
    header["v"] = 6
    with pytest.raises(p.VersionMismatch,
                       match=r"version 6 is not supported .*speaks 1, 2, 3, 4, 5") as err:
        p.unpack([frames[0], msgpack.packb(header)])
    assert p.request_id_of(err.value.header) == "r1"


def test_a_zero_size_tensor_travels():
    t = p.from_numpy("input", np.zeros((0, 256), np.float32))
    assert t.meta.shape == (0, 256) and bytes(t.data) == b""


def test_typed_messages_round_trip_and_name_a_bad_field():
    msg = p.LoadModel("m", 3, "/models/m/3", {"name": "m"}, "ab" * 32)
    kind, header, _ = p.unpack(p.encode(msg))
    assert kind is p.Kind.LOAD and p.decode(p.LoadModel, header) == msg
    with pytest.raises(p.ProtocolError, match="'version': expected `int`, got `str`"):
        p.decode(p.LoadModel, {**header, "version": "3"})
    with pytest.raises(p.ProtocolError, match="'reason': invalid enum value 'because'"):
        p.decode(p.Disconnect, {"reason": "because"})


def test_a_trial_loads_discovery_travels_and_an_older_peer_reads_none():
    """A registration's trial LOAD says what to find; LOADED carries the config found.
    Both fields are optional, so a peer of the same protocol without them decodes."""
    msg = p.LoadModel("m", 1, "/r/.register-m/1", {"name": "m"},
                      discover={"datatypes": ["input_ids"]})
    assert p.decode(p.LoadModel, p.unpack(p.encode(msg))[1]) == msg
    found = p.ModelLoaded("m", 1, True, config={"name": "m", "outputs": []})
    header = p.unpack(p.encode(found))[1]
    assert p.decode(p.ModelLoaded, header) == found
    older = {k: v for k, v in header.items() if k != "config"}
    assert p.decode(p.ModelLoaded, older).config == {}


@given(st.sampled_from(p.MESSAGES),
       st.dictionaries(st.sampled_from(["id", "model", "version", "ok", "reason", "verb",
                                        "args", "models", "credits", "interval_s", "drain"]),
                       st.one_of(st.none(), st.booleans(), st.integers(), st.floats(),
                                 st.text(max_size=5), st.lists(st.integers(), max_size=2),
                                 st.dictionaries(st.text(max_size=2), st.integers(),
                                                 max_size=2))))
def test_any_header_decodes_or_is_a_protocol_error(cls, header):
    try:
        p.decode(cls, header)
    except p.ProtocolError:
        pass


@given(st.lists(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(),
                          st.binary(), st.lists(st.integers())), min_size=0, max_size=4))
def test_any_tensor_list_decodes_or_is_a_protocol_error(raw):
    header, _ = request_header(tensors=[raw])
    try:
        p.decode_request(header, [b""])
    except p.ProtocolError:
        pass


def test_bundles_round_trip_and_need_version_2():
    reqs = [p.InferRequest(str(i), "m", [p.from_numpy("x", np.full((1, 2), i, np.float32))],
                           priority=i) for i in range(3)]
    kind, header, bufs = p.unpack(p.encode_requests(reqs))
    assert kind is p.Kind.REQUESTS and header["v"] == 2
    back = [p.decode_request(h, b) for h, b in p.unbundle(header, bufs, "requests")]
    assert [(r.request_id, r.priority, bytes(r.tensors[0].data)) for r in back] == \
        [(r.request_id, r.priority, bytes(r.tensors[0].data)) for r in reqs]
    reps = [p.InferReply(r.request_id, "m", 1, r.tensors, {"queue_ms": 1.0}) for r in reqs]
    kind, header, bufs = p.unpack(p.encode_replies(reps))
    assert kind is p.Kind.REPLIES
    assert [(r.request_id, bytes(r.tensors[0].data)) for r in p.decode_replies(header, bufs)] \
        == [(r.request_id, bytes(r.tensors[0].data)) for r in reps]
    frames = p.encode_replies(reps)
    old = msgpack.unpackb(frames[1])
    old["v"] = 1
    with pytest.raises(p.ProtocolError, match="needs protocol version 2"):
        p.unpack([frames[0], msgpack.packb(old), *frames[2:]])
    with pytest.raises(p.ProtocolError, match="declare 3 tensors but carry 2"):
        p.unbundle(header, bufs[:2], "replies")


def test_version_1_kinds_stay_stamped_1_and_pong_lists_the_versions():
    assert msgpack.unpackb(p.encode_request(p.InferRequest("r", "m", []))[1])["v"] == 1
    kind, header, _ = p.unpack(p.encode(p.Pong()))
    assert header["v"] == 1 and p.decode(p.Pong, header).versions == [1, 2, 3, 4, 5]
    # the trace settings' version (broker/tracesettings.py); an older broker's has none
    assert p.decode(p.Pong, p.unpack(p.encode(p.Pong(settings=7)))[1]).settings == 7
    assert p.decode(p.Pong, {"v": 1, "versions": [1]}).settings == 0
    # the log settings' too (broker/server/extverbs.py), 0 from a broker without them
    assert p.decode(p.Pong, p.unpack(p.encode(p.Pong(logs=9)))[1]).logs == 9
    assert p.decode(p.Pong, {"v": 1, "versions": [1], "settings": 3}).logs == 0


def test_a_worker_says_which_protocol_versions_it_speaks() -> None:
    """An older worker's READY has no versions: it speaks version 1 only, so the broker
    sends it no newer kind; a current one lists every version it reads."""
    kind, header, _ = p.unpack(p.encode(p.WorkerReady("h/0", versions=[1, 2])))
    assert p.decode(p.WorkerReady, header).versions == [1, 2]
    del header["versions"]
    assert p.decode(p.WorkerReady, header).versions == [1]


def test_a_routing_key_travels_only_when_set():
    t = [p.from_numpy("x", np.ones((1, 2), np.float32))]
    frames = p.encode_request(p.InferRequest("1", "m", t, routing_key="user-7"))
    kind, header, bufs = p.unpack([bytes(f) for f in frames])
    assert p.decode_request(header, bufs).routing_key == "user-7"
    frames = p.encode_request(p.InferRequest("2", "m", t))
    kind, header, bufs = p.unpack([bytes(f) for f in frames])
    assert "routing_key" not in header   # an older broker sees the header it knew
    assert p.decode_request(header, bufs).routing_key == ""
    with pytest.raises(p.ProtocolError, match="routing_key"):
        p.decode_request({**header, "routing_key": 7}, bufs)


def test_batch_callers_and_waiting_roundtrip() -> None:
    a = p.from_numpy("input", np.zeros((1, 4), np.float32))
    callers = [p.Caller(1, 250.0, "key-a"), p.Caller(0, 0.0, "")]
    batch = p.Batch(9, "h", 1, [p.BatchItem("0", [a]), p.BatchItem("1", [a])], 250.0,
                    callers=callers)
    kind, header, bufs = roundtrip(p.encode_batch(batch))
    assert p.decode_batch(header, bufs).callers == callers
    _, plain_header, plain_bufs = roundtrip(p.encode_batch(p.Batch(9, "h", 1,
                                                                  [p.BatchItem("0", [a])])))
    plain = p.decode_batch(plain_header, plain_bufs)
    assert plain.callers is None
    header["callers"] = [[1, 250.0]]   # one entry short, and malformed
    with pytest.raises(p.ProtocolError):
        p.decode_batch(header, bufs)
    kind, header, _ = roundtrip(p.encode(p.Waiting(9)))
    assert kind is p.Kind.WAITING and p.decode(p.Waiting, header) == p.Waiting(9)


def test_waiting_is_version_3_and_a_load_says_which_versions_its_broker_speaks() -> None:
    """An older broker drops WAITING as malformed: a worker sends it only to a broker
    whose LOAD listed version 3, and an older broker's LOAD lists none (version 1)."""
    kind, header, _ = p.unpack(p.encode(p.Waiting(9)))
    assert header["v"] == p.WAITING_VERSION == 3
    load = p.LoadModel("m", 1, "/r/m/1", {}, versions=[1, 2, 3])
    kind, header, _ = p.unpack(p.encode(load))
    assert header["v"] == 1 and p.decode(p.LoadModel, header).versions == [1, 2, 3]
    del header["versions"]
    assert p.decode(p.LoadModel, header).versions == [1]
    frames = p.encode(p.Waiting(9))
    stale = msgpack.unpackb(frames[1])
    stale["v"] = 2
    with pytest.raises(p.ProtocolError, match="WAITING needs protocol version 3"):
        p.unpack([frames[0], msgpack.packb(stale)])


def test_steps_is_version_4_and_carries_several_batches_partials() -> None:
    """One step of an iterative model: each batch's PARTIAL, its tensors in order; sent
    only to a broker whose LOAD listed version 4 (an older one gets PARTIALs)."""
    one = p.from_numpy("o", np.ones((1, 2), np.float32))
    msgs = [p.Partial(3, [p.PartialItem("0", False, [one])]),
            p.Partial(5, [p.PartialItem("1", True, []), p.PartialItem("2", False, [one])])]
    kind, header, bufs = p.unpack(p.encode_steps(msgs))
    assert kind is p.Kind.STEPS and header["v"] == p.STEPS_VERSION == 4
    got = p.decode_steps(header, bufs)
    assert [(m.batch_id, [(i.item, i.final, len(i.tensors)) for i in m.parts]) for m in got] \
        == [(3, [("0", False, 1)]), (5, [("1", True, 0), ("2", False, 1)])]
    assert p.steps_batch_ids(header) == [3, 5]


def test_pause_is_version_5_and_an_older_peer_cannot_read_it() -> None:
    kind, header, _ = p.unpack(p.encode(p.Pause(7, ["2"])))
    assert kind is p.Kind.PAUSE and header["v"] == p.PAUSE_VERSION == 5
    assert p.decode(p.Pause, header) == p.Pause(7, ["2"])
    frames = p.encode(p.Pause(7, ["2"]))
    stale = msgpack.unpackb(frames[1])
    stale["v"] = 4
    with pytest.raises(p.ProtocolError, match="PAUSE needs protocol version 5"):
        p.unpack([frames[0], msgpack.packb(stale)])


@pytest.mark.parametrize("header, frames, match", [
    ({"batches": "x"}, [], "'batches': expected `array`, got `str`"),
    ({"batches": [[1]]}, [], r"'batches\[0\]': expected `array` of at least length 2"),
    ({"batches": [["1", []]]}, [], r"'batches\[0\]\.batch_id': expected `int`"),
    ({"batches": [[1, "x"]]}, [], r"'batches\[0\]\.parts': expected `array`"),
    ({"batches": [[1, [["0", True, []]]]]}, [b"x"], "carry 1 frames"),
    ({"batches": [[1, [["0", True, [["o", "FP32", [1, 2]]]]]]]}, [], "tensors declared"),
    ({"batches": [[i, []] for i in range(p.MAX_BUNDLE + 1)]}, [], "length <= 256"),
])
def test_malformed_steps_are_protocol_errors(header: dict[str, Any], frames: list[bytes],
                                             match: str) -> None:
    with pytest.raises(p.ProtocolError, match=match):
        p.decode_steps(header, frames)


def test_a_row_travels_only_when_set_and_is_checked():
    t = [p.from_numpy("x", np.ones((1, 4), np.float32))]
    frames = p.encode_request(p.InferRequest("1", "m", t, row=3))
    _, header, bufs = p.unpack(frames)
    assert p.decode_request(header, bufs).row == 3
    _, header, bufs = p.unpack(p.encode_request(p.InferRequest("1", "m", t)))
    assert "row" not in header   # a request of its own: the header an older broker knew
    assert p.decode_request(header, bufs).row == 0
    for bad in (-1, "2", 1.5, True, None, [1]):
        with pytest.raises(p.ProtocolError, match="'row'"):
            p.decode_request({**header, "row": bad}, bufs)
