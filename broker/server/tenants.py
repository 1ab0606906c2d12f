"""The tenants file and its types: who may call, what each may use. Pure: the file's
text in, typed tenants out; every time is an argument (a fake clock in tests). The
broker applies them to requests in :mod:`tenancy` (identify, admit, release).

The file (TOML)::

    [qos.burstable]                 # optional: override a class's priorities
    default_priority = 2
    max_priority = 1

    [tenants.alice]
    keys = ["sha256$<salt-hex>$<digest-hex>"]   # written by `zeroserve tenants add-key`
    qos = "guaranteed"              # guaranteed | burstable | best_effort
    rate = 100.0                    # requests/s (token bucket; 0: no limit)
    burst = 200                     # bucket size (default: max(rate, 1))
    samples_rate = 0                # samples/s (0: no limit); samples_burst likewise
    tokens_per_minute = 0           # text models' tokens (0: no limit); tokens_burst
                                    # (default: a minute's worth)
    compute_per_minute = 0          # seconds of worker time a minute (0: no limit);
                                    # compute_burst (default: a minute's worth)
    max_inflight = 64               # admitted, not yet answered (0: no limit)
    models = ["mlp"]                # or "*" (the default): every model
    max_timeout_ms = 1000           # longer timeouts are clamped (0: no limit)
    weight = 1.0                    # share under contention, within a priority

Keys are never stored in clear. A key looks like ``zs_<salt>_<secret>``; the file holds
``sha256$<salt>$sha256(salt + key)``. The salt travels in the key, so the broker hashes
a presented key once (one SHA-256, about a microsecond) whatever the number of tenants;
a slow hash (scrypt) would buy nothing for 190-bit random keys and would cost every
request milliseconds.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import re
import secrets
import tempfile
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ANONYMOUS, UNKNOWN = "anonymous", "unknown"   # metric labels beside the configured names
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_HASH = re.compile(r"^sha256\$([0-9a-f]{16,64})\$([0-9a-f]{64})$")
_KEY = re.compile(r"^zs_([0-9a-f]{16,64})_[A-Za-z0-9_-]{16,128}$")
MAX_KEY_LEN = 256


class TenantsError(ValueError):
    """A bad tenants file: the message names the file, the line where known, the tenant
    and the field."""


@dataclass(frozen=True)
class QosClass:
    name: str
    rank: int               # shed order under overload: the highest rank goes first
    default_priority: int   # for a request that names none (0)
    max_priority: int       # the highest (numerically smallest) a request may ask for


DEFAULT_QOS = {
    "guaranteed": QosClass("guaranteed", 0, 1, 1),
    "burstable": QosClass("burstable", 1, 2, 1),
    "best_effort": QosClass("best_effort", 2, 2, 2),
}


@dataclass(frozen=True)
class Tenant:
    name: str
    qos: QosClass
    keys: tuple[str, ...] = ()
    rate: float = 0.0
    burst: float = 1.0
    samples_rate: float = 0.0
    samples_burst: float = 1.0
    tokens_per_minute: float = 0.0
    tokens_burst: float = 1.0
    compute_per_minute: float = 0.0   # worker seconds its rows may use a minute
    compute_burst: float = 1.0
    max_inflight: int = 0
    models: frozenset[str] | None = None        # None: every model
    max_timeout_ms: float = 0.0
    weight: float = 1.0

    def allows(self, model: str) -> bool:
        return self.models is None or model in self.models

    def clamp_priority(self, priority: int) -> tuple[int, bool]:
        """(priority to use, whether it was clamped); 0 means the class's default."""
        if priority <= 0:
            return self.qos.default_priority, False
        if priority < self.qos.max_priority:
            return self.qos.max_priority, True
        return priority, False

    def clamp_timeout(self, timeout_ms: float) -> tuple[float, bool]:
        """A request naming no timeout (0) gets the maximum too, so a tenant's limit holds
        even where a model's default timeout is longer or absent."""
        if self.max_timeout_ms <= 0:
            return timeout_ms, False
        if timeout_ms <= 0:
            return self.max_timeout_ms, False
        if timeout_ms > self.max_timeout_ms:
            return self.max_timeout_ms, True
        return timeout_ms, False


