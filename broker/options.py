"""The command line's options, declared once for every component, and how the config
file and the environment apply to them (see :mod:`config`).

Torch-free and import-free: this module only describes arguments. ``bin/zeroserve``
dispatches a subcommand to the component that runs it, and each component's own
``main(argv)`` (``python -m zeroserve.workers.main`` and so on, which is how
``zeroserve serve`` starts them) parses its arguments here too.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path
from typing import Any, Callable, Sequence

from zeroserve.broker import config
from zeroserve.broker.runtime import Endpoints, cache_dir, runtime_dir


def endpoints(args: argparse.Namespace) -> Endpoints:
    """The endpoints the arguments name (a control verb has no --frontend or --backend)."""
    base = Endpoints.in_dir(Path(args.runtime_dir) if args.runtime_dir else None)
    return Endpoints(getattr(args, "frontend", None) or base.frontend,
                     getattr(args, "backend", None) or base.backend,
                     args.control or base.control)


# KiB... powers of 1024, KB... powers of 1000, as the docs write them ("64 MiB")
SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
              "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?)\s*([A-Za-z]*)\s*")


def size(value: str | int) -> int:
    """Bytes, from plain bytes (``1048576``) or a number with a unit (``40MiB``,
    ``64 MiB``, ``1GiB``, ``1.5GB``): the type of every option that takes a size, on the
    command line, in the environment and in the config file."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    got = _SIZE.fullmatch(value) if isinstance(value, str) else None
    unit = got.group(2).lower() if got else ""
    if got is None or unit not in SIZE_UNITS:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a size: bytes, or a number with one of B, KB, MB, GB, TB "
            "(powers of 1000), KiB, MiB, GiB, TiB (powers of 1024), e.g. 40MiB")
    return int(float(got.group(1)) * SIZE_UNITS[unit])


def runtime_folder(args: argparse.Namespace) -> Path:
    return Path(args.runtime_dir) if getattr(args, "runtime_dir", None) else runtime_dir()


def _common(p: argparse.ArgumentParser) -> None:
    _runtime_opt(p)
    p.add_argument("--frontend", default=None,
                   help="client endpoint (default: ipc://RUNTIME_DIR/frontend)")
    p.add_argument("--backend", default=None,
                   help="worker endpoint (default: ipc://RUNTIME_DIR/backend)")
    _control_opt(p)
    p.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error"],
                   help="the least severe log lines written (default info)")
    _config_opt(p)


def _runtime_opt(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runtime-dir", default=None,
                   help=f"folder of the ipc sockets (default $ZEROSERVE_RUNTIME_DIR, else "
                        f"{runtime_dir()})")


def _control_opt(p: argparse.ArgumentParser) -> None:
    p.add_argument("--control", default=None,
                   help="the broker's control endpoint (default: ipc://RUNTIME_DIR/control)")


def _control_common(p: argparse.ArgumentParser) -> None:
    """What a verb spoken to the broker's control socket uses: where it is, and the config
    file whose [broker] table may say so."""
    _runtime_opt(p)
    _control_opt(p)
    _config_opt(p)


def _config_opt(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, metavar="FILE",
                   help="TOML config (default $ZEROSERVE_CONFIG, else "
                        f"{config.ETC_PATH} if it exists)")


def _curve_opts(p: argparse.ArgumentParser, role: str) -> None:
    """CurveZMQ for tcp:// endpoints (see broker/curve.py). ``role``: "server" (the
    broker, and serve, whose local workers and gateways use the broker's pair),
    "client" (workers, gateways)."""
    p.add_argument("--curve-secret-key", default=None, metavar="FILE",
                   help="this process's CurveZMQ key pair, a .key_secret file from "
                        "`zeroserve keys generate` (the broker's: every tcp:// frontend "
                        "and backend then speaks Curve)")
    if role == "server":
        p.add_argument("--curve-authorized-keys", default=None, metavar="DIR",
                       help="folder of the public keys (*.key) of the workers, gateways "
                            "and clients let in; read again when it changes")
    else:
        p.add_argument("--curve-server-key", default=None, metavar="FILE",
                       help="the broker's public key (its .key file), to reach it over "
                            "tcp:// with CurveZMQ")


