"""Schemathesis hooks (loaded by SCHEMATHESIS_HOOKS in test_openapi.py): a check that
fails on HTTP 500 alone, since 503 and 504 are declared answers a fuzzer can earn
(a one-microsecond timeout is a legitimate 504)."""

from __future__ import annotations

from typing import Any

import schemathesis


@schemathesis.check
def no_internal_error(ctx: Any, response: Any, case: Any) -> bool | None:
    if response.status_code == 500:
        raise AssertionError(f"HTTP 500: {response.text[:500]}")
    return None
