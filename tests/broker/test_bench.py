"""``zeroserve bench`` against a real server on a tiny model: each load mode, each
transport, what the CSV and JSON hold, the plot, the in-process baseline and the exit
statuses. Each run is a second or so of load."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

from tests.conftest import Server, free_port, short_tmpdir
from zeroserve.broker.bench import load as bl
from zeroserve.broker.bench import report as br

SHORT = ["--warmup-s", "0.2", "--duration-s", "0.8", "--quiet"]


def bench(*argv: str, timeout_s: float = 90.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "zeroserve.broker.bench", *argv],
                          capture_output=True, text=True, timeout=timeout_s)


def targets(server: Server) -> list[str]:
    return ["-m", "linear", "--url", server.url, "--runtime-dir", str(server.runtime)]


def levels(out: Path) -> list[dict[str, Any]]:
    return json.loads(out.read_text())["levels"]  # type: ignore[no-any-return]


def check_counts(row: dict[str, Any]) -> None:
    assert row["requests"] == row["ok"] + row["error_count"]
    assert row["error_count"] == sum(row["errors"].values())
    assert row["ok"] > 0
    assert row["throughput_rps"] == pytest.approx(row["ok"] / row["duration_s"], rel=0.01)
    assert 0 < row["p50_ms"] <= row["p90_ms"] <= row["p99_ms"] <= row["max_ms"]
    assert row["goodput_rps"] <= row["throughput_rps"]


@pytest.fixture
def server(serve: Callable[..., Server], tiny_repo: Path) -> Server:
    return serve(tiny_repo)


def test_concurrency_sweep_over_each_transport_writes_csv_and_json(server: Server,
                                                                   tmp_path: Path) -> None:
    out = bench(*targets(server), *SHORT, "--transport", "http-json,http-binary,direct",
                "--concurrency", "1,4", "--json", str(tmp_path / "b.json"),
                "--csv", str(tmp_path / "b.csv"))
    assert out.returncode == 0, out.stderr
    rows = levels(tmp_path / "b.json")
    assert [(r["transport"], r["load"]) for r in rows] == [
        (t, c) for t in ("http-json", "http-binary", "direct") for c in (1, 4)]
    for row in rows:
        check_counts(row)
        assert row["errors"] == {}
        assert row["server_batch_mean"] >= 1
        assert row["server_source"] == ("reply stats" if row["transport"] == "direct"
                                        else "metrics (means)")
    with open(tmp_path / "b.csv") as f:
        table = list(csv.DictReader(f))
    assert [int(r["ok"]) for r in table] == [r["ok"] for r in rows]
    assert [float(r["p99_ms"]) for r in table] == [r["p99_ms"] for r in rows]
    assert "direct" in out.stdout and "C=4" in out.stdout


def test_rate_over_two_processes_counts_every_scheduled_request(server: Server,
                                                                tmp_path: Path) -> None:
    out = bench(*targets(server), *SHORT, "--transport", "http-binary,direct", "--rate",
                "100", "--processes", "2", "--json", str(tmp_path / "r.json"))
    assert out.returncode == 0, out.stderr
    for row in levels(tmp_path / "r.json"):
        check_counts(row)
        scheduled = round(row["offered_rps"] * row["duration_s"])
        assert row["requests"] == scheduled           # merged from both processes
        assert 40 <= row["offered_rps"] <= 200        # Poisson around 100/s over 0.8 s
        assert row["schedule_lag_p99_ms"] is not None and row["processes"] == 2


def test_trace_replays_every_arrival(server: Server, tmp_path: Path) -> None:
    trace = tmp_path / "arrivals.txt"
    trace.write_text("# offsets in seconds\n" + "\n".join(f"{i * 0.02:.3f}" for i in range(25)))
    out = bench(*targets(server), "--warmup-s", "0", "--quiet", "--trace", str(trace),
                "--transport", "direct", "--json", str(tmp_path / "t.json"))
    assert out.returncode == 0, out.stderr
    (row,) = levels(tmp_path / "t.json")
    check_counts(row)
    assert row["mode"] == "trace" and row["requests"] == 25


def test_deadlines_show_as_errors_by_status_and_goodput(server: Server,
                                                        tmp_path: Path) -> None:
    # a 1 µs deadline: the server refuses or expires every request
    out = bench(*targets(server), *SHORT, "--transport", "http-json,direct", "--timeout-ms",
                "0.001", "--priority", "1", "--model-version", "1", "--json",
                str(tmp_path / "d.json"))
    assert out.returncode == 0, out.stderr
    http_row, direct_row = levels(tmp_path / "d.json")
    assert set(http_row["errors"]) == {"504"} and set(direct_row["errors"]) == {"deadline"}
    for row in (http_row, direct_row):
        assert row["ok"] == 0 and row["goodput_rps"] == 0 and row["p50_ms"] is None


def test_inputs_from_files_and_the_in_process_baseline(server: Server, tmp_path: Path
                                                       ) -> None:
    np.save(tmp_path / "x.npy", np.ones((2, 4), np.float32))
    body = {"inputs": [{"name": "input", "shape": [3, 4], "datatype": "FP32",
                        "data": [0.5] * 12}]}
    (tmp_path / "x.json").write_text(json.dumps(body))
    baseline = ["--in-process", "--model-dir", str(server.model_dir)]
    for data, rows_per_request, extra in ((f"input={tmp_path / 'x.npy'}", 2, []),
                                          (str(tmp_path / "x.json"), 3, baseline)):
        out = bench(*targets(server), *SHORT, "--input-data", data, "--transport",
                    "http-binary", "--json", str(tmp_path / "f.json"), *extra)
        assert out.returncode == 0, out.stderr
        (row,) = levels(tmp_path / "f.json")
        check_counts(row)
        assert row["samples_per_s"] == pytest.approx(row["throughput_rps"] * rows_per_request,
                                                     rel=0.01)
    # the model timed at the batch the server formed: 3 rows per request at least
    assert row["in_process_ms"] > 0 and row["in_process_batch"] >= 3
    baseline = json.loads((tmp_path / "f.json").read_text())["run"]["in_process"]
    assert baseline["model"] == "linear" and {r["batch"] for r in baseline["results"]} >= {1}
    assert "in-process linear/1" in out.stdout


def test_plot_is_written(server: Server, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="matplotlib is the optional extra 'plot'")
    png = tmp_path / "b.png"
    out = bench(*targets(server), *SHORT, "--concurrency", "1,2", "--plot", str(png))
    assert out.returncode == 0, out.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unreachable_server_exits_3_and_usage_errors_exit_2(tmp_path: Path) -> None:
    gone = short_tmpdir("zsgone")
    http = bench("-m", "linear", "--url", f"http://127.0.0.1:{free_port()}", *SHORT)
    direct = bench("-m", "linear", "--transport", "direct", "--runtime-dir", str(gone), *SHORT)
    assert (http.returncode, direct.returncode) == (3, 3)
    assert "unreachable" in http.stderr and "unreachable" in direct.stderr
    for argv in (["--transport", "smoke"], ["--concurrency", "0"],
                 ["--rate", "10", "--concurrency", "1"],
                 ["--csv", str(tmp_path / "no" / "such.csv")]):
        out = bench("-m", "linear", *argv, *SHORT)
        assert out.returncode == 2, (argv, out.stderr)
    gone.rmdir()


def test_ping_is_answered_by_the_broker_alone(server: Server, tmp_path: Path) -> None:
    out = bench(*targets(server), *SHORT, "--transport", "ping", "--concurrency", "4",
                "--json", str(tmp_path / "p.json"))
    assert out.returncode == 0, out.stderr
    row = levels(tmp_path / "p.json")[0]
    check_counts(row)
    assert row["errors"] == {} and row["server_source"] == "unavailable"
    gone = bench("-m", "linear", "--transport", "ping", "--runtime-dir",
                 str(tmp_path / "none"), *SHORT)
    assert gone.returncode == 3 and "unreachable" in gone.stderr


class _PeerServer:
    """A real HTTP server on loopback that stands for a peer (TorchServe): it records
    each POST's path and body and answers 200 to /predictions/ok, 503 otherwise."""

    def __init__(self) -> None:
        import http.server
        import threading
        seen = self.seen = []

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                seen.append((self.path, self.headers["Content-Type"], body))
                status = 200 if self.path == "/predictions/ok" else 503
                self.send_response(status)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args: Any) -> None:
                return None

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