def _broker_opts(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-dir", default=None, help="model repository folder")
    p.add_argument("--heartbeat-s", type=float, default=0.5,
                   help="seconds between heartbeats to and from the workers")
    p.add_argument("--worker-expiry-s", type=float, default=2.0,
                   help="a worker silent this long is counted lost (its batches retried "
                        "or failed)")
    p.add_argument("--drain-timeout-s", type=float, default=30.0,
                   help="on SIGTERM, how long the broker lets queued and running work "
                        "finish before it exits")
    p.add_argument("--max-message-bytes", type=size, default=256 << 20, metavar="SIZE",
                   help="the most tensor bytes one message from a client or worker may "
                        "carry; a request over it is answered too_large (413)")
    p.add_argument("--response-cache-bytes", type=size, default=64 << 20, metavar="SIZE",
                   help="bound of the response cache, for models whose config enables "
                        "response_cache (0: no cache)")
    p.add_argument("--load-on-demand", action="store_true",
                   help="models are available without being loaded: the first request "
                        "for one loads it within the workers' memory budgets, evicting "
                        "the least wanted idle models (a model's config may say "
                        "otherwise with load_on_demand)")
    p.add_argument("--load-on-demand-min-residency-s", type=float, default=0.005,
                   metavar="S", help="a model loaded on demand is not evicted before "
                                     "this, however cheap its load")
    p.add_argument("--load-on-demand-residency-factor", type=float, default=5.0,
                   metavar="X", help="a model loaded on demand is not evicted before this "
                                     "many times its last load time (0: the floor "
                                     "--load-on-demand-min-residency-s alone)")
    p.add_argument("--load-on-demand-max-load-share", type=float, default=0.5,
                   metavar="SHARE", help="of any minute, the share spent loading on "
                                         "demand at most (each load counted at its "
                                         "predicted load time); past it a request for an "
                                         "unloaded model gets 503 with Retry-After (0: "
                                         "no bound)")
    p.add_argument("--load-on-demand-wait-s", type=float, default=30.0, metavar="S",
                   help="requests waiting this long for a load that cannot start (the "
                        "models loaded are busy or too recent to evict) get 503")
    p.add_argument("--latency-model", choices=["on", "off"], default="on",
                   help="off: batches bounded by size and delay only, no deadline-aware "
                        "admission (for comparison)")
    p.add_argument("--watch", choices=["inotify", "poll"], default="inotify",
                   help="how to notice repository changes (poll: for NFS and the like)")
    p.add_argument("--watch-interval-s", type=float, default=2.0,
                   help="seconds between rescans with --watch poll")
    p.add_argument("--watch-debounce-ms", type=float, default=200.0,
                   help="quiet time after the last change before it is acted on")
    p.add_argument("--load-retries", type=int, default=5, metavar="N",
                   help="loads of one version's files that failed for a reason that may "
                        "pass (out of memory, I/O, a timeout), the first included, before "
                        "its failure stands (1: no retry)")
    p.add_argument("--load-retry-base-s", type=float, default=1.0, metavar="S",
                   help="the wait before the first retry; each next one doubles, drawn "
                        "in its upper half (jitter)")
    p.add_argument("--load-retry-max-s", type=float, default=60.0, metavar="S",
                   help="no wait between retries of a load longer than this")
    p.add_argument("--breaker-error-rate", type=float, default=0.5, metavar="RATE",
                   help="a model's circuit breaker opens when this share of its requests "
                        "answered in the window failed by the model's own error (not bad "
                        "input, not deadlines; 0: no breaker)")
    p.add_argument("--breaker-min-failures", type=int, default=5, metavar="N",
                   help="failed requests in the window before the breaker may open")
    p.add_argument("--breaker-window-s", type=float, default=2.0, metavar="S",
                   help="the window the breaker counts a model's answers over")
    p.add_argument("--breaker-open-s", type=float, default=5.0, metavar="S",
                   help="an open breaker answers 503 this long before probing (doubled after "
                        "a failed probe, up to 60 s)")
    p.add_argument("--breaker-probes", type=int, default=3, metavar="N",
                   help="half-open: requests let through, all answered well, before the "
                        "breaker closes")
    p.add_argument("--swap-watch-s", type=float, default=120.0, metavar="S",
                   help="after a swap of a model without a rollout plan whose previous "
                        "version is still loaded, the new build is watched this long and "
                        "rolled back on errors (0: not watched)")
    p.add_argument("--import-root", action="append", default=None, metavar="DIR",
                   help="folder that POST /v1/models may copy models from (repeatable; "
                        "none: registration is disabled)")
    p.add_argument("--tenants", default=None, metavar="FILE",
                   help="tenants file (TOML): API keys, quotas, QoS classes (none: every "
                        "caller is one anonymous tenant)")
    p.add_argument("--model-control-mode", choices=["none", "poll", "explicit"],
                   default="poll",
                   help="poll: serve every model folder and follow changes (the watcher); "
                        "none: load all at start, never watch, no load/unload calls; "
                        "explicit: load only --load-model at start, then load/unload calls")
    p.add_argument("--load-model", action="append", default=None, metavar="NAME",
                   help="with --model-control-mode explicit: a model to load at start "
                        "(repeatable)")


def _worker_opts(p: argparse.ArgumentParser) -> None:
    p.add_argument("--credits", type=int, default=2,
                   help="batches in flight per worker, so transfer overlaps compute")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    p.add_argument("--device", default=None, help="torch device (default: cuda:0 if any)")
    p.add_argument("--memory-budget", type=size, default=0, metavar="SIZE",
                   help="memory a worker may spend on its context and models, on a GPU "
                        "too, e.g. 8GiB (0: no limit)")
    p.add_argument("--memory-headroom", type=size, default=None, metavar="SIZE",
                   help="memory the broker's placement keeps free on the worker's device: "
                        "of its free memory on a GPU (default 512 MiB), of the budget on "
                        "a CPU (default 0)")
    p.add_argument("--memory-tolerance-bytes", type=size, default=64 << 20, metavar="SIZE",
                   help="memory an unload may fail to return before the worker is recycled")
    p.add_argument("--host-cache-bytes", type=size, default=1 << 30, metavar="SIZE",
                   help="host memory for versions unloaded from the device, so that loading "
                        "one again is a move instead of a load from disk (0: none; "
                        "docs/many-models.md)")


# with tenants, /metrics names every model and tenant: loopback (a Prometheus on the
# host, a sidecar in the pod) unless the operator names the scraper's network
METRICS_ALLOW = "127.0.0.0/8,::1"


def _gateway_opts(p: argparse.ArgumentParser) -> None:
    p.add_argument("--http-host", default="127.0.0.1",
                   help="address the HTTP server listens on (default loopback; management "
                        "routes off loopback need ZEROSERVE_ADMIN_TOKEN)")
    p.add_argument("--http-port", type=int, default=8080, help="HTTP port (default 8080)")
    p.add_argument("--max-body-bytes", type=size, default=64 << 20, metavar="SIZE",
                   help="largest HTTP request body, before and after inflating (default "
                        "64MiB); a larger one gets 413")
    p.add_argument("--shutdown-timeout-s", type=float, default=30.0,
                   help="on SIGTERM, how long in-flight HTTP requests may take to finish")
    p.add_argument("--reuse-port", action="store_true",
                   help="bind with SO_REUSEPORT, so several gateway processes share the "
                        "port (the gRPC port too)")
    p.add_argument("--grpc-host", default="",
                   help="address of Triton's gRPC service (default: --http-host's)")
    p.add_argument("--grpc-port", type=int, default=8001,
                   help="port of Triton's gRPC service (0: no gRPC)")
    p.add_argument("--grpc-max-message-bytes", type=size, default=2**31 - 1, metavar="SIZE",
                   help="largest gRPC message the gateway takes (default INT32_MAX, as "
                        "Triton)")
    p.add_argument("--grpc-response-compression", choices=["none", "gzip", "deflate"],
                   default="none",
                   help="compress gRPC answers with this where the client accepts it "
                        "(default none, as Triton's --grpc-infer-response-compression-level)")
    p.add_argument("--readiness", choices=["strict", "any"], default="strict",
                   help="ready when every model serves (strict) or one does (any, weaker)")
    p.add_argument("--server-name", default="zeroserve", help="name in GET /v2")
    p.add_argument("--server-version", default="", help="version in GET /v2 (default: ours)")
    p.add_argument("--allow-shared-memory", action="store_true",
                   help="let clients on this host pass tensors in system shared memory")
    p.add_argument("--shed-lag-ms", type=float, default=50.0,
                   help="answer inference 503 at the door while the gateway's event loop "
                        "is this far behind (0: never)")
    p.add_argument("--metrics-allow", default=METRICS_ALLOW, metavar="CIDRS",
                   help="with tenants, the addresses that may scrape /metrics without the "
                        "admin token (comma-separated addresses or CIDRs; default loopback)")
    p.add_argument("--max-in-flight", type=int, default=2048,
                   help="inference requests one gateway process holds at most; past it, "
                        "503 at the door (0: no bound)")


def _trace_opt(p: argparse.ArgumentParser) -> None:
    """The broker's (the sampling settings every gateway follows, changed at run time
    through /v2/trace/setting), the gateway's (its trace file, mode and exporter) and
    the workers' (which emit the queue and batch spans)."""
    p.add_argument("--trace-config", action="append", default=None, metavar="SETTING",
                   help="Triton's trace setting, repeatable: rate=N, level=TIMESTAMPS|"
                        "TENSORS, count=N, mode=triton|opentelemetry, triton,file=PATH, "
                        "triton,log-frequency=N, opentelemetry,url=HOST:PORT/PATH, "
                        "opentelemetry,resource=KEY=VALUE, opentelemetry,bsp_...=N "
                        "(tracing is off without level)")


Register = Callable[[Any], None]   # adds one subcommand to the subparsers it is given


def parser(commands: Sequence[Register] = ()) -> argparse.ArgumentParser:
    """Every component's command line; ``commands`` adds the CLI's own subcommands (the
    load generator's, ``broker/bench``), which no component's process imports."""
    ap = argparse.ArgumentParser(prog="zeroserve", description="Serve PyTorch models.")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="broker, workers and gateway on this host")
    _common(p)
    _broker_opts(p)
    _worker_opts(p)
    _gateway_opts(p)
    _trace_opt(p)
    _curve_opts(p, "server")
    p.add_argument("--workers", type=int, default=0,
                   help="worker processes (default: one per GPU, else 1)")
    p.add_argument("--devices", default=None,
                   help="each worker's device, comma-separated, one per worker, as "
                        "CUDA_VISIBLE_DEVICES names it: an index, a GPU-... or MIG-... "
                        "UUID; one named twice is shared by two workers (default: one "
                        "worker per visible GPU)")
    p.add_argument("--pin-workers", action="store_true",
                   help="pin each CPU worker to its own --threads cores, from the last "
                        "usable core down (the gateway and broker stay unpinned)")
    p.add_argument("--http-workers", type=int, default=0,
                   help="gateway processes sharing the HTTP port (one core each at most; "
                        "default: one per 2 cores the workers and the broker leave (a GPU "
                        "worker takes 1, a CPU worker its --threads), at least 1, at most "
                        "4, and 1 with --allow-shared-memory)")

    p = sub.add_parser("broker", help="run the broker")
    _common(p)
    _broker_opts(p)
    _trace_opt(p)
    _curve_opts(p, "server")

    p = sub.add_parser("worker", help="run one worker")
    _common(p)
    _worker_opts(p)
    _trace_opt(p)
    _curve_opts(p, "client")
    p.add_argument("--index", type=int, default=0, help="GPU index or CPU worker number")
    p.add_argument("--worker-id", default=None, help="default: <host>/<index>")
    p.add_argument("--cpus", default=None, metavar="LIST",
                   help="pin the worker's threads to these cores, e.g. 2-3 (default: none)")

    p = sub.add_parser("gateway", help="run the HTTP gateway")
    _common(p)
    _gateway_opts(p)
    _trace_opt(p)
    _curve_opts(p, "client")

    for verb, text in (("status", "workers, their models and queues"),
                       ("models", "models and their versions")):
        p = sub.add_parser(verb, help=text)
        _control_common(p)
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the broker")
        p.set_defaults(verb=verb)
    _operate_parsers(sub)
    p = sub.add_parser("tenants", help="tenants' rate, in-flight and rejections; add-key NAME")
    _control_common(p)
    p.add_argument("action", nargs="?", choices=["show", "add-key"], default="show",
                   help="show (default): each tenant's figures; add-key: a new key for NAME")
    p.add_argument("name", nargs="?", help="tenant (add-key)")
    p.add_argument("--tenants", default=None, metavar="FILE", help="tenants file (add-key)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the broker")
    p.set_defaults(verb="tenants")
    for register in commands:
        register(sub)
    p = sub.add_parser("keys", help="generate a CurveZMQ key pair (workers on other hosts)")
    p.add_argument("action", choices=["generate"], help="generate: write a new key pair")
    p.add_argument("name", help="file name: NAME.key (public) and NAME.key_secret (0600)")
    p.add_argument("--dir", default=".", help="folder to write them into (default: here)")
    p.add_argument("--force", action="store_true", help="replace existing files")
    _compile_parser(sub)
    p = sub.add_parser("config", help="show the effective configuration")
    p.add_argument("action", choices=["show"], help="show: every option with its value")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    _config_opt(p)
    _describe(sub)
    return ap


