"""The gateway's door: it sheds (503, Retry-After) when its loop falls behind or its
in-flight bound is reached, and a deadline counts from the door, not from the broker."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import time

import pytest

from zeroserve.gateway.door import Door, Shed
from tests.conftest import Server, http, linear_config, short_tmpdir, write_model

pytestmark = pytest.mark.timeout(120)


def body(parameters: dict[str, int] | None = None) -> bytes:
    doc = {"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32",
                       "data": [0.5, 0.5, 0.5, 0.5]}]}
    if parameters:
        doc["parameters"] = parameters
    return json.dumps(doc).encode()


def shed_count(url: str, reason: str) -> float:
    _, _, text = http("GET", url + "/metrics")
    found = re.search(rf'zeroserve_gateway_shed_total\{{[^}}]*reason="{reason}"[^}}]*\}} '
                      r'([0-9.e+]+)', text.decode())
    return float(found.group(1)) if found else 0.0


def test_a_stalled_loop_closes_the_door_until_it_catches_up() -> None:
    async def scenario() -> tuple[str | None, str | None, str | None]:
        door = Door(shed_lag_ms=20.0, max_in_flight=0)
        door.start()
        try:
            before = door.refuse()
            # the condition under test: a callback that holds the loop for 150 ms
            time.sleep(0.15)  # noqa: sleep-ok (stalls the event loop on purpose)
            during = door.refuse()   # the tick is overdue by far more than 4 x 20 ms
            for _ in range(20):      # on time again after a few ticks
                await asyncio.sleep(0.01)  # noqa: sleep-ok (lets the loop tick; bounded poll)
                if door.refuse() is None:
                    break
            return before, during, door.refuse()
        finally:
            door.stop()

    before, during, after = asyncio.run(scenario())
    assert before is None and after is None
    assert during is not None and "behind" in during


def test_the_in_flight_bound_sheds_past_it() -> None:
    door = Door(shed_lag_ms=0, max_in_flight=2)
    door.admit()
    assert door.refuse() is None
    door.admit()
    assert "in flight" in (door.refuse() or "")
    with pytest.raises(Shed) as shed:
        door.admit()
    assert shed.value.retry_after_s == 1 and door.in_flight == 2
    door.leave()
    door.admit()   # a request that left makes room for one
    assert door.in_flight == 2


def test_the_count_has_one_writer() -> None:
    # every entry point counts through the inference path, which admits and leaves
    with pytest.raises(AttributeError):
        Door().in_flight = 1


@pytest.fixture(scope="module")
def lagging_server():
    """A gateway whose lag bound is one microsecond: every tick is later than that,
    so every inference request is shed at the door."""
    repo = short_tmpdir("zsrepo")
    write_model(repo, "linear", 1, "nn.Linear(4, 3)")
    (repo / "linear" / "config.json").write_text(json.dumps(linear_config("linear")))
    srv = Server(repo, extra=["--shed-lag-ms", "0.001"])
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()
        shutil.rmtree(repo, ignore_errors=True)


def test_a_gateway_behind_answers_503_with_retry_after(lagging_server) -> None:
    url = lagging_server.url
    before = shed_count(url, "loop_lag")
    for path in ("/v2/models/linear/infer", "/v2/models/linear/versions/1/infer"):
        status, headers, got = http("POST", url + path, body())
        assert status == 503 and headers["retry-after"] == "1", got
        assert "behind" in json.loads(got)["error"]
    assert shed_count(url, "loop_lag") >= before + 2
    # the rest of the API is not behind the door
    assert http("GET", url + "/v2/models/linear")[0] == 200


def test_a_budget_spent_in_the_gateway_is_a_504_there(api_server) -> None:
    before = shed_count(api_server.url, "deadline")
    # 1 µs: gone before the request could reach the broker
    status, _, got = http("POST", api_server.url + "/v2/models/linear/infer",
                          body({"timeout": 1}))
    assert status == 504 and "in the gateway" in json.loads(got)["error"], got
    assert shed_count(api_server.url, "deadline") == before + 1
    # a budget that suffices is answered as ever
    status, _, got = http("POST", api_server.url + "/v2/models/linear/infer",
                          body({"timeout": 5_000_000}))
    assert status == 200, got


def test_behind_lower_priorities_with_deadlines_are_shed_and_far_behind_all() -> None:
    async def scenario() -> list[tuple[str | None, ...]]:
        door = Door(shed_lag_ms=50.0, max_in_flight=0)
        door.start()
        try:
            seen = []
            for lag_s in (0.075, 0.250):   # as if the last tick had been this late
                door.lag_s = lag_s
                seen.append((door.refuse(), door.refuse_priority(1, True),
                             door.refuse_priority(2, True), door.refuse_priority(0, True),
                             door.refuse_priority(2, False)))
            return seen
        finally:
            door.stop()

    behind, far = asyncio.run(scenario())
    assert behind[0] is None and behind[1] is None
    assert behind[2] is not None and behind[3] is not None   # 0: the model's default
    assert behind[4] is None                                 # no deadline: it goes on
    assert far[0] is not None and "behind" in far[0]
