"""Who may manage models: loopback only, unless an admin token is configured."""

from __future__ import annotations

import asyncio

import pytest
from starlette.requests import Request

from zeroserve.broker.client import InferError
from zeroserve.broker.protocol import ErrorCode
from zeroserve.gateway import errors
from zeroserve.gateway.access import check_admin
from zeroserve.gateway.app import Gateway, Settings
from zeroserve.gateway.routes.extensions import Extensions


def request(host: str, auth: str | None = None) -> Request:
    headers = [(b"authorization", auth.encode())] if auth else []
    return Request({"type": "http", "method": "POST", "path": "/v1/models",
                    "client": (host, 40000), "headers": headers})


def refusal(host: str, auth: str = "", token: str = "") -> errors.Answer | None:
    try:
        check_admin(host, auth, token)
    except InferError as exc:
        return errors.answer(exc)
    return None


def test_without_a_token_only_loopback_may_manage() -> None:
    assert refusal("127.0.0.1") is None
    assert refusal("::1") is None
    refused = refusal("10.1.2.3")
    assert refused is not None and refused.status.http == 403
    assert refused.status.grpc == "PERMISSION_DENIED"
    assert "only on loopback" in refused.message


def test_with_a_token_anyone_holding_it_may_manage() -> None:
    assert refusal("10.1.2.3", "Bearer tok", "tok") is None
    missing = refusal("127.0.0.1", "", "tok")
    assert missing is not None and missing.status.http == 401
    assert missing.http_headers() == {"WWW-Authenticate": "Bearer"}
    assert missing.status.grpc == "UNAUTHENTICATED"
    wrong = refusal("10.1.2.3", "Bearer nope", "tok")
    assert wrong is not None and wrong.status.http == 403


def test_shared_memory_and_log_writes_follow_the_same_rule() -> None:
    gw = Gateway(Settings("ipc:///tmp/zs-unused", allow_shared_memory=True))
    ext = Extensions(gw.shm, gw.facade, gw.settings.admin_token)
    for handler in (ext.shm_register, ext.shm_unregister, ext.change_log_settings):
        req = request("10.1.2.3")
        req.scope["path_params"] = {"region": "r"}
        with pytest.raises(InferError) as got:
            asyncio.run(handler(req))
        assert got.value.code is ErrorCode.FORBIDDEN and "only on loopback" in got.value.message
    gw = Gateway(Settings("ipc:///tmp/zs-unused", admin_token="tok"))
    ext = Extensions(gw.shm, gw.facade, gw.settings.admin_token)
    with pytest.raises(InferError) as got:
        asyncio.run(ext.change_log_settings(request("127.0.0.1")))
    assert got.value.code is ErrorCode.UNAUTHORIZED
