"""The wire across releases, and a fuzz of every message kind.

``OLD`` holds each kind's frames as the release before the typed messages (aa97367)
encoded them: today's decoders read every one as they read today's own frames, and
today's header is the older one less the fields at their defaults (which every
release's decoder defaults), so a peer of either release reads the other. A header of
any shape, whole or one field changed, decodes or is a ProtocolError: never another
exception (the broker's loop counts those as malformed and goes on)."""

from __future__ import annotations

from typing import Any, Callable

import msgpack
import pytest
from hypothesis import given, settings, strategies as st

from zeroserve.broker import protocol as p

OLD: dict[str, list[str]] = {
    'request': [
        '01',
        '8ea26964a27231a56d6f64656ca16da776657273696f6e02a87072696f7269747901aa74696d656f'
         '75745f6d73cb4029000000000000a674656e616e74a174a774656e736f72739193a5696e707574a4'
         '46503332920104a76f75747075747391a36f7574a3726f7703a76170695f6b6579a16ba673747265'
         '616dc3a5747261636581ab7472616365706172656e74d93730302d30616637363531393136636434'
         '336464383434386562323131633830333139632d623761643662373136393230333333312d3031ab'
         '726f7574696e675f6b6579a175a17601',
        '000000000000803f0000004000004040',
    ],
    'request_plain': [
        '01',
        '89a26964a27232a56d6f64656ca16da776657273696f6ec0a87072696f7269747900aa74696d656f'
         '75745f6d73cb0000000000000000a674656e616e74a0a774656e736f72739193a5696e707574a446'
         '503332920104a76f757470757473c0a17601',
        '000000000000803f0000004000004040',
    ],
    'requests': [
        '07',
        '82a872657175657374739288a26964a161a56d6f64656ca16da776657273696f6ec0a87072696f72'
         '69747900aa74696d656f75745f6d73cb0000000000000000a674656e616e74a0a774656e736f7273'
         '9193a5696e707574a446503332920104a76f757470757473c088a26964a162a56d6f64656ca16da7'
         '76657273696f6ec0a87072696f7269747902aa74696d656f75745f6d73cb0000000000000000a674'
         '656e616e74a0a774656e736f72739193a5696e707574a446503332920104a76f757470757473c0a1'
         '7602',
        '000000000000803f0000004000004040',
        '000000000000803f0000004000004040',
    ],
    'reply': [
        '02',
        '87a26964a27231a56d6f64656ca16da776657273696f6e02a774656e736f72739193a5696e707574'
         'a446503332920104a5737461747382a871756575655f6d73cb3ff8000000000000aa62617463685f'
         '73697a6502a56275696c64a26162a17601',
        '000000000000803f0000004000004040',
    ],
    'replies': [
        '08',
        '82a77265706c6965739285a26964a161a56d6f64656ca16da776657273696f6e01a774656e736f72'
         '739193a5696e707574a446503332920104a573746174738085a26964a162a56d6f64656ca16da776'
         '657273696f6e01a774656e736f72739193a5696e707574a446503332920104a5737461747380a176'
         '02',
        '000000000000803f0000004000004040',
        '000000000000803f0000004000004040',
    ],
    'error': [
        '03',
        '85a26964a27231a4636f6465aa6f7665726c6f61646564a76d657373616765a466756c6cad726574'
         '72795f61667465725f73cb4000000000000000a17601',
    ],
    'batch': [
        '12',
        '88a2696407a56d6f64656ca16da776657273696f6e01a56974656d739293a1309193a5696e707574'
         'a446503332920104c093a1319193a5696e707574a44650333292010491a36f7574aa74696d656f75'
         '745f6d73cb4049000000000000a5747261636583a4626f6f74a4626f6f74a773656e745f6e7305a5'
         '6974656d7391930181ab7472616365706172656e74d93730302d3061663736353139313663643433'
         '6464383434386562323131633830333139632d623761643662373136393230333333312d303109a7'
         '63616c6c657273929301cb4014000000000000a16b9300cb0000000000000000a0a17601',
        '000000000000803f0000004000004040',
        '000000000000803f0000004000004040',
    ],
    'result': [
        '13',
        '88a2696407a77265706c6965739192a1309193a5696e707574a446503332920104aa636f6d707574'
         '655f6d73cb400c000000000000a56572726f72c0a57265747279c2a765787069726564c2a9706861'
         '7365735f6d7381a5696e666572cb4000000000000000a17601',
        '000000000000803f0000004000004040',
    ],
    'result_error': [
        '13',
        '88a2696407a77265706c69657390aa636f6d707574655f6d73cb0000000000000000a56572726f72'
         'a4626f6f6da57265747279c3a765787069726564c2a97068617365735f6d7380a17601',
    ],
    'parts': [
        '09',
        '82a570617274739286a26964a27231a56d6f64656ca16da776657273696f6e01a5696e64657800a5'
         '66696e616cc2a774656e736f72739193a5696e707574a44650333292010486a26964a27231a56d6f'
         '64656ca16da776657273696f6e01a5696e64657801a566696e616cc3a774656e736f727390a17601',
        '000000000000803f0000004000004040',
    ],
    'partial': [
        '1a',
        '83a2696407a570617274739193a130c29193a5696e707574a446503332920104a17601',
        '000000000000803f0000004000004040',
    ],
    'steps': [
        '1d',
        '82a7626174636865739292079193a130c39193a5696e707574a446503332920104920890a17604',
        '000000000000803f0000004000004040',
    ],
    'ready': [
        '10',
        '8aa9776f726b65725f6964a3682f30a76372656469747302a37069642aa4686f7374a168a6646576'
         '696365a6637564613a30a66d6f64656c739192a16d01b36d656d6f72795f6275646765745f627974'
         '6573ce40000000a66d656d6f727981a6646576696365a6637564613a30a876657273696f6e739401'
         '020304a17601',
    ],
    'loaded': [
        '15',
        '8ba56d6f64656ca16da776657273696f6e01a26f6bc3a56572726f72a0a6736861323536a26162ac'
         '6d656d6f72795f627974657364a66c6f61645f73cb3fe0000000000000a66d656d6f727980a6636f'
         '6e66696780a97472616e7369656e74c2a17601',
    ],
    'load': [
        '14',
        '88a56d6f64656ca16da776657273696f6e01a470617468a62f722f6d2f31a6636f6e66696781a46e'
         '616d65a16da6736861323536a26162a8646973636f76657280a876657273696f6e739401020304a1'
         '7601',
    ],
    'pong': [
        '06',
        '84a876657273696f6e739401020304a873657474696e677303a46c6f677302a17601',
    ],
    'control': [
        '20',
        '85a26964a26331a476657262a6737461747573a46172677381a16101a5746f6b656ea3746f6ba176'
         '01',
    ],
    'control_reply': [
        '21',
        '86a26964a26331a26f6bc3a6726573756c7481a1789101a4636f6465a0a56572726f72a0a17601',
    ],
    'disconnect': [
        '17',
        '84a6726561736f6ea7647261696e6564a772657374617274c3a664657461696ca3627965a17601',
    ],
    'heartbeat': [
        '11',
        '83aa696e74657276616c5f73cb3fe0000000000000a86578706972795f73cb4000000000000000a1'
         '7601',
    ],
    'stop': [
        '1b',
        '83a2696407a56974656d7391a130a17601',
    ],
    'cancel': [
        '04',
        '82a26964a27231a17601',
    ],
}


