"""The caller's API key from HTTP headers, passed to the broker, which decides who the
caller is (tenants are enforced there, so direct ZeroMQ clients are governed alike)."""

from __future__ import annotations

from typing import Mapping


def api_key_of(headers: Mapping[str, str]) -> str:
    """``Authorization: Bearer <key>``, else ``X-API-Key``; "" when neither is there."""
    auth = headers.get("authorization", "")
    scheme, _, value = auth.strip().partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return headers.get("x-api-key", "").strip()
