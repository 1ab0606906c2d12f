"""The load loops of ``zeroserve bench``: senders for each transport, the closed loop
(concurrency) and the open loop (a schedule of arrivals), and the raw samples a level
leaves. Samples stay raw (every latency) so levels run in several processes merge
exactly."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from zeroserve.broker.bench import inputs as bi
from zeroserve.broker.bench.grpcload import GrpcSender
from zeroserve.broker.bench.http import HttpConnection, HttpError, Url, request_bytes
from zeroserve.broker.client import AsyncClient, InferError

# http-raw POSTs a body file as is: for measuring a peer server (TorchServe's
# /predictions/NAME) with the same generator, in the same run
# ping: the broker's ping verb over the direct client, answered by the broker alone: the
# messaging floor beside which the direct client's figures are read
# grpc: Triton's ModelInfer with raw tensors (broker/bench/grpcload.py)
TRANSPORTS = ("http-json", "http-binary", "grpc", "direct", "http-raw", "ping")


@dataclass
class Plan:
    """Everything a load process needs (picklable: it crosses to spawned processes)."""

    transport: str
    url: str
    endpoint: str
    options: bi.RequestOptions
    inputs: dict[str, np.ndarray]
    slo_ms: float = 0.0            # goodput counts answers within this (0: every answer)
    client_timeout_s: float = 30.0
    max_inflight: int = 1024       # open loop: requests in flight per process at most
    raw: "RawRequest | None" = None  # http-raw: what to send instead of a v2 body
    grpc_url: str = "127.0.0.1:8001"  # grpc: the gateway's gRPC address


@dataclass(frozen=True)
class RawRequest:
    path: str
    body: bytes
    content_type: str


@dataclass
class LevelPlan:
    """One process's share of a level: ``concurrency`` streams, or ``arrivals`` (offsets
    in seconds from the start)."""

    concurrency: int
    arrivals: list[float] | None
    warmup_s: float
    duration_s: float


@dataclass
class Samples:
    """What one level left: every counted request's latency, raw."""

    latencies_s: list[float] = field(default_factory=list)   # answered OK
    within_slo: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    queue_ms: list[float] = field(default_factory=list)      # the direct reply's stats
    compute_ms: list[float] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)
    lag_s: list[float] = field(default_factory=list)         # open loop: send - schedule
    scheduled: int = 0                                       # open loop: arrivals counted
    capped: int = 0          # open loop: arrivals that waited for a free in-flight slot
    cpu_fraction: list[float] = field(default_factory=list)  # per process, of one core
    window_s: float = 0.0
    progress_ok: int = 0                                     # every answer, warm-up too
    progress_err: int = 0

    def merge(self, other: "Samples") -> None:
        self.latencies_s += other.latencies_s
        self.within_slo += other.within_slo
        for key, n in other.errors.items():
            self.errors[key] = self.errors.get(key, 0) + n
        self.queue_ms += other.queue_ms
        self.compute_ms += other.compute_ms
        self.batch_sizes += other.batch_sizes
        self.lag_s += other.lag_s
        self.scheduled += other.scheduled
        self.capped += other.capped
        self.cpu_fraction += other.cpu_fraction
        self.window_s = max(self.window_s, other.window_s)


# an outcome: None for OK, else the error's key; and the server's stats when it sent any
Outcome = tuple[str | None, dict[str, float] | None]


