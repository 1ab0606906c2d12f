"""Server identity, classification, system shared memory and logging, through
tritonclient.http and tritonclient.http.aio unchanged, against a real ``zeroserve
serve`` started with ``--allow-shared-memory`` and its own name and version."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from typing import Iterator

import numpy as np
import pytest
import torch
import tritonclient.http as triton
import tritonclient.http.aio as triton_aio
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from zeroserve.broker import protocol as p
from zeroserve.gateway.classification import classify
from tests.conftest import Server, http, linear_config, short_tmpdir, wait_for, write_model

pytestmark = pytest.mark.timeout(180)

X = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)


@pytest.fixture(scope="module")
def srv() -> Iterator[Server]:
    repo = short_tmpdir("zsrepo")
    write_model(repo, "linear", 1, "nn.Linear(4, 3)", linear_config("linear"))
    server = Server(repo, extra=["--allow-shared-memory", "--server-name", "triton",
                                 "--server-version", "2.99.0"])
    try:
        yield server.wait_ready()
    finally:
        server.stop()
        shutil.rmtree(repo, ignore_errors=True)


def expected(srv: Server) -> np.ndarray:
    module = torch.jit.load(str(srv.model_dir / "linear" / "1" / "model.pt"))
    with torch.inference_mode():
        return module(torch.from_numpy(X)).numpy()


def linear_input() -> triton.InferInput:
    return triton.InferInput("input", [3, 4], "FP32").set_data_from_numpy(X)


def test_server_identity_and_honest_extensions(client) -> None:
    meta = client.get_server_metadata()
    assert meta["name"] == "triton" and meta["version"] == "2.99.0"
    assert set(meta["extensions"]) == {"binary_tensor_data", "schedule_policy",
                                       "model_configuration", "classification", "logging",
                                       "statistics", "model_repository", "trace",
                                       "system_shared_memory"}


def top(values: np.ndarray, k: int) -> list[list[bytes]]:
    return [[f"{row[i]:f}:{i}".encode() for i in np.argsort(-row, kind="stable")[:k]]
            for row in values]


@pytest.mark.parametrize("binary", [True, False])
def test_class_count_returns_the_top_n_per_row(client, srv, binary) -> None:
    out = triton.InferRequestedOutput("output", binary_data=binary, class_count=2)
    res = client.infer("linear", [linear_input()], outputs=[out])
    got = res.as_numpy("output")
    assert got.shape == (3, 2) and res.get_output("output")["datatype"] == "BYTES"
    assert [[bytes(x) if not isinstance(x, str) else x.encode() for x in row]
            for row in got] == top(expected(srv), 2)


def test_class_count_through_the_aio_client(srv) -> None:
    async def run() -> np.ndarray:
        c = triton_aio.InferenceServerClient(srv.url.removeprefix("http://"))
        try:
            res = await c.infer("linear", [linear_input()], outputs=[
                triton_aio.InferRequestedOutput("output", class_count=5)])
            return res.as_numpy("output")
        finally:
            await c.close()
    got = asyncio.run(run())
    assert got.shape == (3, 3)   # more classes asked for than there are: all of them
    assert [list(row) for row in got] == top(expected(srv), 3)


def test_classification_formats_like_triton_with_labels() -> None:
    t = p.from_numpy("out", np.array([[0.5, 2.0, 2.0, -1.0]], np.float32))
    got = classify(t, 3, True, ["a", "b", ""])
    assert got.meta.shape == (1, 3)
    assert p.unpack_bytes_elements(got.data) == [b"2.000000:1:b", b"2.000000:2",
                                                 b"0.500000:0:a"]
    ints = p.from_numpy("out", np.array([7, 250, 3], np.uint8))
    assert p.unpack_bytes_elements(classify(ints, 1, False).data) == [b"250:1"]
    with pytest.raises(ValueError, match="numeric"):
        classify(p.from_numpy("out", np.array([True])), 1, False)


def test_shared_memory_inputs_and_outputs(client, srv) -> None:
    tag = srv.runtime.name
    inp = shm.create_shared_memory_region("in", f"/{tag}-in", X.nbytes)
    out = shm.create_shared_memory_region("out", f"/{tag}-out", 64)
    try:
        shm.set_shared_memory_region(inp, [X])
        client.register_system_shared_memory("in", f"/{tag}-in", X.nbytes)
        client.register_system_shared_memory("out", f"/{tag}-out", 40, offset=8)
        status = client.get_system_shared_memory_status()
        assert [r["name"] for r in status] == ["in", "out"]
        assert client.get_system_shared_memory_status("out") == [
            {"name": "out", "key": f"/{tag}-out", "offset": 8, "byte_size": 40}]

        x = triton.InferInput("input", [3, 4], "FP32")
        x.set_shared_memory("in", X.nbytes)
        y = triton.InferRequestedOutput("output")
        y.set_shared_memory("out", 36)
        res = client.infer("linear", [x], outputs=[y])
        entry = res.get_output("output")   # no bytes over HTTP: no data, no binary size
        assert "data" not in entry and entry["shape"] == [3, 3]
        assert entry["parameters"] == {"shared_memory_region": "out",
                                       "shared_memory_byte_size": 36}
        got = shm.get_contents_as_numpy(out, np.float32, entry["shape"], offset=8)
        np.testing.assert_allclose(got, expected(srv), atol=1e-6)

        small = triton.InferRequestedOutput("output")
        small.set_shared_memory("out", 16)
        with pytest.raises(InferenceServerException, match="region 'out'"):
            client.infer("linear", [x], outputs=[small])
        past = triton.InferInput("input", [3, 4], "FP32")
        past.set_shared_memory("in", X.nbytes, offset=4)
        with pytest.raises(InferenceServerException, match="region 'in'.*runs past"):
            client.infer("linear", [past])
        with pytest.raises(InferenceServerException, match="runs past the segment"):
            client.register_system_shared_memory("big", f"/{tag}-in", X.nbytes + 1)
        with pytest.raises(InferenceServerException, match="unknown shared-memory region"):
            client.get_system_shared_memory_status("nope")

        client.unregister_system_shared_memory("in")
        assert [r["name"] for r in client.get_system_shared_memory_status()] == ["out"]
        with pytest.raises(InferenceServerException, match="unknown shared-memory region"):
            client.infer("linear", [x])
        client.unregister_system_shared_memory()
        assert client.get_system_shared_memory_status() == []
    finally:
        shm.destroy_shared_memory_region(inp)
        shm.destroy_shared_memory_region(out)


def test_a_key_cannot_leave_dev_shm(srv) -> None:
    for key in ("/../etc/passwd", "a/b", ""):
        status, _, body = http("POST", srv.url + "/v2/systemsharedmemory/region/x/register",
                               json.dumps({"key": key, "offset": 0, "byte_size": 1}).encode())
        assert status == 400 and "POSIX shm name" in json.loads(body)["error"], key


def test_shared_memory_is_off_unless_allowed(api_server) -> None:
    status, _, body = http("POST", api_server.url + "/v2/systemsharedmemory/region/r/register",
                           json.dumps({"key": "/k", "offset": 0, "byte_size": 4}).encode())
    assert status == 403 and "--allow-shared-memory" in json.loads(body)["error"]
    _, _, meta = http("GET", api_server.url + "/v2")
    assert "system_shared_memory" not in json.loads(meta)["extensions"]
    doc = {"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32",
                       "parameters": {"shared_memory_region": "r",
                                      "shared_memory_byte_size": 16}}]}
    status, _, body = http("POST", api_server.url + "/v2/models/linear/infer",
                           json.dumps(doc).encode())
    assert status == 400 and "shared memory is off" in json.loads(body)["error"]


def test_log_settings_read_and_change(client, srv) -> None:
    assert client.get_log_settings() == {
        "log_file": "", "log_info": True, "log_warning": True, "log_error": True,
        "log_verbose_level": 0, "log_format": "default"}
    got = client.update_log_settings({"log_verbose_level": 1, "log_format": "ISO8601"})
    assert got["log_verbose_level"] == 1 and got["log_format"] == "ISO8601"
    assert client.get_log_settings() == got
    with pytest.raises(InferenceServerException, match="log_verbose_level"):
        client.update_log_settings({"log_verbose_level": -1})
    with pytest.raises(InferenceServerException, match="unknown log setting 'log_colour'"):
        client.update_log_settings({"log_colour": True})
    back = client.update_log_settings({"log_verbose_level": 0, "log_format": "default"})
    assert back["log_verbose_level"] == 0 and back["log_info"] is True


def test_log_settings_reach_the_broker_and_the_workers(client, srv) -> None:
    client.update_log_settings({"log_format": "ISO8601"})
    try:
        write_model(srv.model_dir, "late", 1, "nn.Linear(4, 3)", linear_config("late"))
        wait_for(lambda: client.is_model_ready("late"), 30, "late to load")
        iso = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z INFO "
        log = srv.log()
        assert re.search(iso + r"worker\d*\[\d+\] \S+: loaded late/1", log), log[-3000:]
        assert re.search(iso + r"broker\[\d+\] \S+: model late now serves", log), log[-3000:]
    finally:
        client.update_log_settings({"log_format": "default"})


def test_load_and_unload_are_refused_while_the_repository_is_polled(client) -> None:
    with pytest.raises(InferenceServerException, match="not allowed with model control "
                       "mode 'poll'"):
        client.load_model("linear")
    with pytest.raises(InferenceServerException, match="not allowed"):
        client.unload_model("linear")
    assert {"name": "linear", "version": "1", "state": "READY", "reason": ""} in \
        client.get_model_repository_index()


def test_class_labels_come_from_labels_txt(client, srv) -> None:
    scratch = short_tmpdir("zslab")
    write_model(scratch, "labelled", 1, "nn.Linear(4, 3)", linear_config("labelled"))
    (scratch / "labelled" / "labels.txt").write_text("cat\ndog\nbird\n")
    (scratch / "labelled").rename(srv.model_dir / "labelled")
    shutil.rmtree(scratch)
    wait_for(lambda: client.is_model_ready("labelled"), 30, "labelled to load")
    out = triton.InferRequestedOutput("output", binary_data=False, class_count=1)
    got = client.infer("labelled", [linear_input()], outputs=[out]).as_numpy("output")
    names = ["cat", "dog", "bird"]
    for row in got:
        value, index, label = (row[0].decode() if isinstance(row[0], bytes)
                               else row[0]).split(":")
        assert label == names[int(index)]