def _describe(sub: Any) -> None:
    """Each subcommand's --help opens with what it does (its line in the list)."""
    for choice in sub._choices_actions:   # argparse keeps each subcommand's help here
        parser = sub.choices[choice.dest]
        parser.description = parser.description or choice.help


def _compile_parser(sub: Any) -> None:
    p = sub.add_parser("compile", help="an exported program (torch.export.save) and its "
                       "model's config into an AOTInductor package, offline")
    p.add_argument("program", help="the exported program's model.pt2")
    p.add_argument("--config", dest="model_config", required=True, metavar="FILE",
                   help="the model's config.json (or config.pbtxt): inputs, max_batch_size")
    p.add_argument("--output", required=True, metavar="FILE",
                   help="the package to write, e.g. REPO/MODEL/2/model.pt2 (written to a "
                        "temp name, then renamed)")
    p.add_argument("--device", default="cpu",
                   help="cpu, cuda or cuda:N: where the package will run (default: cpu)")
    p.add_argument("--log-level", default="warning",
                   choices=["debug", "info", "warning", "error"],
                   help="the least severe log lines written (default warning)")


def _operate_parsers(sub: Any) -> None:
    def verb(name: str, text: str) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = sub.add_parser(name, help=text)
        _control_common(p)
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.add_argument("--timeout", type=float, default=5.0,
                       help="seconds to wait for the broker to answer")
        p.set_defaults(verb=name)
        return p

    p = verb("drain", "stop sending new batches to a worker (--all: the broker admits "
                      "nothing new and finishes its queue, as a stop does, without exiting)")
    p.add_argument("worker", nargs="?", help="worker id, such as host/0")
    p.add_argument("--all", action="store_true", help="the whole broker instead of a worker")
    p.add_argument("--wait", action="store_true", help="return once its batches are done")
    p.add_argument("--wait-timeout", type=float, default=60.0,
                   help="with --wait, seconds to wait at most (exit 4 past it)")
    p = verb("undrain", "send batches to a drained worker again (--all: admit again)")
    p.add_argument("worker", nargs="?", help="worker id, such as host/0")
    p.add_argument("--all", action="store_true", help="the whole broker instead of a worker")
    p = verb("reload", "load MODEL[/VERSION] afresh, restart a worker (--worker), or "
             "read the tenants file again (--tenants)")
    p.add_argument("model", nargs="?", help="MODEL or MODEL/VERSION")
    p.add_argument("--tenants", action="store_true", dest="reload_tenants",
                   help="read the broker's tenants file again (a bad one is refused)")
    p.add_argument("--worker", default=None, help="drain this worker, restart it, rejoin")
    p.add_argument("--wait", action="store_true",
                   help="return once the loads finished or the worker is back")
    p.add_argument("--wait-timeout", type=float, default=120.0,
                   help="with --wait, seconds to wait at most (exit 4 past it)")
    p = sub.add_parser("probe", help="liveness: fail when the broker or a worker is alive "
                       "but its loop no longer turns (a Kubernetes livenessProbe's command)")
    _control_common(p)
    p.add_argument("role", choices=["broker", "worker"], help="which process to probe")
    p.add_argument("--index", type=int, default=0, help="the worker's --index")
    p.add_argument("--timeout", type=float, default=5.0,
                   help="seconds the broker has to answer")
    p.add_argument("--max-age-s", type=float, default=30.0,
                   help="a worker's loop must have turned within this many seconds")
    p = verb("push", "add a version to a served MODEL: PATH is its model file (uploaded) "
             "or a version folder under the broker's --import-root; trial-loaded, then "
             "published")
    p.add_argument("model", help="the model's name")
    p.add_argument("path", help="the model file, or a version folder on the broker's host")
    p.add_argument("--version", type=int, default=None, dest="push_version", metavar="N",
                   help="the version number (default: the next one); one that exists is "
                        "refused unless its files are the same")
    p.add_argument("--wait-timeout", type=float, default=300.0,
                   help="seconds to wait for the copy and the trial load")
    p.add_argument("--meta", action="append", default=None, metavar="FIELD=VALUE",
                   help="the version's provenance (repeatable): source, run_id, "
                        "data_version, commit, created_by, created_at; kept in its "
                        "metadata.json, no part of its sha256")
    p.add_argument("--label", action="append", default=None, metavar="KEY=VALUE",
                   help="a free-form provenance label (repeatable)")
    p = verb("rollout", "canary VERSION of MODEL: a growing share of the traffic, step by "
             "step, rolled back by itself if it does worse (docs/rollouts.md)")
    p.add_argument("model", help="the model")
    p.add_argument("version", type=int, help="the version to roll out (loaded already)")
    p.add_argument("--steps", default=None,
                   help="the canary's weight at each step, e.g. 5,25,50,100 (the config's "
                        "rollout plan, else 5,25,50,100)")
    p.add_argument("--dwell", type=float, default=None, help="seconds each step lasts")
    p.add_argument("--stable", type=int, default=None,
                   help="the version to compare with (default: the one serving now)")
    p.add_argument("--min-requests", type=int, default=None,
                   help="canary answers needed before a verdict or a step")
    p.add_argument("--max-error-rate", type=float, default=None,
                   help="how far the canary's error rate may exceed the stable's")
    p.add_argument("--max-latency-ratio", type=float, default=None,
                   help="how many times the stable's median compute time the canary's may be")
    for name, text in (("rollback", "take VERSION of MODEL (default: the canary of its "
                                    "rollout) out of the traffic at once"),
                       ("promote", "give VERSION of MODEL (default: the canary of its "
                                   "rollout) all the traffic and retire the one it replaces")):
        p = verb(name, text)
        p.add_argument("model", help="the model")
        p.add_argument("version", type=int, nargs="?", default=None, help="the version")


