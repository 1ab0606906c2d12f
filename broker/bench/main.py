"""``zeroserve bench``: a load generator for a running zeroserve (in the spirit of
Triton's perf_analyzer), no wrk needed.

    zeroserve bench -m mlp --concurrency 1,16,64 --transport http-json,direct --in-process
    zeroserve bench -m mlp --rate 200,400 --transport http-binary --csv out.csv
    python -m zeroserve.broker.bench -m mlp --trace arrivals.txt --transport direct

Each level runs a warm-up, then a counted window; it reports throughput, latency
percentiles, goodput (answered within --slo-ms or --timeout-ms), errors by status, the
server's own split (queue, compute, batch size) and whether the load generator itself
was the bottleneck. Exit status: 0 done, 2 usage error, 3 server unreachable.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from zeroserve.broker.bench import inputs as bi
from zeroserve.broker.bench import load as bl
from zeroserve.broker.bench import report as br
from zeroserve.broker.bench.runner import START_MARGIN_S, make_runner
from zeroserve.broker.client import AsyncClient, ErrorCode, InferError
from zeroserve.broker.runtime import Endpoints, cache_dir

EXIT_OK, EXIT_USAGE, EXIT_UNREACHABLE = 0, 2, 3
HELP = "load generator: concurrency sweeps, request rates, traces over HTTP or direct"


class Usage(Exception):
    """A usage error: exit 2 with the message."""


class Unreachable(Exception):
    """The server does not answer: exit 3 with the message."""


def _list(kind: type, text: str, flag: str) -> list[Any]:
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(v <= 0 for v in values):
        raise Usage(f"{flag} {text!r}: expected a comma-separated list of positive numbers")
    return values


def register(sub: Any) -> None:
    """``zeroserve bench``, added by the CLI (bin/zeroserve) to the subparsers of
    options.parser: the components' processes parse their options without the bench."""
    add_arguments(sub.add_parser("bench", help=HELP, description=HELP))


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("-m", "--model", required=True, help="the model to load")
    ap.add_argument("--model-version", type=int, default=None, help="pin a version")
    ap.add_argument("--transport", default="http-json",
                    help=f"comma-separated, of {', '.join(bl.TRANSPORTS)} (default http-json)")
    ap.add_argument("--url", default="http://127.0.0.1:8080", help="the HTTP gateway")
    ap.add_argument("--grpc-url", default="127.0.0.1:8001",
                    help="the gateway's gRPC address, for --transport grpc")
    ap.add_argument("--endpoint", default=None,
                    help="the broker's frontend for direct (default: in --runtime-dir)")
    ap.add_argument("--runtime-dir", default=None, help="the server's runtime folder")
    raw = ap.add_argument_group("http-raw: another server, e.g. TorchServe, in the same run")
    raw.add_argument("--raw-path", default=None, help="URL path to POST to, e.g. "
                     "/predictions/mlp")
    raw.add_argument("--body-file", default=None, help="the request body, sent as is")
    raw.add_argument("--content-type", default="application/json",
                     help="Content-Type of the --body-file requests (default application/json)")
    load = ap.add_mutually_exclusive_group()
    load.add_argument("--concurrency", default=None,
                      help="closed loop: requests in flight per level, e.g. 1,16,64 (default 1)")
    load.add_argument("--rate", default=None,
                      help="open loop: requests/s per level, e.g. 200,400")
    load.add_argument("--trace", default=None,
                      help="open loop: a file of arrival offsets in seconds, one per line")
    ap.add_argument("--distribution", choices=("poisson", "constant"), default="poisson",
                    help="arrivals of --rate (default poisson)")
    ap.add_argument("--warmup-s", type=float, default=3.0, help="per level, not counted")
    ap.add_argument("--duration-s", type=float, default=10.0, help="counted, per level")
    ap.add_argument("--batch-size", type=int, default=1, help="rows per request")
    ap.add_argument("--shape", action="append", default=[],
                    help="NAME:D1,D2 for an input's free dims (without the batch)")
    ap.add_argument("--input-data", action="append", default=[],
                    help="a v2 JSON body, or NAME=FILE.npy (repeat per input)")
    ap.add_argument("--priority", type=int, default=0, help="per request (1 is highest)")
    ap.add_argument("--timeout-ms", type=float, default=0.0, help="per request deadline")
    ap.add_argument("--slo-ms", type=float, default=0.0,
                    help="goodput counts answers within this (default: --timeout-ms)")
    ap.add_argument("--processes", type=int, default=1, help="load processes")
    ap.add_argument("--max-inflight", type=int, default=1024,
                    help="open loop: requests in flight per process at most")
    ap.add_argument("--client-timeout-s", type=float, default=30.0,
                    help="seconds a client waits for one answer before counting it failed")
    ap.add_argument("--seed", type=int, default=0,
                    help="seed of the random inputs and arrival times")
    ap.add_argument("--in-process", action="store_true",
                    help="also time the model called directly at the batch sizes formed")
    ap.add_argument("--model-dir", default=None,
                    help="the repository for --in-process (default: the bundled examples)")
    ap.add_argument("--in-process-threads", type=int, default=0,
                    help="torch threads for --in-process (default: as serve gives 1 worker)")
    ap.add_argument("--in-process-device", default="cpu",
                    help="the torch device for --in-process, the served worker's to compare "
                         "alike (e.g. cuda:0; default cpu)")
    ap.add_argument("--csv", default=None, help="write one row per level")
    ap.add_argument("--json", default=None, help="write the levels and the run's settings")
    ap.add_argument("--plot", default=None, help="FILE.png: latency and throughput vs load")
    ap.add_argument("--quiet", action="store_true", help="no progress line on stderr")