@dataclass(frozen=True)
class TenantSet:
    tenants: dict[str, Tenant] = field(default_factory=dict)
    # salt -> digest -> tenant name: one hash per presented key
    index: dict[str, dict[str, str]] = field(default_factory=dict)
    share: str = "requests"     # what fair shares count: "requests" or "compute"

    def identify(self, key: str) -> str | None:
        """The tenant a key belongs to, or None."""
        if not key or len(key) > MAX_KEY_LEN:
            return None
        m = _KEY.match(key)
        digests = self.index.get(m.group(1)) if m else None
        if not digests:
            return None
        digest = _digest(m.group(1), key)  # type: ignore[union-attr]
        for stored, name in digests.items():
            if hmac.compare_digest(stored, digest):
                return name
        return None


# -- keys ---------------------------------------------------------------------

def _digest(salt: str, key: str) -> str:
    return hashlib.sha256(bytes.fromhex(salt) + key.encode()).hexdigest()


def new_key() -> tuple[str, str]:
    """(key to hand out once, hash to store)."""
    salt = secrets.token_hex(8)
    key = f"zs_{salt}_{secrets.token_urlsafe(24)}"
    return key, f"sha256${salt}${_digest(salt, key)}"


# -- parsing ------------------------------------------------------------------

class _Where:
    """Names the place of an error: file, line of the field (best effort: the TOML
    parser keeps no positions, so the text is searched), tenant and field."""

    def __init__(self, path: str, text: str) -> None:
        self.path = path
        self.lines = text.splitlines()

    def line_of(self, table: str, key: str | None) -> int | None:
        header = re.compile(r"^\s*\[\s*" + re.escape(table).replace(r"\.", r"\s*\.\s*")
                            + r"\s*\]")
        inside, found = False, None
        for i, line in enumerate(self.lines, 1):
            if line.lstrip().startswith("["):
                inside = bool(header.match(line))
                if inside and found is None:
                    found = i
                    if key is None:
                        return i
                continue
            if inside and key is not None and re.match(rf"^\s*{re.escape(key)}\s*=", line):
                return i
        return found

    def error(self, table: str, key: str | None, what: str) -> TenantsError:
        line = self.line_of(table, key)
        at = f", line {line}" if line else ""
        subject = table.replace("tenants.", "tenant ", 1) if table.startswith("tenants.") \
            else table
        fld = f", field {key!r}" if key else ""
        return TenantsError(f"tenants file {self.path}{at}: {subject}{fld}: {what}")


def _number(w: _Where, table: str, doc: dict[str, Any], key: str, default: float,
            minimum: float, strict: bool = False) -> float:
    v = doc.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
            or v < minimum or (strict and v == minimum):
        bound = f"> {minimum:g}" if strict else f">= {minimum:g}"
        raise w.error(table, key, f"must be a finite number {bound}, got {v!r}")
    return float(v)


def _qos_classes(w: _Where, doc: Any) -> dict[str, QosClass]:
    if not isinstance(doc, dict):
        raise w.error("qos", None, "must be a table of classes")
    out = dict(DEFAULT_QOS)
    for name, body in doc.items():
        table = f"qos.{name}"
        if name not in DEFAULT_QOS:
            raise w.error(table, None, f"unknown class (known: {', '.join(DEFAULT_QOS)})")
        if not isinstance(body, dict):
            raise w.error(table, None, "must be a table")
        extra = set(body) - {"default_priority", "max_priority"}
        if extra:
            raise w.error(table, sorted(extra)[0], "unknown field")
        base = DEFAULT_QOS[name]
        prio = {}
        for key in ("default_priority", "max_priority"):
            v = body.get(key, getattr(base, key))
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise w.error(table, key, f"must be an integer >= 1, got {v!r}")
            prio[key] = v
        if prio["default_priority"] < prio["max_priority"]:
            raise w.error(table, "default_priority", "is above max_priority (1 is highest)")
        out[name] = QosClass(name, base.rank, prio["default_priority"], prio["max_priority"])
    return out


