"""Triton ensembles run by a real ``zeroserve serve``, seen through tritonclient.http and
tritonclient.grpc unchanged: a Python preprocess, a TorchScript model and a Python
postprocess as one pipeline; its steps batched with each other's callers; a deadline
too short refused before any step runs; a failing step answered once, named; a worker
SIGKILLed mid-pipeline under load; malformed ensembles refused while the rest serves."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import torch
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from tritonclient.utils import InferenceServerException

from zeroserve.broker.client import Client, ErrorCode, InferError
from tests.conftest import Server, linear_config, short_tmpdir, wait_for, write_model

pytestmark = pytest.mark.timeout(240)

# the preprocess takes 20 ms a batch (so the pipeline has a time to predict) and fails,
# on purpose, a batch holding a row whose first value is -7
PRE = '''
import time

import torch


class Model:
    def load(self, version_dir, device):
        pass

    def predict(self, inputs):
        x = inputs["x"]
        if bool((x[:, 0] == -7).any()):
            raise RuntimeError("preprocess refused the row on purpose")
        time.sleep(0.02)  # noqa: sleep-ok (the model under test is slow on purpose)
        return {"y": x * 2 + 1}
'''
POST = '''
import torch


class Model:
    def load(self, version_dir, device):
        pass

    def predict(self, inputs):
        return {"probs": torch.softmax(inputs["logits"], dim=1)}
'''

# a decoupled postprocess: three responses, the probabilities times 1, 2 and 3
GEN = '''
import torch


class Model:
    def load(self, version_dir, device):
        pass

    def predict(self, inputs, rows):
        for k in (1, 2, 3):
            yield {i: ({"probs": torch.softmax(inputs["logits"][r], dim=1) * k}, k == 3)
                   for i, r in enumerate(rows)}
'''


def python_model(repo: Path, name: str, code: str, ins: dict[str, int],
                 outs: dict[str, int]) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(code)
    (repo / name / "config.json").write_text(json.dumps({
        "name": name, "platform": "python", "max_batch_size": 8,
        "inputs": [{"name": n, "datatype": "FP32", "shape": [d]} for n, d in ins.items()],
        "outputs": [{"name": n, "datatype": "FP32", "shape": [d]} for n, d in outs.items()],
        "dynamic_batching": {"max_queue_delay_ms": 2}}))


def ensemble(name: str, steps: list[dict[str, Any]], out: int = 3) -> dict[str, Any]:
    return {"name": name, "platform": "ensemble", "max_batch_size": 8,
            "inputs": [{"name": "RAW", "datatype": "FP32", "shape": [4]}],
            "outputs": [{"name": "OUT", "datatype": "FP32", "shape": [out]}],
            "ensemble_scheduling": {"step": steps}}


def step(model: str, ins: dict[str, str], outs: dict[str, str]) -> dict[str, Any]:
    return {"model_name": model, "model_version": -1, "input_map": ins, "output_map": outs}


STEPS = [step("pre", {"x": "RAW"}, {"y": "pre_out"}),
         step("net", {"input": "pre_out"}, {"output": "logits"}),
         step("post", {"logits": "logits"}, {"probs": "OUT"})]
BROKEN = {   # each refused at load, named by step and tensor
    "bad_cycle": ([step("pre", {"x": "b"}, {"y": "a"}), step("pre", {"x": "a"}, {"y": "b"}),
                   step("net", {"input": "RAW"}, {"output": "OUT"})],
                  "input tensor 'b' is part of a cycle"),
    "bad_unknown": ([step("nowhere", {"x": "RAW"}, {"y": "OUT"})],
                    "model 'nowhere' is not in the repository"),
    "bad_dtype": ([step("pre", {"x": "RAW"}, {"y": "mid"}), step("net", {"input": "mid"},
                                                                  {"output": "OUT"}),
                   step("post", {"logits": "mid"}, {"probs": "OUT2"})],
                  "input 'logits' takes FP32 [-1, 3] but tensor 'mid' is FP32 [-1, 4]"),
    "bad_twice": ([step("pre", {"x": "RAW"}, {"y": "OUT"}), step("pre", {"x": "RAW"},
                                                                  {"y": "OUT"})],
                  "output tensor 'OUT' is already produced by step[0]"),
    "bad_output": ([step("net", {"input": "RAW"}, {"output": "mid"})],
                     "ensemble output 'OUT' is not produced by any step"),
}


def make_repo() -> Path:
    repo = short_tmpdir("zsrepo")
    python_model(repo, "pre", PRE, {"x": 4}, {"y": 4})
    python_model(repo, "post", POST, {"logits": 3}, {"probs": 3})
    python_model(repo, "gen", GEN, {"logits": 3}, {"probs": 3})
    cfg = json.loads((repo / "gen" / "config.json").read_text())
    cfg.update(model_transaction_policy={"decoupled": True}, warmup={"batch_sizes": []})
    (repo / "gen" / "config.json").write_text(json.dumps(cfg))
    write_model(repo, "net", 1, "nn.Linear(4, 3)",
                linear_config("net", dynamic_batching={"max_queue_delay_ms": 2}))
    streamed = STEPS[:2] + [step("gen", {"logits": "logits"}, {"probs": "OUT"})]
    for name, cfg in [("pipe", ensemble("pipe", STEPS)), ("spipe", ensemble("spipe", streamed))] + \
            [(n, ensemble(n, s, out=4 if n == "bad_twice" else 3))
             for n, (s, _) in BROKEN.items()]:
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.json").write_text(json.dumps(cfg))
    return repo


@pytest.fixture(scope="module")
def srv() -> Iterator[Server]:
    repo = make_repo()
    server = Server(repo, workers=2, extra=[
        "--readiness", "any", "--trace-config", f"triton,file={repo / 'trace.json'}",
        "--trace-config", "triton,log-frequency=1"])
    try:
        server.wait_ready(120)
        client = thttp.InferenceServerClient(server.url.removeprefix("http://"))
        wait_for(lambda: client.is_model_ready("pipe"), 60, "the ensemble to be ready")
        client.close()
        yield server
    finally:
        server.stop()
        shutil.rmtree(repo, ignore_errors=True)


def rows(seed: int, n: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 4)).astype(np.float32)


def in_process(srv: Server, x: np.ndarray) -> np.ndarray:
    net = torch.jit.load(str(srv.model_dir / "net" / "1" / "model.pt"))
    with torch.inference_mode():
        return np.asarray(torch.softmax(net(torch.from_numpy(x) * 2 + 1), dim=1).numpy())


def http_infer(client: Any, x: np.ndarray, **kw: Any) -> np.ndarray:
    inp = thttp.InferInput("RAW", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return np.asarray(client.infer("pipe", [inp], **kw).as_numpy("OUT"))


def grpc_infer(client: Any, x: np.ndarray) -> np.ndarray:
    inp = tgrpc.InferInput("RAW", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return np.asarray(client.infer("pipe", [inp]).as_numpy("OUT"))


def counts(client: Any, model: str) -> tuple[int, int]:
    (doc,) = client.get_inference_statistics(model)["model_stats"]
    return int(doc.get("inference_count", 0)), int(doc.get("execution_count", 0))


def census(srv: Server) -> dict[str, int]:
    with Client(srv.control, timeout_s=5) as c:
        got: dict[str, int] = c.control("census")
        return got


def quiet(srv: Server) -> dict[str, int]:
    return wait_for(lambda: (lambda c: c if not any(c.values()) else None)(census(srv)), 20,
                    "the census to be empty")


def test_32_concurrent_pipelines_over_http_and_grpc_equal_the_pipeline_in_process(srv
                                                                                  ) -> None:
    client = thttp.InferenceServerClient(srv.url.removeprefix("http://"), concurrency=16)
    before = counts(client, "net")
    xs = [rows(i) for i in range(32)]
    g = tgrpc.InferenceServerClient(srv.grpc_url)
    with ThreadPoolExecutor(16) as pool:   # gRPC from threads, HTTP from this one at once
        by_grpc = [pool.submit(grpc_infer, g, xs[i]) for i in range(0, 32, 2)]
        by_http = []
        for i in range(1, 32, 2):
            inp = thttp.InferInput("RAW", [1, 4], "FP32")
            inp.set_data_from_numpy(xs[i])
            by_http.append(client.async_infer("pipe", [inp]))
        got = [None] * 32
        for k, req in enumerate(by_http):
            got[2 * k + 1] = np.asarray(req.get_result().as_numpy("OUT"))
        for k, fut in enumerate(by_grpc):
            got[2 * k] = fut.result()
    g.close()
    for x, y in zip(xs, got):
        np.testing.assert_allclose(y, in_process(srv, x), rtol=1e-5, atol=1e-6)
    inferences, executions = (a - b for a, b in zip(counts(client, "net"), before))
    assert inferences == 32
    assert executions < inferences, "the model step never batched"
    assert counts(client, "pipe")[0] >= 32
    quiet(srv)
    client.close()


def test_the_ensemble_shows_as_triton_shows_one(srv) -> None:
    client = thttp.InferenceServerClient(srv.url.removeprefix("http://"))
    assert client.is_model_ready("pipe")
    meta = client.get_model_metadata("pipe")
    assert meta["platform"] == "ensemble"
    assert [t["name"] for t in meta["inputs"]] == ["RAW"]
    config = client.get_model_config("pipe")
    assert [s["model_name"] for s in config["ensemble_scheduling"]["step"]] == \
        ["pre", "net", "post"]
    index = {e["name"]: e for e in client.get_model_repository_index()}
    assert index["pipe"]["state"] == "READY"
    for name, (_, words) in BROKEN.items():
        assert index[name]["state"] == "UNAVAILABLE"
        assert words in index[name]["reason"], index[name]
        assert "ensemble_scheduling" in index[name]["reason"]
    g = tgrpc.InferenceServerClient(srv.grpc_url)
    got = g.get_model_config("pipe").config
    assert got.platform == "ensemble"
    assert [s.model_name for s in got.ensemble_scheduling.step] == ["pre", "net", "post"]
    assert dict(got.ensemble_scheduling.step[1].input_map) == {"input": "pre_out"}
    g.close()
    client.close()


def test_a_deadline_too_short_is_refused_whole_before_any_step_runs(srv) -> None:
    client = thttp.InferenceServerClient(srv.url.removeprefix("http://"))
    http_infer(client, rows(1))   # the preprocess's 20 ms is measured by now
    before = {m: counts(client, m)[0] for m in ("pre", "net", "post")}
    # straight to the broker: its 5 ms start there, so only the pipeline's check refuses
    with Client(srv.frontend, timeout_s=10) as c:
        with pytest.raises(InferError) as direct:
            c.infer("pipe", {"RAW": rows(2)}, timeout_ms=5)
    assert direct.value.code is ErrorCode.DEADLINE
    assert "cannot be met" in str(direct.value) and "'pipe'" in str(direct.value)
    # through the gateway a loaded machine may spend the 5 ms before the broker sees the
    # request: the gateway refuses it then, whole as well
    with pytest.raises(InferenceServerException) as err:
        http_infer(client, rows(2), timeout=5000)   # microseconds, as Triton's
    assert "cannot be met" in str(err.value) and "'pipe'" in str(err.value) \
        or "deadline exceeded in the gateway" in str(err.value), err.value
    assert {m: counts(client, m)[0] for m in ("pre", "net", "post")} == before
    quiet(srv)
    client.close()


def test_a_failing_step_answers_the_pipeline_once_naming_the_step(srv) -> None:
    client = thttp.InferenceServerClient(srv.url.removeprefix("http://"))
    x = rows(3)
    x[0, 0] = -7
    before = counts(client, "net")[0]
    with pytest.raises(InferenceServerException) as err:
        http_infer(client, x)
    assert "step 0 (model 'pre') of ensemble 'pipe' failed" in str(err.value)
    assert "preprocess refused the row on purpose" in str(err.value)
    assert counts(client, "net")[0] == before   # the later steps never ran
    np.testing.assert_allclose(http_infer(client, rows(4)), in_process(srv, rows(4)),
                               rtol=1e-5, atol=1e-6)
    quiet(srv)
    client.close()


def test_a_worker_killed_mid_pipeline_under_load_every_request_answered_once(srv) -> None:
    stop = threading.Event()
    answers: list[str] = []
    lock = threading.Lock()

    def load(seed: int) -> None:
        client = thttp.InferenceServerClient(srv.url.removeprefix("http://"),
                                             network_timeout=60)
        i = 0
        while not stop.is_set():
            x = rows(seed * 1000 + i)
            i += 1
            try:
                y = http_infer(client, x)
                ok = np.allclose(y, in_process(srv, x), rtol=1e-5, atol=1e-6)
                outcome = "ok" if ok else "wrong"
            except InferenceServerException as exc:
                outcome = f"error: {exc}"
            with lock:
                answers.append(outcome)
        client.close()

    def both_hold_the_steps() -> bool:
        # with --readiness any the ensemble is ready once one worker holds its steps: on
        # a loaded machine the other may still be loading them, and the kill would leave
        # no worker to retry on
        with Client(srv.control, timeout_s=5) as c:
            held = [set(w["models"]) for w in c.control("status")["workers"]]
        return len(held) == 2 and all({"pre/1", "net/1", "post/1"} <= h for h in held)

    wait_for(both_hold_the_steps, 90, "both workers to hold every step's model")
    threads = [threading.Thread(target=load, args=(s,)) for s in range(12)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: len(answers) >= 24, 60, "traffic to flow")
        victim = srv.pids("worker")[0]
        os.kill(victim, signal.SIGKILL)
        seen = len(answers)
        # 48 right answers after the kill, not 48 answers: errors (the killed worker's
        # batch) come back faster than pipelines are served, and on a loaded machine
        # could fill a count of any answers before the survivor served one
        wait_for(lambda: answers[seen:].count("ok") >= 48, 90,
                 "right answers to flow after the kill")
    finally:
        stop.set()
        for t in threads:
            t.join(90)
    assert not any(t.is_alive() for t in threads), "a request was never answered"
    assert "wrong" not in answers
    errors = [a for a in answers if a != "ok"]
    for e in errors:   # a failed step is named, and says what happened to it
        assert "of ensemble 'pipe'" in e or "no worker" in e, e
    quiet(srv)
    assert not Server.alive(victim)
    wait_for(lambda: len([p for p in srv.pids("worker") if p != victim]) == 2, 60,
             "the killed worker restarted")
    client = thttp.InferenceServerClient(srv.url.removeprefix("http://"))
    wait_for(lambda: client.is_model_ready("pipe"), 60, "the ensemble ready again")
    client.close()


def test_a_decoupled_last_step_streams_the_pipeline_over_grpc(srv) -> None:
    import queue

    answers: queue.Queue[Any] = queue.Queue()
    g = tgrpc.InferenceServerClient(srv.grpc_url)
    wait_for(lambda: g.is_model_ready("spipe"), 60, "the streaming ensemble to be ready")
    x = rows(7)
    inp = tgrpc.InferInput("RAW", [1, 4], "FP32")
    inp.set_data_from_numpy(x)
    g.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        g.async_stream_infer("spipe", [inp], request_id="s1")
        got = [answers.get(timeout=30) for _ in range(3)]
    finally:
        g.stop_stream(cancel_requests=True)
        g.close()
    for k, (result, error) in enumerate(got, start=1):
        assert error is None, error
        assert result.get_response().id == "s1"
        np.testing.assert_allclose(result.as_numpy("OUT"), in_process(srv, x) * k,
                                   rtol=1e-5, atol=1e-6)
    with pytest.raises(InferenceServerException, match="decoupled"):
        client = thttp.InferenceServerClient(srv.url.removeprefix("http://"))
        try:
            inp = thttp.InferInput("RAW", [1, 4], "FP32")
            inp.set_data_from_numpy(x)
            client.infer("spipe", [inp])
        finally:
            client.close()
    quiet(srv)


def test_a_traced_pipeline_writes_one_record_per_step_under_its_own(srv) -> None:
    import glob

    client = thttp.InferenceServerClient(srv.url.removeprefix("http://"))
    client.update_trace_settings("pipe", {"trace_level": ["TIMESTAMPS"], "trace_rate": "1",
                                          "trace_count": "-1"})
    try:
        http_infer(client, rows(9))
    finally:
        client.update_trace_settings("pipe", {"trace_level": ["OFF"]})
        client.close()
    pattern = f"{srv.model_dir / 'trace.json'}.*"
    files = wait_for(lambda: glob.glob(pattern), 10, "a trace file")
    records = [r for f in files for r in json.loads(Path(f).read_text())]
    heads = [r for r in records if "model_name" in r]
    (top,) = [h for h in heads if h["model_name"] == "pipe"]
    steps = [h for h in heads if h.get("parent_id") == top["id"]]
    stamps = {h["model_name"]: {t["name"]: t["ns"] for r in records if r["id"] == h["id"]
                                for t in r.get("timestamps", ())} for h in steps}
    assert sorted(stamps) == ["net", "post", "pre"]
    for got in stamps.values():
        assert {"REQUEST_START", "COMPUTE_START", "COMPUTE_END", "REQUEST_END"} <= set(got)
    # one after the other, as the graph says
    assert stamps["pre"]["REQUEST_END"] <= stamps["net"]["REQUEST_START"]
    assert stamps["net"]["REQUEST_END"] <= stamps["post"]["REQUEST_START"]


def test_an_ensemble_whose_step_leaves_is_refused_and_comes_back_with_it(srv) -> None:
    """Last in this file: it takes ``post`` out of the repository and puts it back."""
    client = thttp.InferenceServerClient(srv.url.removeprefix("http://"))
    aside = srv.model_dir.parent / f"{srv.model_dir.name}-post"
    shutil.move(str(srv.model_dir / "post"), str(aside))

    def reason() -> str:
        entry = {e["name"]: e for e in client.get_model_repository_index()}["pipe"]
        return str(entry.get("reason", "")) if entry["state"] == "UNAVAILABLE" else ""
    try:
        why = wait_for(reason, 30, "the ensemble refused without its step")
        assert "step[2] (model 'post'): model 'post' is not in the repository" in why
        with Client(srv.control, timeout_s=5) as c:
            assert "model 'post'" in c.control("models")["errors"]["pipe"]
        with pytest.raises(InferenceServerException):
            http_infer(client, rows(10))
        assert client.is_model_ready("spipe")   # the rest keeps serving
    finally:
        shutil.move(str(aside), str(srv.model_dir / "post"))
    wait_for(lambda: client.is_model_ready("pipe"), 60, "the ensemble back with its step")
    np.testing.assert_allclose(http_infer(client, rows(11)), in_process(srv, rows(11)),
                               rtol=1e-5, atol=1e-6)
    client.close()