def test_http_raw_posts_the_body_file_as_is_to_a_peer(tmp_path: Path) -> None:
    peer = _PeerServer()
    try:
        body = tmp_path / "body.json"
        body.write_bytes(b'{"data": [1, 2, 3]}')
        argv = ["-m", "peer", "--url", peer.url, "--transport", "http-raw", "--body-file",
                str(body), "--concurrency", "2", *SHORT]
        ok = bench(*argv, "--raw-path", "/predictions/ok", "--json", str(tmp_path / "o.json"))
        bad = bench(*argv, "--raw-path", "predictions/down", "--json", str(tmp_path / "d.json"))
        missing = bench(*argv)
    finally:
        peer.close()
    assert ok.returncode == 0, ok.stderr
    row = levels(tmp_path / "o.json")[0]
    check_counts(row)
    assert row["errors"] == {} and row["server_source"] == "unavailable"
    assert bad.returncode == 0, bad.stderr
    down = levels(tmp_path / "d.json")[0]
    assert down["ok"] == 0 and set(down["errors"]) == {"503"}
    assert {(path, ctype, b) for path, ctype, b in peer.seen} == {
        ("/predictions/ok", "application/json", body.read_bytes()),
        ("/predictions/down", "application/json", body.read_bytes())}
    assert missing.returncode == 2 and "--raw-path" in missing.stderr


