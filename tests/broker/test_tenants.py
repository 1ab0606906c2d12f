"""The tenants file, keys and the token bucket: pure, with a fake clock."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from tests.conftest import examples
from zeroserve.broker.server.tenants import TenantsError, TokenBucket, load, new_key, parse, \
    with_key, write_atomically


def test_a_file_parses_into_tenants_with_defaults() -> None:
    key, hashed = new_key()
    ts = parse(f"""
[tenants.alice]
keys = ["{hashed}"]
qos = "guaranteed"
rate = 10
max_inflight = 4
models = ["mlp"]
max_timeout_ms = 500
weight = 3

[tenants.bob]
""")
    alice, bob = ts.tenants["alice"], ts.tenants["bob"]
    assert (alice.rate, alice.burst, alice.max_inflight, alice.weight) == (10, 10, 4, 3)
    assert alice.allows("mlp") and not alice.allows("other")
    assert bob.allows("anything") and bob.qos.name == "best_effort" and bob.rate == 0
    assert ts.identify(key) == "alice"
    assert ts.identify(key + "x") is None and ts.identify("") is None
    assert ts.identify("zs_00112233445566778899_" + "a" * 32) is None


def test_priority_clamped_to_the_class_and_timeout_to_the_tenant() -> None:
    t = parse('[tenants.b]\nqos = "best_effort"\nmax_timeout_ms = 100\n').tenants["b"]
    assert t.clamp_priority(0) == (2, False)     # the class's default
    assert t.clamp_priority(1) == (2, True)      # above the class's highest
    assert t.clamp_priority(3) == (3, False)
    assert t.clamp_timeout(50) == (50, False)
    assert t.clamp_timeout(500) == (100, True)
    assert t.clamp_timeout(0) == (100, False)   # no timeout named: the tenant's maximum


@pytest.mark.parametrize("text, where", [
    ('[tenants.a]\nrate = -1\n', "line 2: tenant a, field 'rate'"),
    ('[tenants.a]\n\nqos = "gold"\n', "line 3: tenant a, field 'qos'"),
    ('[tenants.a]\nweight = 0\n', "line 2: tenant a, field 'weight'"),
    ('[tenants.a]\nkeys = ["plain-secret"]\n', "line 2: tenant a, field 'keys'"),
    ('[tenants.a]\nmax_inflight = 1.5\n', "line 2: tenant a, field 'max_inflight'"),
    ('[tenants.a]\nmodels = "mlp"\n', "line 2: tenant a, field 'models'"),
    ('[tenants.a]\nrat = 1\n', "line 2: tenant a, field 'rat': unknown field"),
    ('[tenants.anonymous]\n', "line 1: tenant anonymous"),
    ('[qos.gold]\n', "line 1: qos.gold"),
    ('[tenants.a]\nrate = \n', "line 2"),                 # TOML syntax: the parser's line
])
def test_errors_name_the_line_tenant_and_field(text: str, where: str) -> None:
    with pytest.raises(TenantsError, match="tenants file f.toml, " + where.replace(".", r"\.")
                       if not where.startswith("line 2") or "field" in where else where):
        parse(text, "f.toml")


def test_a_key_shared_by_two_tenants_is_an_error() -> None:
    _, hashed = new_key()
    with pytest.raises(TenantsError, match=r"line 4: tenant b, field 'keys': .*tenant 'a'"):
        parse(f'[tenants.a]\nkeys = ["{hashed}"]\n[tenants.b]\nkeys = ["{hashed}"]\n', "f")


def test_add_key_edits_the_text_and_keeps_comments(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text('# our tenants\n[tenants.a]\nrate = 5  # per second\n'
                    '[tenants.b]\nkeys = [\n]\n')
    for name in ("a", "b", "a"):
        key, hashed = new_key()
        write_atomically(path, with_key(path.read_text(), name, hashed, str(path)))
        assert load(path).identify(key) == name
    text = path.read_text()
    assert "# our tenants" in text and "# per second" in text
    assert len(load(path).tenants["a"].keys) == 2
    with pytest.raises(TenantsError, match="no tenant 'c'"):
        with_key(text, "c", new_key()[1])
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left behind


@settings(max_examples=examples(200))
@given(rate=st.floats(0.5, 1000), burst=st.floats(1, 100),
       gaps=st.lists(st.floats(0, 0.5), min_size=1, max_size=200),
       sizes=st.lists(st.integers(1, 5), min_size=200, max_size=200))
def test_bucket_never_admits_more_than_burst_plus_rate_times_t(
        rate: float, burst: float, gaps: list[float], sizes: list[int]) -> None:
    b = TokenBucket(rate, burst, 0.0)
    now, taken = 0.0, []
    for gap, n in zip(gaps, sizes):
        now += gap
        wait = b.retry_after(n, now)
        ok = b.take(n, now)
        assert ok == (wait == 0.0)
        if not ok and not math.isinf(wait):
            assert copy.copy(b).can_take(n, now + wait + 1e-9)  # retry_after is enough
        if ok:
            taken.append((now, n))
    for i, (t0, _) in enumerate(taken):  # every window that starts at an admission
        total = 0
        for t1, n in taken[i:]:
            total += n
            assert total <= burst + rate * (t1 - t0) + 1e-6


def test_bucket_resized_on_reload_keeps_what_was_spent() -> None:
    b = TokenBucket(1.0, 10.0, 0.0)
    assert b.take(10, 0.0)
    r = b.resized(2.0, 20.0, 1.0)
    assert r.available(1.0) == pytest.approx(1.0)
    assert r.retry_after(3, 1.0) == pytest.approx(1.0)
