"""The broker's tenant accounting with a fake clock: in-flight held from admission to
the one answer, reloads keep counts and spent tokens, labels stay bounded."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from zeroserve.broker import protocol as p
from zeroserve.broker.server.tenancy import Grant, Refusal, Tenancy
from zeroserve.broker.server.tenants import Tenant, TenantsError, new_key


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def setup(tmp_path: Path, body: str) -> tuple[Tenancy, str, Path, Clock]:
    key, hashed = new_key()
    path = tmp_path / "t.toml"
    path.write_text(f'[tenants.a]\nkeys = ["{hashed}"]\n{body}')
    clock = Clock()
    return Tenancy(path, CollectorRegistry(), clock), key, path, clock


def req(key: str, rid: str = "1", model: str = "m", priority: int = 0) -> p.InferRequest:
    return p.InferRequest(rid, model, [], priority=priority, api_key=key)


def admit(t: Tenancy, key: str, rid: str, now: float = 0.0) -> Grant | Refusal:
    who = t.identify(req(key, rid))
    assert isinstance(who, Tenant)
    return t.admit(who, ("c", rid), req(key, rid), 1, now)


def test_without_a_file_everyone_is_anonymous_and_nothing_is_refused() -> None:
    t = Tenancy(None, CollectorRegistry(), lambda: 0.0)
    who = t.identify(req(""))
    assert isinstance(who, Tenant) and who.name == "anonymous"
    g = t.admit(who, ("c", "1"), req("", priority=1), 1, 0.0)
    assert isinstance(g, Grant) and g.request.priority == 1 and not g.notes
    with pytest.raises(TenantsError, match="without a tenants file"):
        t.reload()


def test_inflight_is_held_until_the_answer(tmp_path: Path) -> None:
    t, key, _, _ = setup(tmp_path, "max_inflight = 2\n")
    assert isinstance(admit(t, key, "1"), Grant) and isinstance(admit(t, key, "2"), Grant)
    r = admit(t, key, "3")
    assert isinstance(r, Refusal) and r.code is p.ErrorCode.QUOTA and r.retry_after_s == 1.0
    t.release(("c", "1"))
    t.release(("c", "1"))  # a second release of one key changes nothing
    assert isinstance(admit(t, key, "4"), Grant)
    assert isinstance(admit(t, key, "5"), Refusal)
    assert t.describe()["tenants"]["a"]["inflight"] == 2


def test_rate_refusal_says_when_to_retry_and_reload_keeps_spent_tokens(tmp_path: Path) -> None:
    t, key, path, clock = setup(tmp_path, "rate = 2\nburst = 2\n")
    assert isinstance(admit(t, key, "1"), Grant) and isinstance(admit(t, key, "2"), Grant)
    r = admit(t, key, "3")
    assert isinstance(r, Refusal) and r.retry_after_s == pytest.approx(0.5)
    path.write_text(path.read_text().replace("burst = 2", "burst = 4"))
    t.reload()
    assert isinstance(admit(t, key, "4"), Refusal)    # the reload gave no fresh burst
    clock.now = 0.5
    assert isinstance(admit(t, key, "5", now=0.5), Grant)
    assert t.describe()["tenants"]["a"]["inflight"] == 3  # counts survived the reload


def test_a_broken_reload_keeps_the_old_tenants(tmp_path: Path) -> None:
    t, key, path, _ = setup(tmp_path, "")
    path.write_text(path.read_text() + "weight = -1\n")
    with pytest.raises(TenantsError, match="line 3: tenant a, field 'weight'"):
        t.reload()
    assert isinstance(t.identify(req(key)), Tenant)


def test_metric_labels_are_configured_names_or_unknown(tmp_path: Path) -> None:
    reg = CollectorRegistry()
    key, hashed = new_key()
    path = tmp_path / "t.toml"
    path.write_text(f'[tenants.a]\nkeys = ["{hashed}"]\nmodels = []\n')
    t = Tenancy(path, reg, lambda: 0.0)
    for i in range(50):
        assert isinstance(t.identify(req(f"zs_{i:016x}_{'x' * 20}")), Refusal)
    forbidden = t.identify(req(key))   # a model it may not call: refused at the door
    assert isinstance(forbidden, Refusal) and forbidden.code is p.ErrorCode.FORBIDDEN
    t.rejected("someone-else", p.ErrorCode.DEADLINE)
    text = generate_latest(reg).decode()
    tenants = {line.split('tenant="')[1].split('"')[0] for line in text.splitlines()
               if 'tenant="' in line}
    assert tenants == {"a", "unknown"}


def test_samples_rate_is_a_second_bucket(tmp_path: Path) -> None:
    t, key, _, _ = setup(tmp_path, "samples_rate = 10\nsamples_burst = 8\n")
    who = t.identify(req(key))
    assert isinstance(who, Tenant)
    assert isinstance(t.admit(who, ("c", "1"), req(key, "1"), 6, 0.0), Grant)
    r = t.admit(who, ("c", "2"), req(key, "2"), 6, 0.0)
    assert isinstance(r, Refusal) and "samples rate" in r.message
    assert r.retry_after_s == pytest.approx(0.4)
    r = t.admit(who, ("c", "3"), req(key, "3"), 9, 0.0)   # more than the burst: never
    assert isinstance(r, Refusal) and r.retry_after_s is None and "burst" in r.message


def test_tokens_per_minute_refuse_with_the_quota_named(tmp_path: Path) -> None:
    t, key, _, clock = setup(tmp_path, "tokens_per_minute = 600\nrate = 100\n")
    who = t.identify(req(key))
    assert isinstance(who, Tenant)
    assert isinstance(t.admit(who, ("c", "1"), req(key, "1"), 1, 0.0, tokens=500), Grant)
    r = t.admit(who, ("c", "2"), req(key, "2"), 1, 0.0, tokens=200)
    assert isinstance(r, Refusal) and r.code is p.ErrorCode.QUOTA
    assert "tokens per minute" in r.message and r.retry_after_s == pytest.approx(10.0)
    clock.now = 10.0
    assert isinstance(t.admit(who, ("c", "3"), req(key, "3"), 1, 10.0, tokens=200), Grant)
    r = t.admit(who, ("c", "4"), req(key, "4"), 1, 10.0, tokens=5000)
    assert isinstance(r, Refusal) and "5000 tokens is more than" in r.message
    assert t.describe()["tenants"]["a"]["tokens_per_minute_limit"] == 600


def test_completion_tokens_are_charged_as_they_come_below_empty(tmp_path: Path) -> None:
    t, key, _, clock = setup(tmp_path, "tokens_per_minute = 600\n")
    who = t.identify(req(key))
    assert isinstance(who, Tenant)
    assert isinstance(t.admit(who, ("c", "1"), req(key, "1"), 1, 0.0, tokens=100), Grant)
    t.completion_tokens("a", 550, 0.0)   # the stream runs on past the quota: 50 over
    t.completion_tokens("nobody", 5, 0.0)   # a tenant not counted: nothing to charge
    r = t.admit(who, ("c", "2"), req(key, "2"), 1, 0.0, tokens=10)
    assert isinstance(r, Refusal) and "prompt and completion tokens" in r.message
    assert r.retry_after_s == pytest.approx(6.0)   # 60 tokens at 10 a second
    clock.now = 6.0
    assert isinstance(t.admit(who, ("c", "3"), req(key, "3"), 1, 6.0, tokens=10), Grant)


def test_the_inputs_of_one_request_count_once_against_its_rate_and_places(tmp_path: Path
                                                                           ) -> None:
    t, key, _, _ = setup(tmp_path, "rate = 1\nburst = 1\nmax_inflight = 1\n")
    who = t.identify(req(key))
    assert isinstance(who, Tenant)
    rows = [p.InferRequest(f"r{i}", "m", [], api_key=key, row=i) for i in range(5)]
    for i, r in enumerate(rows):
        assert isinstance(t.admit(who, ("c", f"r{i}"), r, 1, 0.0), Grant)
    assert t.open_count() == 1    # the request, not its five inputs
    assert isinstance(admit(t, key, "other"), Refusal)
    for i in range(5):
        t.release(("c", f"r{i}"))
    assert t.open_count() == 0


def test_compute_time_quota_is_spent_once_measured_and_refuses_while_in_debt(
        tmp_path: Path) -> None:
    t, key, _, clock = setup(tmp_path, "compute_per_minute = 6\ncompute_burst = 1\n")
    assert isinstance(admit(t, key, "1"), Grant)
    t.used([("a", 1.5)], 0.0)            # the batch ran longer than the whole burst
    r = admit(t, key, "2")
    assert isinstance(r, Refusal) and r.code is p.ErrorCode.QUOTA
    assert "compute time per minute" in r.message
    assert r.retry_after_s == pytest.approx(5.0)    # 0.5 s of debt at 0.1 s a second
    clock.now = 5.0
    assert isinstance(admit(t, key, "3", 5.0), Grant)
    a = t.describe()["tenants"]["a"]
    assert a["compute_s"] == pytest.approx(1.5) and a["compute_per_minute_limit"] == 6
    assert t.describe()["share"] == "requests"


def test_share_by_compute_marks_every_grant_and_a_bad_share_is_refused(tmp_path: Path
                                                                       ) -> None:
    key, hashed = new_key()
    path = tmp_path / "t.toml"
    path.write_text(f'share = "compute"\n[tenants.a]\nkeys = ["{hashed}"]\n')
    reg = CollectorRegistry()
    t = Tenancy(path, reg, Clock())
    g = admit(t, key, "1")
    assert isinstance(g, Grant) and g.by_time
    path.write_text(f'share = "cpu"\n[tenants.a]\nkeys = ["{hashed}"]\n')
    with pytest.raises(TenantsError, match="share must be one of"):
        t.reload()
    t.used([("a", 0.25), ("a", 0.25), ("gone", 1.0)], 0.0)
    assert t.describe()["tenants"]["a"]["compute_s"] == pytest.approx(0.5)
    assert 'zeroserve_tenant_compute_seconds_total{tenant="a"} 0.5' in \
        generate_latest(reg).decode()