class HttpSender:
    """HTTP v2, JSON or binary bodies, over a pool of keep-alive connections: a closed
    loop of C streams ends up with C connections, an open loop with as many as it has
    requests in flight."""

    def __init__(self, plan: Plan) -> None:
        self.url = Url.parse(plan.url)
        self.timeout_s = plan.client_timeout_s
        headers = {"Content-Type": "application/json"}
        path = bi.infer_path(plan.options)
        if plan.raw is not None:
            body, path = plan.raw.body, plan.raw.path
            headers = {"Content-Type": plan.raw.content_type}
        elif plan.transport == "http-binary":
            body, hlen = bi.binary_body(plan.inputs, plan.options)
            headers = {"Content-Type": "application/octet-stream",
                       "Inference-Header-Content-Length": str(hlen)}
        else:
            body = bi.json_body(plan.inputs, plan.options)
        self.raw = request_bytes(self.url, "POST", path, body, headers)
        self._idle: list[HttpConnection] = []

    async def start(self) -> None:
        return None

    async def prepare(self, streams: int) -> None:
        """Open connections ahead of a closed-loop level, outside its timed window."""
        while len(self._idle) < streams:
            self._idle.append(await HttpConnection.open(self.url))

    async def call(self) -> Outcome:
        conn = None
        while self._idle and conn is None:
            conn = self._idle.pop()
            conn = None if conn.closed else conn
        try:
            if conn is None:
                conn = await HttpConnection.open(self.url)
            resp = await conn.send(self.raw, self.timeout_s)
        except TimeoutError:
            return "client_timeout", None
        except HttpError:
            return "connection", None
        if not conn.closed:
            self._idle.append(conn)
        return (None if resp.status == 200 else str(resp.status)), None

    async def close(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle = []


class DirectSender:
    """The direct ZeroMQ client: one AsyncClient per process, any number in flight."""

    def __init__(self, plan: Plan) -> None:
        self.endpoint = plan.endpoint
        self.opts = plan.options
        self.tensors = bi.tensors(plan.inputs)
        self.ping = plan.transport == "ping"
        self.client: AsyncClient | None = None

    async def start(self) -> None:
        self.client = AsyncClient(self.endpoint)
        await self.client.start()

    async def prepare(self, streams: int) -> None:
        assert self.client is not None
        if not await self.client.wait_connected(5):
            raise ConnectionError(f"the broker at {self.endpoint} does not answer")

    async def call(self) -> Outcome:
        assert self.client is not None
        o = self.opts
        try:
            if self.ping:
                await self.client.control("ping")
                return None, None
            reply = await self.client.infer_tensors(o.model, self.tensors, version=o.version,
                                                    priority=o.priority, timeout_ms=o.timeout_ms)
        except InferError as exc:
            return exc.code.value, None
        return None, reply.stats

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()


Sender = HttpSender | DirectSender | GrpcSender


def make_sender(plan: Plan) -> Sender:
    if plan.transport == "grpc":
        return GrpcSender(plan)
    return DirectSender(plan) if plan.transport in ("direct", "ping") else HttpSender(plan)


class Recorder:
    """Counts outcomes into a Samples; only requests started (or scheduled) inside the
    measured window count."""

    def __init__(self, samples: Samples, slo_s: float) -> None:
        self.s = samples
        self.slo_s = slo_s

    def record(self, started: float, outcome: Outcome, counted: bool) -> None:
        took = time.monotonic() - started
        error, stats = outcome
        s = self.s
        if error is None:
            s.progress_ok += 1
        else:
            s.progress_err += 1
        if not counted:
            return
        if error is not None:
            s.errors[error] = s.errors.get(error, 0) + 1
            return
        s.latencies_s.append(took)
        if not self.slo_s or took <= self.slo_s:
            s.within_slo += 1
        if stats:
            s.queue_ms.append(float(stats.get("queue_ms", 0.0)))
            s.compute_ms.append(float(stats.get("compute_ms", 0.0)))
            s.batch_sizes.append(int(stats.get("batch_size", 0)))


async def closed_loop(sender: Sender, streams: int, t_count: float, t_end: float,
                      rec: Recorder) -> None:
    async def stream() -> None:
        while (t0 := time.monotonic()) < t_end:
            rec.record(t0, await sender.call(), t0 >= t_count)
    await asyncio.gather(*[stream() for _ in range(streams)])


async def open_loop(sender: Sender, arrivals: list[float], t_start: float, t_count: float,
                    t_end: float, rec: Recorder, max_inflight: int) -> None:
    """Send at the scheduled times, whatever is in flight. Latency counts from the
    scheduled time, so a generator (or server) that falls behind shows in it rather
    than hiding (no coordinated omission)."""
    slots = asyncio.Semaphore(max_inflight)
    tasks: set[asyncio.Task[None]] = set()

    async def one(at: float, counted: bool) -> None:
        try:
            if counted:
                rec.s.lag_s.append(time.monotonic() - at)
            rec.record(at, await sender.call(), counted)
        finally:
            slots.release()

    behind = 0
    for offset in arrivals:
        at = t_start + offset
        delay = at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
            behind = 0
        else:
            behind += 1
            if behind % 16 == 0:  # behind schedule: still let answers in now and then
                await asyncio.sleep(0)
        if slots.locked():
            rec.s.capped += 1
        await slots.acquire()
        counted = t_count <= at < t_end
        rec.s.scheduled += counted
        task = asyncio.get_running_loop().create_task(one(at, counted))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.gather(*tasks)


async def run_level(sender: Sender, plan: Plan, level: LevelPlan, start_at: float,
                    progress: Callable[[Samples], None] | None = None) -> Samples:
    """Run one process's share of a level from ``start_at`` (time.monotonic(), which
    every process on the host shares)."""
    samples = Samples()
    rec = Recorder(samples, plan.slo_ms / 1000.0)
    await sender.prepare(level.concurrency if level.arrivals is None else 0)
    t_count = start_at + level.warmup_s
    t_end = t_count + level.duration_s
    loop = asyncio.get_running_loop()
    cpu: dict[str, float] = {}

    def mark(name: str) -> None:
        cpu[name] = time.process_time()
    loop.call_later(max(0.0, t_count - time.monotonic()), mark, "count")
    loop.call_later(max(0.0, t_end - time.monotonic()), mark, "end")
    ticker = loop.create_task(_tick(samples, progress)) if progress else None
    await asyncio.sleep(max(0.0, start_at - time.monotonic()))
    try:
        if level.arrivals is None:
            await closed_loop(sender, level.concurrency, t_count, t_end, rec)
        else:
            await open_loop(sender, level.arrivals, start_at, t_count, t_end, rec,
                            plan.max_inflight)
    finally:
        if ticker is not None:
            ticker.cancel()
    cpu.setdefault("count", cpu.get("end", time.process_time()))
    cpu.setdefault("end", time.process_time())
    samples.window_s = level.duration_s
    samples.cpu_fraction = [(cpu["end"] - cpu["count"]) / level.duration_s
                            if level.duration_s else 0.0]
    return samples


async def _tick(samples: Samples, progress: Callable[[Samples], None]) -> None:
    while True:
        await asyncio.sleep(0.5)
        progress(samples)


def arrivals(rate: float, seconds: float, distribution: str, seed: int) -> list[float]:
    """Arrival offsets over ``seconds``: a Poisson process (exponential gaps) or evenly
    spaced."""
    if rate <= 0:
        return []
    n_max = int(rate * seconds * 1.5) + 16
    if distribution == "constant":
        offsets = np.arange(n_max) / rate
    else:
        offsets = np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, n_max))
        while offsets[-1] < seconds:  # rare: the draw ran short
            offsets = np.concatenate([offsets, offsets[-1] + np.cumsum(
                np.random.default_rng(seed + len(offsets)).exponential(1.0 / rate, n_max))])
    return [float(x) for x in offsets[offsets < seconds]]


def split(level: LevelPlan, processes: int) -> list[LevelPlan]:
    """Each process's share: streams divided as evenly as they go; the arrivals dealt in
    turn, so the processes together follow the one schedule."""
    out = []
    for i in range(processes):
        streams = level.concurrency // processes + (i < level.concurrency % processes)
        share = level.arrivals[i::processes] if level.arrivals is not None else None
        out.append(LevelPlan(streams, share, level.warmup_s, level.duration_s))
    return out