_FIELDS = {"keys", "qos", "rate", "burst", "samples_rate", "samples_burst", "max_inflight",
           "models", "max_timeout_ms", "weight", "tokens_per_minute", "tokens_burst",
           "compute_per_minute", "compute_burst"}
SHARES = ("requests", "compute")


def _tenant(w: _Where, name: str, body: Any, classes: dict[str, QosClass]) -> Tenant:
    table = f"tenants.{name}"
    if not _NAME.match(name) or name in (ANONYMOUS, UNKNOWN):
        raise w.error(table, None, "a name is 1-64 letters, digits, '_', '.', '-' (and not "
                      f"{ANONYMOUS!r} or {UNKNOWN!r})")
    if not isinstance(body, dict):
        raise w.error(table, None, "must be a table")
    extra = set(body) - _FIELDS
    if extra:
        raise w.error(table, sorted(extra)[0],
                      f"unknown field (known: {', '.join(sorted(_FIELDS))})")
    keys = body.get("keys", [])
    if not isinstance(keys, list) or not all(isinstance(k, str) and _HASH.match(k) for k in keys):
        raise w.error(table, "keys", "must be a list of 'sha256$<salt-hex>$<digest-hex>' "
                      "hashes (keys are never stored in clear; use zeroserve tenants add-key)")
    qos = body.get("qos", "best_effort")
    if qos not in classes:
        raise w.error(table, "qos", f"{qos!r} is not one of {', '.join(classes)}")
    models = body.get("models", "*")
    if models != "*" and (not isinstance(models, list)
                          or not all(isinstance(m, str) and m for m in models)):
        raise w.error(table, "models", "must be a list of model names or \"*\"")
    inflight = body.get("max_inflight", 0)
    if isinstance(inflight, bool) or not isinstance(inflight, int) or inflight < 0:
        raise w.error(table, "max_inflight", f"must be an integer >= 0, got {inflight!r}")
    rate = _number(w, table, body, "rate", 0.0, 0.0)
    srate = _number(w, table, body, "samples_rate", 0.0, 0.0)
    tpm = _number(w, table, body, "tokens_per_minute", 0.0, 0.0)
    cpm = _number(w, table, body, "compute_per_minute", 0.0, 0.0)
    return Tenant(
        name=name, qos=classes[qos], keys=tuple(keys), rate=rate,
        burst=_number(w, table, body, "burst", max(rate, 1.0), 1.0),
        samples_rate=srate,
        samples_burst=_number(w, table, body, "samples_burst", max(srate, 1.0), 1.0),
        tokens_per_minute=tpm,
        tokens_burst=_number(w, table, body, "tokens_burst", max(tpm, 1.0), 1.0),
        compute_per_minute=cpm,
        compute_burst=_number(w, table, body, "compute_burst", max(cpm, 0.001), 0.0,
                              strict=True),
        max_inflight=inflight,
        models=None if models == "*" else frozenset(models),
        max_timeout_ms=_number(w, table, body, "max_timeout_ms", 0.0, 0.0),
        weight=_number(w, table, body, "weight", 1.0, 0.0, strict=True))


def parse(text: str, path: str = "<tenants>") -> TenantSet:
    """The tenants of a file's text; raises TenantsError naming line, tenant and field."""
    w = _Where(path, text)
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TenantsError(f"tenants file {path}: {exc}") from None
    extra = set(doc) - {"tenants", "qos", "share"}
    if extra:
        raise w.error(sorted(extra)[0], None, "unknown table (known: tenants, qos, share)")
    share = doc.get("share", "requests")
    if share not in SHARES:
        raise TenantsError(f"tenants file {path}: share must be one of "
                           f"{', '.join(map(repr, SHARES))}, got {share!r}")
    classes = _qos_classes(w, doc.get("qos", {}))
    raw = doc.get("tenants", {})
    if not isinstance(raw, dict):
        raise w.error("tenants", None, "must be a table of tenants")
    tenants: dict[str, Tenant] = {}
    index: dict[str, dict[str, str]] = {}
    for name, body in raw.items():
        t = _tenant(w, name, body, classes)
        for h in t.keys:
            m = _HASH.match(h)
            assert m is not None  # checked by _tenant
            owner = index.setdefault(m.group(1), {}).setdefault(m.group(2), name)
            if owner != name:
                raise w.error(f"tenants.{name}", "keys", f"a key hash is also tenant "
                              f"{owner!r}'s: a key belongs to one tenant")
        tenants[name] = t
    return TenantSet(tenants, index, share)