def frames_of(name: str) -> list[bytes]:
    return [bytes.fromhex(f) for f in OLD[name]]


Frames = list[Any]
# each kind: (its decoder from unpacked parts, today's encoder of what it decoded)
Codec = tuple[Callable[[dict[str, Any], Any], Any], Callable[[Any], Frames]]
CODECS: dict[p.Kind, Codec] = {
    p.Kind.REQUEST: (p.decode_request, p.encode_request),
    p.Kind.REQUESTS: (lambda h, b: [p.decode_request(x, y)
                                    for x, y in p.unbundle(h, b, "requests")],
                      p.encode_requests),
    p.Kind.REPLY: (p.decode_reply, p.encode_reply),
    p.Kind.REPLIES: (p.decode_replies, p.encode_replies),
    p.Kind.ERROR: (lambda h, b: p.decode_error(h), p.encode_error),
    p.Kind.BATCH: (p.decode_batch, p.encode_batch),
    p.Kind.RESULT: (lambda h, b: p.decode_result(h, b, "m", 1), p.encode_result),
    p.Kind.PARTS: (p.decode_parts, p.encode_parts),
    p.Kind.PARTIAL: (p.decode_partial, p.encode_partial),
    p.Kind.STEPS: (p.decode_steps, p.encode_steps),
}
PLAIN = {"ready": p.WorkerReady, "loaded": p.ModelLoaded, "load": p.LoadModel,
         "pong": p.Pong, "control": p.ControlRequest, "control_reply": p.ControlReply,
         "disconnect": p.Disconnect, "heartbeat": p.BrokerHeartbeat, "stop": p.Stop,
         "cancel": p.Cancel}


