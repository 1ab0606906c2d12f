"""``zeroserve serve``: wire the supervisor to the command line."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import threading
from pathlib import Path

from zeroserve.broker import options
from zeroserve.broker.runtime import BrokerLock, RuntimeDirError, ServerLock, cache_dir, \
    ensure_runtime_dir, hostname, runtime_dir
from zeroserve.workers import affinity
from zeroserve.workers.supervisor import Child, Supervisor, device_map, ensure_examples, \
    visible_gpus, wait_http_ready

logger = logging.getLogger(__name__)


# each component is started by its module name, as a fresh process
MODULES = {"broker": "zeroserve.broker.server.main", "worker": "zeroserve.workers.main",
           "gateway": "zeroserve.gateway.serve"}


# what serve decides for a child itself instead of forwarding its own value: the
# runtime folder (a default made explicit), the model folder, the worker's index,
# threads and cores, the gateways' port sharing, and the Curve keys (curve_args)
DECIDED = {"help", "config", "runtime_dir", "model_dir", "index", "worker_id", "threads",
           "cpus", "reuse_port", "curve_secret_key", "curve_server_key",
           "curve_authorized_keys"}


def forwarded(args: argparse.Namespace, command: str) -> list[str]:
    """serve's values of every option the child's own parser declares, as its flags: an
    option added to a component reaches it from ``zeroserve serve`` with no change here.
    An unset option (None) is left to the child's default."""
    child = options.subparsers(options.parser())[command]
    argv: list[str] = []
    for action in child._actions:   # argparse keeps no public list of them
        value = getattr(args, action.dest, None)
        if action.dest in DECIDED or not action.option_strings or value is None:
            continue
        flag = max(action.option_strings, key=len)
        if isinstance(action, argparse._StoreTrueAction):
            argv += [flag] if value else []
        elif isinstance(action, argparse._AppendAction):
            argv += [a for v in value for a in (flag, str(v))]
        else:
            argv += [flag, str(value)]
    return argv


def _base(args: argparse.Namespace, command: str) -> list[str]:
    folder = Path(args.runtime_dir) if args.runtime_dir else runtime_dir()
    return [sys.executable, "-m", MODULES[command], "--runtime-dir", str(folder),
            *forwarded(args, command), *curve_args(args, command)]


CORES_PER_GATEWAY = 2
# The broker is one thread. Measured on a 2-core host (bench_gateways, workers that
# answer at once): a gateway spends about 180 us a request, about 5,500 req/s on its
# core, and the broker about 85 us with its sockets (its Python alone: 35-50 us
# bundled, 150 not, bench_broker_cpu), about 12,000 req/s: on paper the broker is the
# wall from 2-3 gateways on, and more than 4 would only add processes that wait for it.
MAX_GATEWAYS = 4


def usable_cores() -> int:
    """The cores this process may run on (a container's cpuset, taskset), not the host's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def http_processes(requested: int, cores: int, shared_memory: bool,
                   worker_cores: int = 0) -> int:
    """--http-workers, or by default one gateway per two cores the workers and the
    broker leave (``worker_cores``: a GPU worker's one, a CPU worker's torch threads;
    the broker's one), at least 1 and at most MAX_GATEWAYS. A gateway tops out at one
    core and the kernel's network work for it takes about as much again; past four the
    broker's one thread would be the wall. Shared-memory registrations live in the
    gateway that took them, so allowing them keeps one."""
    if requested > 0:
        return requested
    spare = cores - 1 - worker_cores
    return 1 if shared_memory else max(1, min(MAX_GATEWAYS, spare // CORES_PER_GATEWAY))


def pinning(wanted: bool, workers: int, threads: int, gpus: int) -> list[list[int]] | None:
    """--pin-workers: each CPU worker's cores, or None (not asked, GPU workers, or more
    threads than cores, which is said)."""
    if not wanted:
        return None
    if gpus:
        logger.warning("--pin-workers is for CPU hosts; on a GPU host the workers stay "
                       "unpinned (pin them by NUMA node, e.g. systemd's CPUAffinity=)")
        return None
    usable = sorted(os.sched_getaffinity(0))
    pins = affinity.plan(workers, threads, usable)
    if pins is None:
        logger.warning("--pin-workers: %d worker(s) of %d thread(s) need more than the %d "
                       "usable cores; not pinning", workers, threads, len(usable))
    return pins


def curve_args(args: argparse.Namespace, role: str) -> list[str]:
    """The broker's key pair for it, and for the local workers and gateways as theirs
    (the broker lets its own key in), so a tcp:// backend serves remote workers too."""
    if not args.curve_secret_key:
        return []
    argv = ["--curve-secret-key", args.curve_secret_key]
    if role != "broker":
        return argv + ["--curve-server-key", args.curve_secret_key]
    if args.curve_authorized_keys:
        argv += ["--curve-authorized-keys", args.curve_authorized_keys]
    return argv