def test_split_deals_every_arrival_and_merge_keeps_every_sample() -> None:
    level = bl.LevelPlan(7, None, 0.0, 1.0)
    assert sorted(p.concurrency for p in bl.split(level, 3)) == [2, 2, 3]
    offsets = bl.arrivals(500.0, 2.0, "poisson", seed=1)
    assert 800 < len(offsets) < 1200 and offsets == sorted(offsets)
    shares = bl.split(bl.LevelPlan(0, offsets, 0.0, 2.0), 3)
    assert sorted(x for s in shares for x in s.arrivals or []) == offsets
    a = bl.Samples(latencies_s=[0.001, 0.002], errors={"429": 1}, cpu_fraction=[0.95],
                   window_s=1.0)
    a.merge(bl.Samples(latencies_s=[0.003], errors={"429": 2, "504": 1}, cpu_fraction=[0.1],
                       window_s=1.0))
    row = br.level_row("direct", "concurrency", 2, 2, a, 1, 0.0, {})
    assert row["ok"] == 3 and row["errors"] == {"429": 3, "504": 1}
    assert row["max_ms"] == 3.0 and "load generator at 95%" in row["bottleneck"]


def test_bench_modules_never_import_torch() -> None:
    code = ("import sys, zeroserve.broker.bench.main, zeroserve.broker.bench.report; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


def test_grpc_transport_runs_over_the_gateways_grpc_port(server: Server,
                                                        tmp_path: Path) -> None:
    out = bench(*targets(server), *SHORT, "--transport", "grpc,http-binary",
                "--grpc-url", server.grpc_url, "--concurrency", "1,4",
                "--json", str(tmp_path / "g.json"))
    assert out.returncode == 0, out.stderr
    rows = levels(tmp_path / "g.json")
    assert [(r["transport"], r["load"]) for r in rows] == [
        (t, c) for t in ("grpc", "http-binary") for c in (1, 4)]
    for row in rows:
        check_counts(row)
        assert row["errors"] == {}
    # a server that is not there: unreachable, exit 3
    gone = bench(*targets(server), *SHORT, "--transport", "grpc",
                 "--grpc-url", f"127.0.0.1:{free_port()}", "--concurrency", "1")
    assert gone.returncode == 3, gone.stderr


def test_the_hand_encoded_model_infer_request_is_what_protobuf_reads() -> None:
    from zeroserve.broker.bench.grpcload import model_infer_request
    from zeroserve.broker.bench.inputs import RequestOptions
    from zeroserve.models.proto import grpc_service_pb2 as pb

    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    words = np.array([b"a", b"bc"], dtype=object)
    raw = model_infer_request({"input": x, "text": words},
                              RequestOptions("mlp", 3, 1, 2.5))
    req = pb.ModelInferRequest.FromString(raw)
    assert (req.model_name, req.model_version) == ("mlp", "3")
    assert req.parameters["priority"].uint64_param == 1
    assert req.parameters["timeout"].int64_param == 2500
    assert [(i.name, i.datatype, list(i.shape)) for i in req.inputs] == [
        ("input", "FP32", [3, 4]), ("text", "BYTES", [2])]
    assert req.raw_input_contents[0] == x.tobytes()
    assert req.raw_input_contents[1] == b"\x01\x00\x00\x00a\x02\x00\x00\x00bc"
