"""Who may manage models: loopback only, unless an admin token is configured."""

from __future__ import annotations

from starlette.requests import Request

from zeroserve.gateway.app import Gateway, Settings
from zeroserve.gateway.registration import Registration


def request(host: str, auth: str | None = None) -> Request:
    headers = [(b"authorization", auth.encode())] if auth else []
    return Request({"type": "http", "method": "POST", "path": "/v1/models",
                    "client": (host, 40000), "headers": headers})


def registration(token: str = "") -> Registration:
    return Registration(Gateway(Settings("ipc:///tmp/zs-unused", admin_token=token)))


def test_without_a_token_only_loopback_may_manage() -> None:
    reg = registration()
    assert reg._refused(request("127.0.0.1")) is None
    assert reg._refused(request("::1")) is None
    refused = reg._refused(request("10.1.2.3"))
    assert refused is not None and refused.status_code == 403
    assert b"only on loopback" in refused.body


def test_with_a_token_anyone_holding_it_may_manage() -> None:
    reg = registration("tok")
    assert reg._refused(request("10.1.2.3", "Bearer tok")) is None
    missing = reg._refused(request("127.0.0.1"))
    assert missing is not None and missing.status_code == 401
    wrong = reg._refused(request("10.1.2.3", "Bearer nope"))
    assert wrong is not None and wrong.status_code == 403


def test_shared_memory_and_log_writes_follow_the_same_rule() -> None:
    import asyncio

    from zeroserve.gateway.routes_ext import Extensions

    ext = Extensions(Gateway(Settings("ipc:///tmp/zs-unused", allow_shared_memory=True)))
    for handler in (ext.shm_register, ext.shm_unregister, ext.change_log_settings):
        req = request("10.1.2.3")
        req.scope["path_params"] = {"region": "r"}
        answer = asyncio.run(handler(req))
        assert answer.status_code == 403 and b"only on loopback" in answer.body
    ext = Extensions(Gateway(Settings("ipc:///tmp/zs-unused", admin_token="tok")))
    answer = asyncio.run(ext.change_log_settings(request("127.0.0.1")))
    assert answer.status_code == 401
