"""``zeroserve tenants``: show each tenant's limits, rate, in-flight and rejections (the
broker's read-only ``tenants`` verb), or ``add-key NAME --tenants FILE``: a new key,
printed once, its hash written into the file (atomically; reload the broker after).

Exit codes as :mod:`admin`: 0 done, 1 refused (bad file, unknown tenant), 3 the broker
is unreachable.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from zeroserve.broker.admin import EXIT_OK, EXIT_REFUSED, EXIT_UNREACHABLE, control_client, \
    fail
from zeroserve.broker.client import ErrorCode, InferError
from zeroserve.broker.server.tenants import TenantsError, new_key, with_key, write_atomically


def add_key(args: argparse.Namespace) -> int:
    if not args.name or not args.tenants:
        return fail(args, "bad_input", "usage: zeroserve tenants add-key NAME --tenants FILE",
                    EXIT_REFUSED)
    path = Path(args.tenants)
    key, hashed = new_key()
    try:
        text = with_key(path.read_text(), args.name, hashed, str(path))
        write_atomically(path, text)
    except (OSError, TenantsError) as exc:
        return fail(args, "bad_input", str(exc), EXIT_REFUSED)
    if args.json:
        print(json.dumps({"tenant": args.name, "key": key, "hash": hashed}, sort_keys=True))
    else:
        print(key)
        print(f"(key for tenant {args.name!r}, shown once; its hash is in {path}: run "
              "`zeroserve reload --tenants` or send the broker SIGHUP)", file=sys.stderr)
    return EXIT_OK


def show(args: argparse.Namespace) -> int:
    try:
        with control_client(args) as client:
            result = client.control("tenants")
    except InferError as exc:
        return fail(args, exc.code.value, exc.message,
                    EXIT_UNREACHABLE if exc.code is ErrorCode.UNAVAILABLE else EXIT_REFUSED)
    print(json.dumps(result, indent=2, sort_keys=True) if args.json else human(result))
    return EXIT_OK


def human(result: dict[str, Any]) -> str:
    if not result["enabled"]:
        return "no tenants file: every caller is the anonymous tenant"
    lines = [f"{'TENANT':<20} {'QOS':<12} {'RATE/S':>8} {'LIMIT':>8} {'INFLIGHT':>9} "
             f"{'ADMITTED':>9}  REJECTED"]
    for name, t in result["tenants"].items():
        limit = f"{t['rate_limit']:g}" if t["rate_limit"] else "-"
        inflight = f"{t['inflight']}/{t['max_inflight'] or '-'}"
        rejected = ", ".join(f"{k}={v}" for k, v in sorted(t["rejected"].items())) or "-"
        lines.append(f"{name:<20} {t['qos']:<12} {t['rate']:>8.2f} {limit:>8} {inflight:>9} "
                     f"{t['admitted']:>9}  {rejected}")
    lines.append(f"file: {result['file']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    return add_key(args) if args.action == "add-key" else show(args)