def subparsers(ap: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in ap._actions:  # argparse keeps the subcommands here
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise RuntimeError("no subcommands")


def _config_path(args: argparse.Namespace) -> Path | None:
    return Path(args.config) if getattr(args, "config", None) else config.default_path()


def _apply_config(ap: argparse.ArgumentParser, args: argparse.Namespace,
                  argv: list[str] | None) -> argparse.Namespace:
    """Make env > file > default the subcommand's defaults; parse again so flags win."""
    subs = subparsers(ap)
    path = _config_path(args)
    doc = config.read_file(path)
    config.check_file(doc, subs, path)
    if args.command in config.COMPONENTS:
        component, only = args.command, None
    else:  # status, drain, ...: find the broker where the [broker] table says it listens
        component, only = "broker", set(config.options(subs[args.command]))
    config.check_env(component, subs[component], os.environ)
    values = config.resolve(component, subs[component], doc, os.environ, only)
    subs[args.command].set_defaults(**values)
    return ap.parse_args(argv)


def parse(argv: list[str] | None = None, commands: Sequence[Register] = ()
          ) -> argparse.Namespace:
    """The command line with the config file and environment applied (flag > env > file >
    default); raises config.ConfigError."""
    ap = parser(commands)
    args = ap.parse_args(argv)
    return args if args.command in ("config", "keys", "compile") \
        else _apply_config(ap, args, argv)


def show_config(args: argparse.Namespace) -> int:
    """``zeroserve config show``: every option with its effective value."""
    import json
    import sys

    try:
        effective = config.load(subparsers(parser()), _config_path(args))
    except config.ConfigError as exc:
        print(f"zeroserve config: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(effective, indent=2, sort_keys=True) if args.json
          else config.to_toml(effective), end="\n" if args.json else "")
    return 0


def prepare(args: argparse.Namespace) -> argparse.Namespace:
    """What every component does with its arguments before it runs."""
    if getattr(args, "runtime_dir", None):
        os.environ["ZEROSERVE_RUNTIME_DIR"] = args.runtime_dir
    if args.command == "broker" and not args.model_dir:
        args.model_dir = str(cache_dir() / "examples")
    if args.command in ("broker", "worker"):
        # prometheus_client's multiprocess mode is for gateway processes only: the broker
        # and workers ship their own registries over the wire (see gateway/metrics.py)
        os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    return args


def run_component(command: str, run: Callable[[argparse.Namespace], int],
                  argv: list[str] | None) -> int:
    """``python -m <component module> ARGS``: parse as ``zeroserve <command> ARGS``."""
    import sys

    from zeroserve.broker.process import setup_logging, tune_gc

    try:
        args = parse([command, *(sys.argv[1:] if argv is None else argv)])
    except config.ConfigError as exc:
        print(f"zeroserve {command}: {exc}", file=sys.stderr)
        return 2
    setup_logging(role_of(args), args.log_level)
    tune_gc()   # after the imports, the bulk of what a component keeps for good
    return int(run(prepare(args)))


def role_of(args: argparse.Namespace) -> str:
    return f"worker{args.index}" if args.command == "worker" else str(args.command)
