"""Figures of ``zeroserve bench``: one row per level from the merged raw samples (and,
over HTTP, the server's metrics around the level), as a table, CSV, JSON and a plot."""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from zeroserve.broker.bench.load import Samples

CPU_BOUND = 0.9        # a load process above this share of a core is the bottleneck
LAG_BOUND_S = 0.005    # open loop: sends this late (p99) mean the generator fell behind

COLUMNS = ["transport", "mode", "load", "processes", "duration_s", "requests", "ok",
           "error_count", "errors", "throughput_rps", "samples_per_s", "goodput_rps",
           "slo_ms", "mean_ms", "p50_ms", "p90_ms", "p99_ms", "max_ms", "target_rps",
           "offered_rps", "schedule_lag_p99_ms", "server_source", "server_queue_ms",
           "server_queue_p99_ms", "server_compute_ms", "server_batch_mean",
           "generator_cpu_pct", "bottleneck", "in_process_batch", "in_process_ms",
           "in_process_samples_per_s"]


def _pct(values: Sequence[float], q: float, scale: float = 1000.0) -> float | None:
    return round(float(np.percentile(values, q)) * scale, 3) if len(values) else None


def level_row(transport: str, mode: str, load: float, processes: int, s: Samples,
              rows_per_request: int, slo_ms: float, server: dict[str, Any]) -> dict[str, Any]:
    d = s.window_s or 1.0
    ok = len(s.latencies_s)
    errs = sum(s.errors.values())
    lat = s.latencies_s
    row: dict[str, Any] = {
        "transport": transport, "mode": mode, "load": load, "processes": processes,
        "duration_s": round(d, 3), "requests": ok + errs, "ok": ok, "error_count": errs,
        "errors": dict(sorted(s.errors.items())),
        "throughput_rps": round(ok / d, 1), "samples_per_s": round(ok * rows_per_request / d, 1),
        "goodput_rps": round(s.within_slo / d, 1), "slo_ms": slo_ms or None,
        "mean_ms": round(float(np.mean(lat)) * 1000, 3) if lat else None,
        "p50_ms": _pct(lat, 50), "p90_ms": _pct(lat, 90), "p99_ms": _pct(lat, 99),
        "max_ms": round(max(lat) * 1000, 3) if lat else None,
        "target_rps": load if mode == "rate" else None,
        "offered_rps": round(s.scheduled / d, 1) if mode != "concurrency" else None,
        "schedule_lag_p99_ms": _pct(s.lag_s, 99) if mode != "concurrency" else None,
        "generator_cpu_pct": round(max(s.cpu_fraction) * 100, 1) if s.cpu_fraction else None,
        "in_process_batch": None, "in_process_ms": None, "in_process_samples_per_s": None,
        **server,
    }
    if s.batch_sizes:  # the direct client: each reply's own stats
        row.update(server_source="reply stats",
                   server_queue_ms=round(float(np.mean(s.queue_ms)), 3),
                   server_queue_p99_ms=round(float(np.percentile(s.queue_ms, 99)), 3),
                   server_compute_ms=round(float(np.mean(s.compute_ms)), 3),
                   # one sample per request: weigh each by 1/size to count batches
                   server_batch_mean=round(len(s.batch_sizes) /
                                           sum(1.0 / max(1, b) for b in s.batch_sizes), 2))
    row.setdefault("server_source", "unavailable")
    for key in ("server_queue_ms", "server_queue_p99_ms", "server_compute_ms",
                "server_batch_mean"):
        row.setdefault(key, None)
    row["bottleneck"] = bottleneck(s, mode)
    return row


def bottleneck(s: Samples, mode: str) -> str:
    """Why these figures may be the generator's limit rather than the server's."""
    notes = []
    if s.cpu_fraction and max(s.cpu_fraction) >= CPU_BOUND:
        notes.append(f"load generator at {max(s.cpu_fraction) * 100:.0f}% of a core "
                     "(try --processes)")
    if mode != "concurrency" and s.lag_s and np.percentile(s.lag_s, 99) > LAG_BOUND_S:
        if s.capped:
            notes.append(f"{s.capped} arrivals waited for an in-flight slot (--max-inflight): "
                         "the server fell behind the schedule")
        else:
            notes.append(f"open loop fell behind its schedule (p99 "
                         f"{np.percentile(s.lag_s, 99) * 1000:.1f} ms late)")
    return "; ".join(notes)


# -- the server's split over HTTP, from its Prometheus metrics -----------------
_LINE = re.compile(r"^([a-zA-Z_:]+)(\{[^}]*\})? ([0-9.eE+-]+|NaN|[+-]Inf)$")


def metric_sums(text: str, model: str) -> dict[str, float]:
    """The sums and counts of the broker's queue, compute and batch size histograms for
    ``model`` (summed over the other labels)."""
    wanted = {f"zeroserve_inference_{h}_{part}" for h in ("queue_seconds", "compute_seconds",
                                                          "batch_size")
              for part in ("sum", "count")}
    out = dict.fromkeys(wanted, 0.0)
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m or m.group(1) not in wanted:
            continue
        if f'model="{model}"' in (m.group(2) or ""):
            out[m.group(1)] += float(m.group(3))
    return out


