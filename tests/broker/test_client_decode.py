"""clientbase.replies_of: a client's replies decoded straight into their wire shapes,
the same as the general path (envelope, then header map, then shape) gives them; and
anything amiss left to the general path, which refuses it with its reasons."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest

from zeroserve.broker import protocol as p
from zeroserve.broker.clientbase import decode_answers, replies_of


def reply(i: int, tensors: int = 1, **extra: Any) -> p.InferReply:
    outs = [p.from_numpy(f"out{k}", np.arange(3 * (k + 1), dtype=np.float32) + i)
            for k in range(tensors)]
    return p.InferReply(str(i), "mlp", 2, outs, {"queue_ms": 0.5, "batch": 3.0}, **extra)


def general(frames: list[Any]) -> list[p.InferReply]:
    kind, header, bufs = p.unpack(frames)
    if kind is p.Kind.REPLIES:
        return p.decode_replies(header, bufs)
    return [p.decode_reply(header, bufs)]


def same(a: p.InferReply, b: p.InferReply) -> bool:
    return (a.request_id, a.model, a.version, a.stats, a.trace, a.build) == \
        (b.request_id, b.model, b.version, b.stats, b.trace, b.build) and \
        [(t.meta, bytes(t.data)) for t in a.tensors] == \
        [(t.meta, bytes(t.data)) for t in b.tensors]


@pytest.mark.parametrize("frames", [
    p.encode_reply(reply(1)),
    p.encode_reply(reply(1, tensors=0)),
    p.encode_reply(reply(7, tensors=2, trace={"stamps": [1, 2]}, build="ab" * 32)),
    p.encode_replies([reply(i, tensors=i % 3) for i in range(5)]),
    p.encode_replies([reply(i, trace={"x": i}) for i in range(p.MAX_BUNDLE)]),
])
def test_well_formed_replies_decode_as_the_general_path_does(frames: list[Any]) -> None:
    fast = replies_of(frames)
    assert fast is not None
    slow = general(frames)
    assert len(fast) == len(slow) and all(same(a, b) for a, b in zip(fast, slow))
    assert [(k, rid) for k, rid, _ in decode_answers(frames)] == \
        [(p.Kind.REPLY, r.request_id) for r in slow]


def _header(frames: list[Any]) -> dict[str, Any]:
    return msgspec.msgpack.decode(frames[1])   # type: ignore[no-any-return]


def _with(frames: list[Any], **fields: Any) -> list[Any]:
    return [frames[0], msgspec.msgpack.encode({**_header(frames), **fields}), *frames[2:]]


TWO = p.encode_replies([reply(1), reply(2)])
AMISS = {
    "a frame short": TWO[:-1],
    "a frame over": [*TWO, b"x" * 12],
    "version 1 bundle": _with(TWO, v=1),
    "unknown version": _with(TWO, v=99),
    "version a bool": _with(p.encode_reply(reply(1)), v=True),
    "a reply's version a string": _with(TWO, replies=[{**_header(TWO)["replies"][0],
                                                       "version": "2"}]),
    "too many in one": p.encode_replies([reply(i) for i in range(p.MAX_BUNDLE + 1)]),
    "not msgpack": [TWO[0], b"\xc1", *TWO[2:]],
}


@pytest.mark.parametrize("frames", AMISS.values(), ids=AMISS.keys())
def test_anything_amiss_goes_to_the_general_path_which_refuses_it(frames: list[Any]) -> None:
    assert replies_of(frames) is None
    with pytest.raises(p.ProtocolError):
        decode_answers(frames)


def test_a_frame_of_the_wrong_size_is_refused_as_the_general_path_refuses_it() -> None:
    frames = [*TWO[:-1], b"x" * 5]
    with pytest.raises(p.ProtocolError) as fast:
        replies_of(frames)
    with pytest.raises(p.ProtocolError) as slow:
        general(frames)
    assert str(fast.value) == str(slow.value) and "5 bytes" in str(fast.value)


def test_other_kinds_go_to_the_general_path() -> None:
    frames = p.encode_error(p.ErrorReply("9", p.ErrorCode.OVERLOADED, "full", 1.0))
    assert replies_of(frames) is None
    ((kind, rid, answer),) = decode_answers(frames)
    assert (kind, rid, answer.code) == (p.Kind.ERROR, "9", p.ErrorCode.OVERLOADED)
