"""The broker's ``memory`` verb (memtrace.py): off unless ZEROSERVE_TRACEMALLOC starts
tracing, an admin's verb, and once marked it names what grew by type and by traceback."""

from __future__ import annotations

import tracemalloc
from typing import Any, Iterator

import pytest

from zeroserve.broker import protocol as p
from zeroserve.broker.server import memtrace
from zeroserve.broker.server.control import ControlError, ControlTable


@pytest.fixture
def tracing() -> Iterator[None]:
    assert not tracemalloc.is_tracing(), "another test left tracemalloc on"
    assert memtrace.start({memtrace.ENV: "8"}) == 8
    try:
        yield
    finally:
        tracemalloc.stop()


def call(table: ControlTable, verb: str, on_frontend: bool, token: str = "") -> dict[str, Any]:
    kind, header, _ = p.unpack(table.handle(p.ControlRequest("1", verb, {}, token),
                                            on_frontend))
    assert kind is p.Kind.CONTROL_REPLY
    return header


def test_unset_or_zero_starts_nothing_and_a_wrong_value_is_refused() -> None:
    assert memtrace.start({}) == 0 and memtrace.start({memtrace.ENV: "0"}) == 0
    assert not tracemalloc.is_tracing()
    for wrong in ("yes", "-1", str(memtrace.MAX_FRAMES + 1)):
        with pytest.raises(ValueError, match=memtrace.ENV):
            memtrace.start({memtrace.ENV: wrong})
    assert not tracemalloc.is_tracing()


def test_off_by_default_the_verb_says_how_to_turn_it_on() -> None:
    with pytest.raises(ControlError, match=f"{memtrace.ENV}=") as err:
        memtrace.MemoryTrace().report({})
    assert err.value.code == "unavailable"


def test_an_admins_verb_never_answered_on_the_frontend(tracing) -> None:
    table = ControlTable("secret")
    memtrace.MemoryTrace().add_verbs(table)
    assert call(table, "memory", on_frontend=True, token="secret")["code"] == "forbidden"
    assert call(table, "memory", on_frontend=False)["code"] == "unauthorized"
    assert call(table, "memory", on_frontend=False, token="secret")["ok"]


class Kept:
    """What a leak would keep: one per cycle, held by a module-level list."""


KEPT: list[Kept] = []


def test_after_a_mark_what_grew_leads_by_type_and_by_traceback(tracing) -> None:
    trace = memtrace.MemoryTrace()
    first = trace.report({"mark": True, "top": 5})
    assert not first["marked"] and first["frames"] == 8
    KEPT.extend(Kept() for _ in range(5000))
    try:
        grown = trace.report({"top": 5})
    finally:
        KEPT.clear()
    assert grown["marked"]
    assert grown["objects"][0] == {"type": f"{__name__}.Kept", "count": 5000, "grown": 5000}
    top = grown["allocations"][0]
    assert top["grown_blocks"] >= 5000 and top["grown_kb"] > 100, top
    assert any(__file__ in frame for frame in top["traceback"]), top["traceback"]
    # a mark is kept only when asked: the same base again, and the objects gone since
    again = trace.report({"top": 5})
    assert again["marked"] and all(o["type"] != f"{__name__}.Kept" for o in again["objects"])