def metrics_split(before: dict[str, float] | None, after: dict[str, float] | None
                  ) -> dict[str, Any]:
    """Means over the level from two scrapes (server-wide: other clients count too)."""
    if not before or not after:
        return {}
    d = {k: after[k] - before.get(k, 0.0) for k in after}

    def mean(name: str, scale: float) -> float | None:
        n = d[f"zeroserve_inference_{name}_count"]
        return round(d[f"zeroserve_inference_{name}_sum"] / n * scale, 3) if n > 0 else None
    return {"server_source": "metrics (means)", "server_queue_ms": mean("queue_seconds", 1e3),
            "server_compute_ms": mean("compute_seconds", 1e3),
            "server_batch_mean": mean("batch_size", 1.0)}


# -- the in-process baseline ----------------------------------------------------
def baseline_batches(rows: list[dict[str, Any]]) -> list[int]:
    """The batch sizes the server formed: each level's mean, rounded, and 1."""
    sizes = {1}
    for row in rows:
        b = row.get("server_batch_mean")
        if b:
            sizes.add(max(1, int(round(b))))
    return sorted(sizes)


def attach_baseline(rows: list[dict[str, Any]], timings: dict[int, float]) -> None:
    for row in rows:
        b = max(1, int(round(row.get("server_batch_mean") or 1)))
        if b in timings:
            row.update(in_process_batch=b, in_process_ms=round(timings[b], 3),
                       in_process_samples_per_s=round(b / timings[b] * 1000, 1))


# -- output -----------------------------------------------------------------------
def _fmt(v: Any, spec: str = ".2f") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, spec) if isinstance(v, (int, float)) else str(v)


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'transport':<12} {'load':>9} {'req/s':>8} {'p50':>7} {'p90':>7} {'p99':>7} "
            f"{'max':>7} {'good/s':>8} {'err':>5} {'queue':>6} {'comp':>6} {'batch':>5} "
            f"{'gen%':>5} {'inproc ms@b':>12}")
    out = [head, "-" * len(head)]
    for r in rows:
        load = {"concurrency": f"C={r['load']:g}", "rate": f"{r['load']:g}/s"}.get(
            r["mode"], "trace")
        inproc = (f"{r['in_process_ms']:.3f}@{r['in_process_batch']}"
                  if r.get("in_process_ms") is not None else "-")
        out.append(f"{r['transport']:<12} {load:>9} {_fmt(r['throughput_rps'], '.0f'):>8} "
                   f"{_fmt(r['p50_ms']):>7} {_fmt(r['p90_ms']):>7} {_fmt(r['p99_ms']):>7} "
                   f"{_fmt(r['max_ms']):>7} {_fmt(r['goodput_rps'], '.0f'):>8} "
                   f"{r['error_count']:>5} {_fmt(r['server_queue_ms']):>6} "
                   f"{_fmt(r['server_compute_ms']):>6} {_fmt(r['server_batch_mean'], '.1f'):>5} "
                   f"{_fmt(r['generator_cpu_pct'], '.0f'):>5} {inproc:>12}")
    out.append("latencies in ms; queue/comp/batch: the server's own split (direct: each "
               "reply's stats; HTTP: means from /metrics)")
    out += [f"  {r['transport']} {r['mode']} {r['load']:g}: {r['bottleneck']}"
            for r in rows if r["bottleneck"]]
    return "\n".join(out)


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: (json.dumps(r[k]) if isinstance(r[k], dict) else
                            "" if r[k] is None else r[k]) for k in COLUMNS})


def write_json(path: Path, rows: list[dict[str, Any]], run: dict[str, Any]) -> None:
    path.write_text(json.dumps({"run": run, "levels": rows}, indent=2) + "\n")


def plot(path: Path, rows: list[dict[str, Any]]) -> None:
    """Latency percentiles and throughput against load, one line per transport and mode.
    matplotlib is the optional extra ``plot``; the caller checks it is installed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (ax_lat, ax_tp) = plt.subplots(1, 2, figsize=(11, 4.2))
    series: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        series.setdefault((r["transport"], r["mode"]), []).append(r)
    for (transport, mode), rs in series.items():
        rs = sorted(rs, key=lambda r: r["load"])
        xs = [r["load"] for r in rs]
        line: Any = None
        for key, style in (("p50_ms", "-"), ("p90_ms", "--"), ("p99_ms", ":")):
            ys = [r[key] if r[key] is not None else float("nan") for r in rs]
            kw: dict[str, Any] = {"color": line.get_color()} if line is not None else {}
            (drawn,) = ax_lat.plot(xs, ys, style, marker="o", label=f"{transport} {key[:3]}",
                                   **kw)
            line = line or drawn
        ax_tp.plot(xs, [r["throughput_rps"] for r in rs], "-", marker="o",
                   color=line.get_color() if line else None, label=f"{transport} ({mode})")
    xlabel = "concurrency" if all(r["mode"] == "concurrency" for r in rows) else "load"
    ax_lat.set(xlabel=xlabel, ylabel="latency (ms)", title="latency percentiles")
    ax_tp.set(xlabel=xlabel, ylabel="requests/s", title="throughput")
    loads = [r["load"] for r in rows if r["load"]]
    for ax in (ax_lat, ax_tp):
        if loads and min(loads) > 0 and max(loads) / min(loads) >= 8:
            ax.set_xscale("log", base=2)  # 1, 16, 64 spread out evenly
            ax.set_xticks(sorted(set(loads)))
            ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
            ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