def gateways(args: argparse.Namespace, worker_cores: int) -> list[Child]:
    """One gateway process, or several sharing the port (SO_REUSEPORT) and one
    prometheus multiprocess folder, so /metrics on any of them counts them all."""
    argv = _base(args, "gateway")
    n = http_processes(args.http_workers, usable_cores(), args.allow_shared_memory,
                       worker_cores)
    if n == 1:
        return [Child("gateway", argv)]
    prom = (Path(args.runtime_dir) if args.runtime_dir else runtime_dir()) / "prometheus"
    shutil.rmtree(prom, ignore_errors=True)  # figures of an earlier run's processes
    prom.mkdir(parents=True)
    env = {"PROMETHEUS_MULTIPROC_DIR": str(prom)}
    return [Child(f"gateway {i}", argv + ["--reuse-port"], env) for i in range(n)]


def run(args: argparse.Namespace) -> int:
    folder = Path(args.runtime_dir) if args.runtime_dir else runtime_dir()
    lock = ServerLock(folder)
    try:
        ensure_runtime_dir(folder)
        lock.acquire()   # for the server's whole life, across its broker's restarts
        BrokerLock(folder).check_free()  # a second server would take over the first's sockets
    except RuntimeDirError as exc:
        lock.release()
        logger.error("%s", exc)
        return 2
    try:
        return _run(args)
    finally:
        lock.release()


def _run(args: argparse.Namespace) -> int:
    if args.load_model and args.model_control_mode != "explicit":
        logger.error("--load-model needs --model-control-mode explicit (the other modes "
                     "load every model folder)")
        return 2
    model_dir = Path(args.model_dir) if args.model_dir else ensure_examples(cache_dir())
    try:
        devices = device_map(args.devices or "", visible_gpus(), args.workers)
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    n, gpus = len(devices), sum(d is not None for d in devices)
    # one core stays with the gateway and the broker: torch's spinning threads on every
    # core cut mlp's HTTP throughput by a third on a 2-core host (measured)
    threads = args.threads or max(1, (usable_cores() - 1) // n)
    # prometheus_client picks multiprocess mode when it is imported: only gateways use it
    own_registry: dict[str, str | None] = {"PROMETHEUS_MULTIPROC_DIR": None}
    children = [Child("broker", _base(args, "broker") + ["--model-dir", str(model_dir)],
                      own_registry)]
    pins = pinning(args.pin_workers, n, threads, gpus)
    for i in range(n):
        device = devices[i]
        env = {**own_registry, **({"CUDA_VISIBLE_DEVICES": device} if device else {})}
        argv = _base(args, "worker") + ["--index", str(i), "--threads", str(threads)]
        if pins is not None:
            argv += ["--cpus", affinity.format_cpus(pins[i])]
        children.append(Child(f"worker {hostname()}/{i}", argv, env))
    # a GPU worker keeps a core busy feeding its device; a CPU worker, its threads
    children += gateways(args, sum(threads if d is None else 1 for d in devices))
    # each stop stage outlasts the bound of the component it waits for
    sup = Supervisor(children,
                     stop_timeout_s=max(args.drain_timeout_s, args.shutdown_timeout_s) + 5)
    url = f"http://{args.http_host}:{args.http_port}"

    def announce() -> None:
        if wait_http_ready(url + "/v2/health/ready", 120.0, sup):
            print(f"zeroserve ready on {url} (models from {model_dir}, {n} worker"
                  f"{'s' if n > 1 else ''})", flush=True)

    def started() -> None:
        threading.Thread(target=announce, daemon=True).start()

    logger.info("serving %s with %d worker(s) of %d torch thread(s)%s", model_dir, n, threads,
                "; devices " + ", ".join(f"{hostname()}/{i}={d}" for i, d in enumerate(devices)
                                         if d) if gpus else "")
    return sup.run(started)


def main(argv: list[str] | None = None) -> int:
    return options.run_component("serve", run, argv)


if __name__ == "__main__":
    sys.exit(main())
