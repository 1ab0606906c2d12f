"""The operator's verbs over the control socket: status, models, drain, undrain, reload,
rollout, rollback, promote.

Exit codes: 0 done; 1 the broker refused (unknown worker or model, bad input, a
load failed); 3 the broker is unreachable or stopped answering; 4 a ``--wait``
ran out of time. Every call to the broker has a deadline, so the CLI never hangs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

from zeroserve.broker import options
from zeroserve.broker.client import Client, ErrorCode, InferError
from zeroserve.broker.runtime import no_socket

EXIT_OK, EXIT_REFUSED, EXIT_UNREACHABLE, EXIT_WAIT_TIMEOUT = 0, 1, 3, 4
POLL_S = 0.1


class WaitTimeout(Exception):
    pass


def _worker(status: dict[str, Any], worker_id: str) -> dict[str, Any] | None:
    return next((w for w in status["workers"] if w["id"] == worker_id), None)


def _wait(client: Client, cond: Callable[[dict[str, Any]], Any], timeout_s: float,
          what: str) -> Any:
    """Poll the broker's status until ``cond`` holds (its value is returned)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond(client.control("status"))
        if value:
            return value
        if time.monotonic() >= deadline:
            raise WaitTimeout(f"gave up after {timeout_s:g} s waiting for {what}")
        time.sleep(POLL_S)  # polling interval of a deadline-bound wait


def _one_worker(args: argparse.Namespace) -> None:
    if bool(args.worker) == bool(args.all):
        raise InferError(ErrorCode.BAD_INPUT, f"{args.verb}: name either a WORKER or --all")