def levels_of(args: argparse.Namespace) -> list[tuple[str, float, bl.LevelPlan]]:
    """(mode, load, plan) per level; open-loop plans carry the whole schedule."""
    w, d = args.warmup_s, args.duration_s
    if w < 0 or d <= 0:
        raise Usage("--warmup-s must be >= 0 and --duration-s > 0")
    if args.trace:
        offsets = _read_trace(Path(args.trace))
        counted = [t for t in offsets if t >= w]
        if not counted:
            raise Usage(f"--trace {args.trace}: no arrival after the {w:g} s warm-up "
                        "(try --warmup-s 0)")
        span = max(counted[-1] - w, 0.0) + 1e-3  # the window holds the last arrival
        return [("trace", round(len(counted) / span, 1), bl.LevelPlan(0, offsets, w, span))]
    if args.rate:
        return [("rate", r, bl.LevelPlan(0, bl.arrivals(r, w + d, args.distribution,
                                                        args.seed + i), w, d))
                for i, r in enumerate(_list(float, args.rate, "--rate"))]
    return [("concurrency", c, bl.LevelPlan(c, None, w, d))
            for c in _list(int, args.concurrency or "1", "--concurrency")]


def _read_trace(path: Path) -> list[float]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise Usage(f"--trace {path}: {exc.strerror}") from None
    try:
        values = json.loads(text) if text.lstrip().startswith("[") else [
            float(line.split("#")[0]) for line in text.splitlines()
            if line.split("#")[0].strip()]
        offsets = sorted(float(v) for v in values)
    except (ValueError, TypeError):
        raise Usage(f"--trace {path}: expected arrival offsets in seconds, one per line"
                    ) from None
    if not offsets or offsets[0] < 0:
        raise Usage(f"--trace {path}: no arrivals, or a negative offset")
    return offsets


