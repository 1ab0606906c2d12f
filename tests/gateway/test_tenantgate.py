"""The gateway's side of tenants (gateway/tenantgate.py): --metrics-allow parsing and who
may scrape, which key a caller is judged by. The broker's answer to ``access`` is a
stand-in here; tests/gateway/test_tenant_scope.py runs the whole thing for real."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from zeroserve.broker.client import InferError
from zeroserve.broker.protocol import ErrorCode
from zeroserve.gateway.tenantgate import DEFAULT_METRICS_ALLOW, TenantGate, networks


def gate(tenants: bool, allow: str = DEFAULT_METRICS_ALLOW) -> TenantGate:
    async def control(verb: str, **args: Any) -> Any:
        assert verb == "access"
        return {"tenants": tenants}
    return TenantGate(control, "tok", networks(allow))


def test_metrics_allow_takes_addresses_and_cidrs() -> None:
    assert [str(n) for n in networks("10.0.0.0/8, 192.0.2.7,::1")] == \
        ["10.0.0.0/8", "192.0.2.7/32", "::1/128"]
    with pytest.raises(ValueError, match="'10.0.0/33' is not an address or a CIDR"):
        networks("10.0.0/33")


@pytest.mark.parametrize("host, allow, ok", [
    ("127.0.0.1", DEFAULT_METRICS_ALLOW, True), ("::1", DEFAULT_METRICS_ALLOW, True),
    ("10.1.2.3", DEFAULT_METRICS_ALLOW, False), ("10.1.2.3", "10.0.0.0/8", True),
    ("testclient", DEFAULT_METRICS_ALLOW, False),
])
def test_who_may_scrape_with_tenants(host: str, allow: str, ok: bool) -> None:
    async def go() -> None:
        await gate(True, allow).may_scrape({}, host)
    if ok:
        asyncio.run(go())
    else:
        with pytest.raises(InferError) as err:
            asyncio.run(go())
        assert err.value.code is ErrorCode.FORBIDDEN
    asyncio.run(gate(True, allow).may_scrape({"authorization": "Bearer tok"}, host))
    asyncio.run(gate(False, allow).may_scrape({}, host))   # no tenants: open as before


def test_the_key_a_caller_is_judged_by() -> None:
    async def caller(g: TenantGate, headers: dict[str, str]) -> str | None:
        return await g.caller(headers)
    assert asyncio.run(caller(gate(True), {"x-api-key": "zs_k"})) == "zs_k"
    assert asyncio.run(caller(gate(True), {"authorization": "Bearer tok"})) is None
    assert asyncio.run(caller(gate(False), {})) == ""
    with pytest.raises(InferError) as err:
        asyncio.run(caller(gate(True), {}))
    assert err.value.code is ErrorCode.UNAUTHORIZED


def test_a_broker_that_cannot_say_keeps_the_last_answer_or_lets_nothing_through() -> None:
    answers: list[Any] = [{"tenants": True}]

    async def control(verb: str, **args: Any) -> Any:
        got = answers[0]
        if isinstance(got, InferError):
            raise got
        return got

    now = [100.0]

    async def twice(g: TenantGate) -> tuple[bool, bool]:
        first = await g.enabled()
        now[0] += 10   # the cached answer is old: the gate asks again
        answers[0] = InferError(ErrorCode.UNAVAILABLE, "broker down")
        return first, await g.enabled()

    assert asyncio.run(twice(TenantGate(control, "", [], lambda: now[0]))) == (True, True)
    with pytest.raises(InferError):   # never heard from: unavailable
        asyncio.run(TenantGate(control, "", []).enabled())
    answers[0] = InferError(ErrorCode.BAD_INPUT, "unknown control verb 'access'")
    assert asyncio.run(TenantGate(control, "", []).enabled()) is False


def test_callers_that_find_the_answer_old_share_one_question() -> None:
    asked: list[asyncio.Future[Any]] = []

    async def control(verb: str, **args: Any) -> Any:
        asked.append(asyncio.get_running_loop().create_future())
        return await asked[-1]

    async def go() -> list[Any]:
        g = TenantGate(control, "", [])
        callers = [asyncio.ensure_future(g.enabled()) for _ in range(64)]
        while not asked:
            await asyncio.sleep(0)  # noqa: sleep-ok (one loop turn: the callers' tasks run)
        callers[0].cancel()   # one caller leaves: the others keep their question
        for _ in range(5):
            await asyncio.sleep(0)  # noqa: sleep-ok (loop turns for the cancel to spread)
        asked[0].set_result({"tenants": True})
        got = await asyncio.gather(*callers[1:])
        return [len(asked), got, await g.enabled(), len(asked)]

    assert asyncio.run(go()) == [1, [True] * 63, True, 1]