def drain_all(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    """The broker's stop path without the exit: nothing new is admitted, what it holds
    is dispatched and answered; ``--wait`` returns once nothing is queued or running."""
    res = client.control("drain_all")
    if not args.wait:
        return res, f"broker draining: {res['open_requests']} request(s) to finish"
    st = _wait(client, lambda st: st if not st["inflight_batches"]
               and not any(st["queues"].values()) else None,
               args.wait_timeout, "the broker's queue to finish")
    return st, "broker drained: nothing queued or in flight, admitting nothing new"


def drain(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    _one_worker(args)
    if args.all:
        return drain_all(client, args)
    w = client.control("drain", worker=args.worker)
    if args.wait:
        def empty(st: dict[str, Any]) -> Any:
            w = _worker(st, args.worker)
            if w is None:  # it left (drained for shutdown): nothing of ours runs there
                return {"id": args.worker, "state": "gone", "inflight_batches": 0}
            return w if w["inflight_batches"] == 0 else None

        w = _wait(client, empty, args.wait_timeout, f"worker {args.worker} to finish its batches")
        return w, f"worker {args.worker} drained: no batch in flight"
    return w, f"worker {args.worker} draining: {w['inflight_batches']} batch(es) in flight"


def undrain(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    _one_worker(args)
    if args.all:
        return client.control("undrain_all"), "broker admits requests again"
    w = client.control("undrain", worker=args.worker)
    return w, f"worker {args.worker} takes batches again"


def reload(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    if getattr(args, "reload_tenants", False):
        if args.model is not None or args.worker is not None:
            raise InferError(ErrorCode.BAD_INPUT, "--tenants takes no MODEL or --worker")
        res = client.control("reload_tenants")
        return res, f"tenants reloaded from {res['file']}: {', '.join(res['tenants']) or 'none'}"
    if (args.model is None) == (args.worker is None):
        raise InferError(ErrorCode.BAD_INPUT, "name either MODEL[/VERSION] or --worker WORKER")
    if args.worker is not None:
        return _restart(client, args)
    name, _, raw = args.model.partition("/")
    if raw and not raw.isdigit():
        raise InferError(ErrorCode.BAD_INPUT, f"version must be a positive integer, got {raw!r}")
    res = client.control("reload", model=name, version=int(raw) if raw else None)
    if not res["loads"]:
        return res, f"{args.model}: no worker serves it; nothing to reload"
    if not args.wait:
        return res, f"{args.model}: loading afresh on {len(res['loads'])} worker(s)"
    keys = {f"{name}/{v}" for v in res["versions"]}
    status = _wait(client, lambda st: st if not any(keys & set(w["loading"])
                                                    for w in st["workers"]) else None,
                   args.wait_timeout, f"{args.model} to load")
    errors = {f"{w['id']}:{k}": e for w in status["workers"]
              for k, e in w["load_errors"].items() if k in keys}
    if errors:
        raise InferError(ErrorCode.MODEL_ERROR, "reload failed, the old load keeps serving: "
                         + "; ".join(f"{k}: {e}" for k, e in sorted(errors.items())))
    return res, f"{args.model}: reloaded on {len(res['loads'])} worker(s)"


def _restart(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    before = client.control("restart", worker=args.worker)
    if not args.wait:
        return before, (f"worker {args.worker} restarting after "
                        f"{before['inflight_batches']} batch(es) in flight")

    def back(st: dict[str, Any]) -> Any:
        w = _worker(st, args.worker)
        if w and w.get("pid") != before.get("pid") and w["state"] == "ready" \
                and not w["loading"]:
            return w
        return None

    after = _wait(client, back, args.wait_timeout, f"worker {args.worker} to come back")
    return after, (f"worker {args.worker} restarted (pid {before.get('pid')} -> "
                   f"{after.get('pid')}), serving {', '.join(after['models']) or 'nothing'}")


def push(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    """A model file is uploaded; a folder is named for the broker to copy (it must lie
    under one of its import roots)."""
    path = Path(args.path)
    try:
        files: dict[str, Any] = {"data": path.read_bytes()} if path.is_file() else \
            {"model_path": str(path.resolve())}
    except OSError as exc:
        raise InferError(ErrorCode.BAD_INPUT, f"cannot read {args.path}: {exc}") from None
    meta = _pairs(args.meta, "--meta")
    labels = _pairs(args.label, "--label")
    if labels:
        meta["labels"] = labels
    job = client.control("push", model=args.model, version=args.push_version,
                         **({"metadata": meta} if meta else {}), **files)
    deadline = time.monotonic() + args.wait_timeout
    while (st := client.control("register_status", token=job["token"]))["state"] \
            not in ("published", "failed"):
        if time.monotonic() > deadline:
            raise WaitTimeout(f"push of {args.model} still {st['state']} after "
                              f"{args.wait_timeout:g} s")
        time.sleep(0.05)   # the broker answers at once: poll the job
    if st["state"] == "failed":
        code = {"conflict": ErrorCode.CONFLICT, "publish": ErrorCode.CONFLICT,
                "no_worker": ErrorCode.NO_WORKER}.get(st["kind"], ErrorCode.BAD_INPUT)
        raise InferError(code, st["error"])
    done = "unchanged (the same files)" if st["kind"] == "same" else "published"
    return st, f"{args.model}: version {st['versions'][0]} {done}, sha256 {st['sha256'][:12]}"



def _pairs(raw: list[str] | None, flag: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in raw or ():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InferError(ErrorCode.BAD_INPUT, f"{flag} {item!r}: expected KEY=VALUE")
        out[key] = value
    return out


def rollout(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    """``zeroserve rollout MODEL VERSION``: the config's plan, or the one given here."""
    plan: dict[str, Any] = {}
    if args.steps is not None:
        try:
            plan["steps"] = [int(s) for s in args.steps.split(",")]
        except ValueError:
            raise InferError(ErrorCode.BAD_INPUT, f"--steps takes weights such as "
                             f"5,25,50,100, got {args.steps!r}") from None
    for name in ("dwell", "min_requests", "max_error_rate", "max_latency_ratio"):
        value = getattr(args, name)
        if value is not None:
            plan["dwell_s" if name == "dwell" else name] = value
    res = client.control("rollout", model=args.model, version=args.version,
                         **({"stable": args.stable} if args.stable is not None else {}), **plan)
    return res, (f"{args.model}: version {res['canary']} takes "
                 f"{res['weights'][str(res['canary'])]}% of the traffic, version "
                 f"{res['stable']} the rest; steps {res['plan']['steps']} every "
                 f"{res['plan']['dwell_s']:g} s while it stays healthy")


def rollback(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    res = client.control("rollback", model=args.model, version=args.version)
    return res, (f"{args.model}: version {res['rolled_back']} rolled back; version "
                 f"{res['serving']} serves")


def promote(client: Client, args: argparse.Namespace) -> tuple[Any, str]:
    res = client.control("promote", model=args.model, version=args.version)
    retired = f"; version {res['retired']} retired" if res["retired"] is not None else ""
    return res, f"{args.model}: version {res['promoted']} takes all the traffic{retired}"


VERBS: dict[str, Callable[[Client, argparse.Namespace], tuple[Any, str]]] = {
    "drain": drain, "undrain": undrain, "reload": reload, "rollout": rollout,
    "rollback": rollback, "promote": promote, "push": push,
}


def admin_token() -> str:
    """The token that state-changing verbs carry (the broker checks it when it has one)."""
    return os.environ.get("ZEROSERVE_ADMIN_TOKEN", "")


def control_client(args: argparse.Namespace, token: str = "") -> Client:
    """A client of the broker's control socket; where no broker can listen (an ipc://
    socket file that is not there) an UNAVAILABLE error at once, saying where it looked
    and how to look elsewhere, instead of waiting ``--timeout`` for nothing."""
    endpoint = options.endpoints(args).control
    why = no_socket(endpoint)
    if why is not None:
        raise InferError(ErrorCode.UNAVAILABLE, why)
    return Client(endpoint, timeout_s=args.timeout, connect_timeout_s=args.timeout,
                  admin_token=token)


def run_verb(args: argparse.Namespace) -> int:
    """``zeroserve drain|undrain|reload|rollout|rollback|promote``."""
    try:
        with control_client(args, admin_token()) as client:
            result, text = VERBS[args.verb](client, args)
    except InferError as exc:
        code = EXIT_UNREACHABLE if exc.code is ErrorCode.UNAVAILABLE else EXIT_REFUSED
        return fail(args, exc.code.value, exc.message, code)
    except WaitTimeout as exc:
        return fail(args, "timeout", str(exc), EXIT_WAIT_TIMEOUT)
    print(json.dumps(result, indent=2, sort_keys=True) if args.json else text)
    return EXIT_OK


def fail(args: argparse.Namespace, code: str, message: str, exit_code: int) -> int:
    """The message on stderr; with --json also ``{"code": ..., "error": ...}`` on stdout."""
    if args.json:
        print(json.dumps({"code": code, "error": message}, sort_keys=True))
    print(f"zeroserve {args.verb}: {message}", file=sys.stderr)
    return exit_code


def run_control(args: argparse.Namespace) -> int:
    """``zeroserve status|models``: read-only, printed for people or as JSON."""
    try:
        with control_client(args) as client:
            result = client.control(args.verb)
    except InferError as exc:
        return fail(args, exc.code.value, exc.message,
                    EXIT_UNREACHABLE if exc.code is ErrorCode.UNAVAILABLE else EXIT_REFUSED)
    print(json.dumps(result, indent=2, sort_keys=True) if args.json else human(args.verb, result))
    return EXIT_OK


def _autoscaling_lines(models: dict[str, Any]) -> list[str]:
    """Per autoscaled model: its replicas against its bounds, the last decision and why."""
    lines = []
    for name, a in models.items():
        bound = f"{a['min']}..{a['max'] or 'all'}"
        loading = f", loading on {', '.join(a['loading'])}" if a["loading"] else ""
        last = a.get("last") or {}
        lines.append(f"autoscale {name}: {len(a['replicas'])} replica(s) [{bound}] "
                     f"{', '.join(a['replicas']) or '-'}{loading}; last {last.get('action', '-')}"
                     f" {last.get('reason', '')}"
                     f"{' ' + last['detail'] if last.get('detail') else ''}"
                     f" ({last.get('signals', '')})")
        for d in a.get("decisions", [])[-3:]:
            when = time.strftime("%H:%M:%S", time.localtime(d["time"]))
            lines.append(f"  {when} {d['action']} {d['reason']} at {d['replicas']}"
                         f"{' ' + d['worker'] if d['worker'] else ''}")
    return lines


def _mb(n: Any) -> str:
    return f"{n / 1e6:.1f}" if isinstance(n, (int, float)) else "-"


def gpu_columns(gpu: dict[str, Any] | None) -> str:
    """A worker's device as its driver sees it (NVML), or dashes: no GPU, no
    nvidia-ml-py, or (busy only) a MIG slice, whose utilization the driver keeps."""
    gpu = gpu or {}
    busy = gpu.get("utilization")
    memory = (f"{gpu['memory_used_bytes'] / 1e6:.0f}/{gpu['memory_total_bytes'] / 1e6:.0f}"
              if "memory_used_bytes" in gpu else "-")
    return f"{'-' if busy is None else f'{busy:.0%}':>8} {memory:>17}"


def memory_plan_lines(plan: dict[str, Any]) -> list[str]:
    """The placement's view: each device's free memory after headroom, and each version's
    predicted footprint against what its warm-up measured."""
    if not plan:
        return []
    lines = [f"{'MEMORY (MB)':<24} {'DEVICE':<8} {'FREE':>9} {'HEADROOM':>9} "
             f"{'CONTEXT':>8}  MODEL PREDICTED/MEASURED (ERROR)"]
    for wid, w in sorted(plan.items()):
        free = "no limit" if w.get("available_bytes") is None else _mb(w["available_bytes"])
        models = []
        for key, m in w.get("models", {}).items():
            err = f" ({m['error_pct']:+.0f}%)" if "error_pct" in m else ""
            models.append(f"{key} {_mb(m.get('predicted_bytes'))}/"
                          f"{_mb(m.get('measured_bytes'))}{err}")
        lines.append(f"{wid:<24} {w.get('device', '?'):<8} {free:>9} "
                     f"{_mb(w.get('headroom_bytes')):>9} {_mb(w.get('context_bytes')):>8}  "
                     + (", ".join(models) or "-"))
    return lines


def _release_lines(models: dict[str, Any]) -> list[str]:
    """Rollouts and watches in progress, versions rolled back, breakers not closed and
    loads tried again, one line each."""
    lines = []
    for name, m in models.items():
        r = m.get("rollout")
        if r and not r.get("outcome") and r.get("watch"):
            lines.append(f"{name}: version {r['canary']} watched against version "
                         f"{r['stable']} for {r['plan']['dwell_s']:g} s after its swap")
        elif r and not r.get("outcome"):
            lines.append(f"{name}: rollout of version {r['canary']} at "
                         f"{r['weights'][str(r['canary'])]}% (step {r['step'] + 1} of "
                         f"{len(r['plan']['steps'])}) against version {r['stable']}")
        for version, why in (m.get("rolled_back") or {}).items():
            lines.append(f"{name}/{version}: rolled back: {why}")
        b = m.get("breaker") or {}
        if b.get("state", "closed") != "closed":
            lines.append(f"{name}: circuit breaker {b['state'].replace('_', '-')}: "
                         f"{b['reason']}")
        for version, r in (m.get("load_retries") or {}).items():
            lines.append(f"{name}/{version}: load attempt {r['attempts']} of {r['of']} failed "
                         f"({r['last_error']}); tried again in {r['next_in_s']:.1f} s")
    return lines


def _provenance_lines(models: dict[str, Any]) -> list[str]:
    """Where each version came from (its metadata.json), one line each."""
    lines = []
    for name, m in models.items():
        for version, prov in (m.get("provenance") or {}).items():
            fields = [f"{k}={v}" for k, v in prov.items() if k != "labels"]
            fields += [f"label {k}={v}" for k, v in (prov.get("labels") or {}).items()]
            lines.append(f"{name}/{version}: {', '.join(fields)}")
    return lines


def human(verb: str, result: Any) -> str:
    if verb == "status":
        lines = [f"{'WORKER':<24} {'STATE':<9} {'INFLIGHT':>8} {'RSS MB':>8} "
                 f"{'GPU BUSY':>8} {'GPU MB USED/TOTAL':>17}  MODELS"]
        for w in result["workers"]:
            rss = w.get("memory", {}).get("rss_bytes", 0) / 1e6
            lines.append(f"{w['id']:<24} {w['state']:<9} {w['inflight_batches']:>8} "
                         f"{rss:>8.0f} {gpu_columns(w.get('memory', {}).get('gpu'))}  "
                         f"{', '.join(w['models'])}")
        lines.append("queues: " + (", ".join(f"{m}={d}" for m, d in result["queues"].items())
                                   or "none"))
        lines.extend(_autoscaling_lines(result.get("autoscaling") or {}))
        lines += memory_plan_lines(result.get("memory_plan") or {})
        for name, t in result.get("tenants", {}).items():
            rejected = sum(t["rejected"].values())
            lines.append(f"tenant {name}: {t['rate']:.2f} req/s, {t['inflight']} in flight, "
                         f"{rejected} rejected, {t.get('compute_s', 0.0):.1f} s of compute")
        return "\n".join(lines)
    if verb == "models":
        lines = [f"{'MODEL':<20} {'VERSIONS':<12} {'READY':<12} {'STATE':<10} WORKERS"]
        for name, m in result["models"].items():
            # a model loaded on demand says which of available, loading, ready, evicted
            state = m.get("state") or ("ready" if m["ready"] else "-")
            lines.append(f"{name:<20} {','.join(map(str, m['versions'])):<12} "
                         f"{','.join(map(str, m['ready'])) or '-':<12} {state:<10} "
                         f"{', '.join(m['workers'])}")
        for name, err in result["errors"].items():
            lines.append(f"{name:<20} ERROR {err}")
        lines += [f"{name}: {m.get('reason', '')}" for name, m in result["models"].items()
                  if m.get("state") == "too_big"]
        return "\n".join(lines + _release_lines(result["models"])
                         + _provenance_lines(result["models"]))
    return json.dumps(result, indent=2, sort_keys=True)