def fetch_metadata(transport: str, args: argparse.Namespace, endpoint: str) -> dict[str, Any]:
    """The model's metadata over the transport's own path (so it also checks the server
    is there): GET /v2/models/{m} or the broker's ``metadata`` control verb (grpc reads
    it over HTTP, from the same gateway)."""
    if transport in ("direct", "ping"):
        return asyncio.run(_direct_metadata(endpoint, args.model, args.model_version))
    version = f"/versions/{args.model_version}" if args.model_version is not None else ""
    url = f"{args.url.rstrip('/')}/v2/models/{args.model}{version}"
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return json.loads(resp.read())  # type: ignore[no-any-return]
    except urllib.error.HTTPError as err:
        detail = err.read().decode(errors="replace")[:300]
        if err.code == 404:
            raise Usage(f"model {args.model!r}{version}: not found at {args.url} ({detail})"
                        ) from None
        raise Unreachable(f"GET {url} answered {err.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise Unreachable(f"the HTTP server at {args.url} is unreachable: {reason}") from None


async def _direct_metadata(endpoint: str, model: str, version: int | None) -> dict[str, Any]:
    async with AsyncClient(endpoint) as client:
        if not await client.wait_connected(3):
            raise Unreachable(f"the broker at {endpoint} is unreachable (no answer in 3 s)")
        try:
            return await client.control("metadata", model=model,  # type: ignore[no-any-return]
                                        version=version)
        except InferError as exc:
            if exc.code is ErrorCode.NOT_FOUND:
                raise Usage(f"model {model!r}: {exc.message}") from None
            raise Unreachable(f"the broker's metadata answer: {exc}") from None


class Progress:
    """One line on stderr, rewritten in place on a terminal, every few seconds otherwise."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.tty = sys.stderr.isatty()
        self.what = ""
        self.start = 0.0
        self.total = 0.0
        self._last = 0.0

    def level(self, what: str, seconds: float) -> None:
        self.what, self.start, self.total = what, time.monotonic(), seconds

    def update(self, ok: int, err: int) -> None:
        now = time.monotonic()
        if self.quiet or (not self.tty and now - self._last < 2.0):
            return
        self._last = now
        t = now - self.start
        line = (f"{self.what}: {t:4.1f}/{self.total:.0f} s, {ok} ok, {err} errors, "
                f"{ok / t if t > 0 else 0:.0f}/s")
        sys.stderr.write(f"\r{line:<79}" if self.tty else line + "\n")
        sys.stderr.flush()

    def done(self) -> None:
        if self.tty and not self.quiet:
            sys.stderr.write("\r" + " " * 79 + "\r")


def scrape(url: str, model: str) -> dict[str, float] | None:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=5) as resp:
            return br.metric_sums(resp.read().decode(errors="replace"), model)
    except (urllib.error.URLError, OSError):
        return None


def raw_request(args: argparse.Namespace) -> bl.RawRequest:
    if not args.raw_path or not args.body_file:
        raise Usage("--transport http-raw needs --raw-path and --body-file")
    try:
        body = Path(args.body_file).read_bytes()
    except OSError as exc:
        raise Usage(f"--body-file {args.body_file}: {exc.strerror}") from None
    path = args.raw_path if args.raw_path.startswith("/") else "/" + args.raw_path
    return bl.RawRequest(path, body, args.content_type)


def run_transport(transport: str, args: argparse.Namespace, endpoint: str,
                  levels: list[tuple[str, float, bl.LevelPlan]], progress: Progress
                  ) -> list[dict[str, Any]]:
    raw = raw_request(args) if transport == "http-raw" else None
    # a raw body is not zeroserve's: no metadata to read, and one request is --batch-size rows
    meta = {"inputs": []} if raw else fetch_metadata(transport, args, endpoint)
    try:
        if raw:
            inputs = {}
        elif args.input_data:
            inputs = bi.load_files(args.input_data, meta)
        else:
            inputs = bi.random_inputs(meta, args.batch_size, bi.parse_shapes(args.shape),
                                      args.seed)
        opts = bi.RequestOptions(args.model, args.model_version, args.priority,
                                 args.timeout_ms)
        plan = bl.Plan(transport, args.url, endpoint, opts, inputs,
                       args.slo_ms or args.timeout_ms, args.client_timeout_s, args.max_inflight,
                       raw, args.grpc_url)
        bl.make_sender(plan)  # builds the bodies: a JSON body of BF16 fails here
    except bi.InputError as exc:
        raise Usage(str(exc)) from None
    rows_per_request = args.batch_size if raw else bi.samples_per_request(inputs, meta)
    runner = make_runner(plan, args.processes)
    rows = []
    try:
        for i, (mode, load, level) in enumerate(levels):
            progress.level(f"{transport} {mode} {load:g} [{i + 1}/{len(levels)}]",
                           level.warmup_s + level.duration_s)
            split = _ScrapeAround(transport, args, START_MARGIN_S + level.warmup_s)
            try:
                samples = runner.run(level, progress.update)
            except ConnectionError as exc:
                raise Unreachable(str(exc)) from None
            progress.done()
            rows.append(br.level_row(transport, mode, load, args.processes, samples,
                                     rows_per_request, plan.slo_ms, split.finish()))
    finally:
        runner.close()
    return rows


class _ScrapeAround:
    """Over HTTP, /metrics at the start of the counted window and after the level: the
    server's queue, compute and batch-size means for the level."""

    def __init__(self, transport: str, args: argparse.Namespace, delay_s: float) -> None:
        self.before: dict[str, float] | None = None
        self.url, self.model = args.url, args.model
        self.timer = None
        if transport in ("http-json", "http-binary", "grpc"):
            self.timer = threading.Timer(delay_s, self._first)
            self.timer.daemon = True
            self.timer.start()

    def _first(self) -> None:
        self.before = scrape(self.url, self.model)

    def finish(self) -> dict[str, Any]:
        if self.timer is None:
            return {}
        self.timer.join()
        return br.metrics_split(self.before, scrape(self.url, self.model))


def in_process(args: argparse.Namespace, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The model called directly, in a subprocess (this package stays torch-free)."""
    model_dir = Path(args.model_dir) if args.model_dir else cache_dir() / "examples"
    threads = args.in_process_threads or max(1, (os.cpu_count() or 1) - 1)
    batches = br.baseline_batches(rows)
    cmd = [sys.executable, "-m", "zeroserve.workers.inprocess", "--model-dir", str(model_dir),
           "--model", args.model, "--batch-sizes", ",".join(map(str, batches)),
           "--threads", str(threads), "--device", args.in_process_device]
    if args.model_version is not None:
        cmd += ["--version", str(args.model_version)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or ["failed"])[-1]}
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    br.attach_baseline(rows, {r["batch"]: r["ms_per_call"] for r in result["results"]})
    return result


def _check_outputs(args: argparse.Namespace) -> None:
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise Usage("--plot needs matplotlib: pip install 'zeroserve[plot]' "
                        "(or pip install matplotlib)") from None
    for flag in ("csv", "json", "plot"):
        path = getattr(args, flag)
        if path and not Path(path).resolve().parent.is_dir():
            raise Usage(f"--{flag} {path}: its folder does not exist")


def run(args: argparse.Namespace) -> int:
    """Run a parsed command line (from add_arguments); the exit status."""
    try:
        return _run(args)
    except Usage as exc:
        print(f"zeroserve bench: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except Unreachable as exc:
        print(f"zeroserve bench: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except KeyboardInterrupt:
        return 130


def _run(args: argparse.Namespace) -> int:
    transports = [t.strip() for t in args.transport.split(",") if t.strip()]
    bad = [t for t in transports if t not in bl.TRANSPORTS]
    if bad or not transports:
        raise Usage(f"--transport {args.transport!r}: choose from {', '.join(bl.TRANSPORTS)}")
    if args.processes < 1 or args.batch_size < 1 or args.max_inflight < 1:
        raise Usage("--processes, --batch-size and --max-inflight must be at least 1")
    _check_outputs(args)
    levels = levels_of(args)
    endpoint = args.endpoint or Endpoints.in_dir(
        Path(args.runtime_dir) if args.runtime_dir else None).frontend
    progress = Progress(args.quiet)
    rows: list[dict[str, Any]] = []
    for transport in transports:
        rows += run_transport(transport, args, endpoint, levels, progress)
    baseline = in_process(args, rows) if args.in_process else None
    print(br.table(rows))
    if baseline is not None:
        print(_baseline_line(baseline))
    print(f"load generator and server share this host's {os.cpu_count()} cores")
    settings = {k: v for k, v in vars(args).items() if k != "func"}
    settings.update(cores=os.cpu_count(), in_process=baseline)
    if args.csv:
        br.write_csv(Path(args.csv), rows)
    if args.json:
        br.write_json(Path(args.json), rows, settings)
    if args.plot:
        br.plot(Path(args.plot), rows)
    return EXIT_OK


def _baseline_line(b: dict[str, Any]) -> str:
    if "error" in b:
        return f"in-process baseline unavailable: {b['error']}"
    calls = ", ".join(f"b={r['batch']} {r['ms_per_call']:.3f} ms ({r['samples_per_s']:.0f}/s)"
                      for r in b["results"])
    return f"in-process {b['model']}/{b['version']}, {b['threads']} thread(s): {calls}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="zeroserve bench", description=HELP)
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
