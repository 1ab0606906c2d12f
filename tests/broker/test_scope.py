"""Tenants scope what they see of the frontend's control verbs (broker/server/scope.py):
each verb with no key, another tenant's key and the right one; the operator's verbs
behind the admin token; the control socket and a broker without tenants unchanged.
The table's verbs here return fixed answers: what is under test is who sees them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from zeroserve.broker import protocol as p
from zeroserve.broker import wording
from zeroserve.broker.clientbase import control_result
from zeroserve.broker.server.control import ControlTable
from zeroserve.broker.server.scope import TenantScope
from zeroserve.broker.server.tenancy import Refusal, Tenancy
from zeroserve.broker.server.tenants import new_key

MODELS = ("mlp", "cnn")
TOKEN = "admin-secret"


def table(tmp_path: Path | None, token: str = TOKEN) -> tuple[ControlTable, dict[str, str]]:
    keys: dict[str, str] = {}
    path = None
    if tmp_path is not None:
        lines = []
        for name, models in (("alice", '"*"'), ("bob", '["mlp"]')):
            keys[name], hashed = new_key()
            lines.append(f'[tenants.{name}]\nkeys = ["{hashed}"]\nmodels = {models}\n')
        path = tmp_path / "tenants.toml"
        path.write_text("\n".join(lines))
    tenancy = Tenancy(path, CollectorRegistry(), lambda: 0.0)
    c = ControlTable(token, TenantScope(tenancy, token))

    def model(args: dict[str, Any]) -> dict[str, Any]:
        assert "api_key" not in args   # no verb ever sees a key
        if args.get("model") not in MODELS:
            raise LookupError(wording.unknown_model(args.get("model")))
        return {"name": args["model"]}

    c.add("metadata", model)
    c.add("config", model)
    c.add("stats", lambda a: {"model_stats": [model(a)] if "model" in a else
                              [{"name": n} for n in MODELS]})
    c.add("repository_index", lambda a: [{"name": n, "state": "READY"} for n in MODELS])
    c.add("status", lambda a: {"workers": []})
    c.add("draining", lambda a: {"ok": True})
    return c, keys


def call(c: ControlTable, verb: str, frontend: bool = True, token: str = "",
         **args: Any) -> Any:
    _, header, _ = p.unpack(c.handle(p.ControlRequest("1", verb, args, token), frontend))
    return control_result(header)


def refusal(c: ControlTable, verb: str, **kw: Any) -> tuple[p.ErrorCode, str]:
    from zeroserve.broker.client import InferError
    with pytest.raises(InferError) as err:
        call(c, verb, **kw)
    return err.value.code, err.value.message


@pytest.mark.parametrize("verb", ["metadata", "config", "stats"])
def test_a_model_read_with_no_key_another_tenants_key_and_the_right_one(tmp_path,
                                                                        verb) -> None:
    c, keys = table(tmp_path)
    code, msg = refusal(c, verb, model="cnn")
    assert code is p.ErrorCode.UNAUTHORIZED and "API key is required" in msg
    assert refusal(c, verb, model="cnn", api_key="zs_nope")[0] is p.ErrorCode.UNAUTHORIZED
    # bob may not call cnn: not found, in the words of a model that does not exist
    hidden = refusal(c, verb, model="cnn", api_key=keys["bob"])
    absent = refusal(c, verb, model="nope", api_key=keys["alice"])
    assert hidden == (p.ErrorCode.NOT_FOUND, wording.unknown_model("cnn"))
    assert absent == (p.ErrorCode.NOT_FOUND, wording.unknown_model("nope"))
    assert call(c, verb, model="mlp", api_key=keys["bob"])
    assert call(c, verb, model="cnn", api_key=keys["alice"])


def test_listings_show_a_tenant_only_its_models(tmp_path) -> None:
    c, keys = table(tmp_path)
    assert [s["name"] for s in call(c, "stats", api_key=keys["bob"])["model_stats"]] == ["mlp"]
    assert [e["name"] for e in call(c, "repository_index", api_key=keys["bob"])] == ["mlp"]
    assert len(call(c, "repository_index", api_key=keys["alice"])) == 2
    assert refusal(c, "repository_index")[0] is p.ErrorCode.UNAUTHORIZED


def test_the_operators_verbs_need_the_admin_token_and_it_sees_everything(tmp_path) -> None:
    c, keys = table(tmp_path)
    code, msg = refusal(c, "status", api_key=keys["alice"])
    assert code is p.ErrorCode.UNAUTHORIZED and "admin token" in msg
    assert refusal(c, "status")[0] is p.ErrorCode.UNAUTHORIZED
    assert call(c, "status", token=TOKEN) == {"workers": []}
    assert len(call(c, "repository_index", token=TOKEN)) == 2
    assert call(c, "metadata", token=TOKEN, model="cnn")
    # a key with the token: the key's tenant decides (the gateway passes its caller's)
    assert refusal(c, "metadata", token=TOKEN, model="cnn", api_key=keys["bob"])[0] is \
        p.ErrorCode.NOT_FOUND
    # a caller's empty key is that caller's, though the call carries the token
    assert refusal(c, "metadata", token=TOKEN, model="cnn", api_key="")[0] is \
        p.ErrorCode.UNAUTHORIZED
    assert call(c, "draining") == {"ok": True}   # the gateway's plumbing stays open


def test_the_control_socket_and_a_broker_without_tenants_are_not_scoped(tmp_path) -> None:
    c, _ = table(tmp_path)
    assert call(c, "metadata", frontend=False, model="cnn")
    assert len(call(c, "repository_index", frontend=False)) == 2
    plain, _ = table(None)
    assert call(plain, "metadata", model="cnn") and call(plain, "status")
    assert call(plain, "metadata", model="cnn", api_key="zs_whatever")


def test_without_an_admin_token_the_operators_verbs_stay_open(tmp_path) -> None:
    c, keys = table(tmp_path, token="")
    assert call(c, "status") == {"workers": []}
    assert refusal(c, "metadata", model="mlp")[0] is p.ErrorCode.UNAUTHORIZED
    assert call(c, "metadata", model="mlp", api_key=keys["bob"])


def test_an_infer_for_a_model_the_tenant_may_not_call_stops_at_the_door(tmp_path) -> None:
    _, keys = table(tmp_path)
    tenancy = Tenancy(tmp_path / "tenants.toml", CollectorRegistry(), lambda: 0.0)
    who = tenancy.identify(p.InferRequest("1", "cnn", [], api_key=keys["bob"]))
    assert isinstance(who, Refusal) and who.code is p.ErrorCode.FORBIDDEN


def test_access_and_whoami_for_the_gateways_own_routes(tmp_path) -> None:
    c, keys = table(tmp_path)
    assert call(c, "access") == {"tenants": True}
    assert call(c, "whoami", api_key=keys["bob"]) == {"tenant": "bob"}
    assert refusal(c, "whoami", api_key="zs_nope")[0] is p.ErrorCode.UNAUTHORIZED
    assert call(c, "whoami", token=TOKEN) == {"tenant": None}
    plain, _ = table(None)
    assert call(plain, "access") == {"tenants": False}