def decoded(name: str, frames: Frames) -> Any:
    kind, header, bufs = p.unpack([bytes(f) for f in frames])
    if name in PLAIN:
        return p.decode(PLAIN[name], header)
    return CODECS[kind][0](header, bufs)


def encoded(name: str, msg: Any) -> Frames:
    if name in PLAIN:
        return p.encode(msg)
    return CODECS[p.Kind(bytes.fromhex(OLD[name][0]))][1](msg)


AT_DEFAULT = (None, 0, 0.0, "", False, {}, [])


def less_defaults(old: Any, new: Any, where: str = "") -> list[str]:
    """Where ``new`` is not ``old`` less entries at their defaults."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = [f"{where}.{k}: new" for k in new if k not in old]
        for k, v in old.items():
            out += less_defaults(v, new[k], f"{where}.{k}") if k in new else \
                ([] if v in AT_DEFAULT else [f"{where}.{k}: dropped {v!r}"])
        return out
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [d for i, (a, b) in enumerate(zip(old, new))
                for d in less_defaults(a, b, f"{where}[{i}]")]
    return [] if old == new and type(old) is type(new) else [f"{where}: {old!r} -> {new!r}"]


@pytest.mark.parametrize("name", sorted(OLD))
def test_an_older_releases_frames_read_as_todays(name: str) -> None:
    old = frames_of(name)
    msg = decoded(name, old)
    new = encoded(name, msg)
    assert decoded(name, new) == msg
    assert new[0] == old[0] and [bytes(f) for f in new[2:]] == old[2:]
    diff = less_defaults(msgpack.unpackb(old[1]), msgpack.unpackb(bytes(new[1])))
    assert not diff, diff


def test_todays_request_is_smaller_where_fields_are_at_their_defaults() -> None:
    old = frames_of("request_plain")
    new = encoded("request_plain", decoded("request_plain", old))
    assert sorted(msgpack.unpackb(bytes(new[1]))) == ["id", "model", "tensors", "v"]
    assert len(new[1]) < len(old[1])


values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70) | st.floats()
    | st.text(max_size=4) | st.binary(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                 max_size=3),
    max_leaves=12)


def _decode_only_protocol_errors(name: str, header: Any, bufs: list[bytes]) -> None:
    kind = p.Kind(bytes.fromhex(OLD[name][0]))
    try:
        if name in PLAIN:
            p.decode(PLAIN[name], header)
        else:
            CODECS[kind][0](header, bufs)
    except p.ProtocolError:
        pass


@settings(max_examples=300)
@given(st.sampled_from(sorted(OLD)), st.data())
def test_every_kind_with_one_field_changed_decodes_or_is_a_protocol_error(
        name: str, data: st.DataObject) -> None:
    _, header, bufs = p.unpack(frames_of(name))
    key = data.draw(st.sampled_from(sorted(header)) | st.text(max_size=6))
    header[key] = data.draw(values)
    _decode_only_protocol_errors(name, header, list(bufs))


@settings(max_examples=300)
@given(st.sampled_from(sorted(OLD)), st.dictionaries(st.text(max_size=8), values, max_size=6),
       st.lists(st.binary(max_size=16), max_size=3))
def test_every_kind_with_any_header_decodes_or_is_a_protocol_error(
        name: str, header: dict[str, Any], bufs: list[bytes]) -> None:
    _decode_only_protocol_errors(name, header, bufs)


@settings(max_examples=300)
@given(st.sampled_from(sorted(OLD)), st.binary(max_size=64))
def test_every_kind_with_garbage_for_a_header_is_refused(name: str, raw: bytes) -> None:
    frames = frames_of(name)
    try:
        _, header, bufs = p.unpack([frames[0], raw, *frames[2:]], p.Limits())
    except p.ProtocolError:
        return
    _decode_only_protocol_errors(name, header, list(bufs))