def load(path: Path) -> TenantSet:
    try:
        text = path.read_text()
    except OSError as exc:
        raise TenantsError(f"cannot read tenants file {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise TenantsError(f"tenants file {path} is not UTF-8 text") from None
    return parse(text, str(path))


# -- add-key: a textual edit, so the operator's comments and layout stay ---------

def with_key(text: str, tenant: str, hashed: str, path: str = "<tenants>") -> str:
    """The file's text with ``hashed`` added to the tenant's keys; validated."""
    current = parse(text, path)
    if tenant not in current.tenants:
        raise TenantsError(f"tenants file {path}: no tenant {tenant!r} "
                           f"(known: {', '.join(sorted(current.tenants)) or 'none'})")
    w = _Where(path, text)
    header = w.line_of(f"tenants.{tenant}", None)
    keys_line = w.line_of(f"tenants.{tenant}", "keys")
    lines = text.splitlines(keepends=True)
    if keys_line is not None and keys_line != header:
        i = keys_line - 1
        lines[i] = re.sub(r"=\s*\[", f'= ["{hashed}", ', lines[i], count=1)
    elif header is not None:
        lines.insert(header, f'keys = ["{hashed}"]\n')
    else:  # a dotted or inline form the search cannot place
        raise TenantsError(f"tenants file {path}: tenant {tenant!r} is not a [tenants.{tenant}] "
                           "table; add the key by hand")
    out = "".join(lines)
    if hashed not in parse(out, path).tenants[tenant].keys:
        raise TenantsError(f"tenants file {path}: could not add the key to tenant {tenant!r}")
    return out


def write_atomically(path: Path, text: str) -> None:
    """Readers (a reload racing the write) see the old file or the new one, never half."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if path.exists():
            os.chmod(tmp, path.stat().st_mode & 0o7777)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# -- rate limiting --------------------------------------------------------------

class TokenBucket:
    """``rate`` tokens a second up to ``burst``; starts full. Over any window of t
    seconds at most burst + rate*t tokens are taken (and :meth:`spend`: what is used
    after the fact, compute time, can go below zero and is paid back before more)."""

    __slots__ = ("rate", "burst", "tokens", "stamp")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.stamp = now

    def _refill(self, now: float) -> None:
        if now > self.stamp:
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now

    def available(self, now: float) -> float:
        self._refill(now)
        return self.tokens

    def can_take(self, n: float, now: float) -> bool:
        return self.available(now) >= n

    def take(self, n: float, now: float) -> bool:
        if not self.can_take(n, now):
            return False
        self.tokens -= n
        return True

    def spend(self, n: float, now: float) -> None:
        """Take ``n`` whatever is there: use already made (a generated token) is paid,
        below empty if need be, and the next take waits for the refill."""
        self._refill(now)
        self.tokens -= n

    def retry_after(self, n: float, now: float) -> float:
        """Seconds until ``n`` tokens are there (inf if more than the bucket holds)."""
        missing = n - self.available(now)
        if missing <= 0:
            return 0.0
        if n > self.burst or self.rate <= 0:
            return math.inf
        return missing / self.rate

    def resized(self, rate: float, burst: float, now: float) -> "TokenBucket":
        """The bucket under a reloaded limit, keeping what was spent (a reload must not
        hand every tenant a fresh burst)."""
        b = TokenBucket(rate, burst, now)
        b.tokens = min(burst, self.available(now))
        return b
