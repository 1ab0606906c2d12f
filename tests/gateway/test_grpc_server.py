"""Triton's gRPC service against a server of this module's own (explicit model control,
system shared memory on, a small gRPC message limit, gzip answers, a slow model): shared
memory, repository load and unload, cancellation and deadlines, oversized messages,
compressed answers; a tenants file; a taken port."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import socket
import subprocess
import threading
from typing import Iterator

import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.grpc.aio as tga
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from zeroserve.broker.server.tenants import new_key
from tests.conftest import ZEROSERVE, Server, free_port, http, linear_config, short_tmpdir, \
    wait_for, write_model

pytestmark = pytest.mark.timeout(180)

X = np.random.default_rng(5).standard_normal((2, 4)).astype(np.float32)
MAX_MESSAGE = 100_000
SLOW_S = 1.0

SLOW = f'''
import time


class Model:
    """The input back, after {SLOW_S} s: a request behind it waits in the queue."""

    def load(self, version_dir, device):
        pass

    def predict(self, inputs):
        time.sleep({SLOW_S})  # noqa: sleep-ok (the model under test is slow)
        return {{"output": inputs["input"]}}
'''


ZEROS = 1 << 16   # values per row of the zeros model's output: 256 KiB of FP32

ZEROS_MODEL = f'''
import torch


class Model:
    """{ZEROS} zeros a row: an answer that compresses to almost nothing."""

    def load(self, version_dir, device):
        pass

    def predict(self, inputs):
        return {{"output": torch.zeros((len(inputs["input"]), {ZEROS}))}}
'''


def write_zeros(repo) -> None:
    (repo / "zeros" / "1").mkdir(parents=True)
    (repo / "zeros" / "1" / "model.py").write_text(ZEROS_MODEL)
    (repo / "zeros" / "config.json").write_text(json.dumps({
        "name": "zeros", "platform": "python", "max_batch_size": 8,
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [4]}],
        "outputs": [{"name": "output", "datatype": "FP32", "shape": [ZEROS]}]}))


class Relay:
    """A TCP relay in front of the gRPC port that counts the bytes the server sends."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.from_server = 0
        self.threads: list[threading.Thread] = []
        self._spawn(self._accept)

    def _spawn(self, fn, *args) -> None:
        t = threading.Thread(target=fn, args=args, daemon=True)
        t.start()
        self.threads.append(t)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:   # closed
                return
            server = socket.create_connection(("127.0.0.1", self.target_port))
            self._spawn(self._pump, client, server, False)
            self._spawn(self._pump, server, client, True)

    def _pump(self, src: socket.socket, dst: socket.socket, counted: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                if counted:
                    self.from_server += len(data)
                dst.sendall(data)
        except OSError:   # the other direction ended the connection
            pass
        finally:
            src.close()
            dst.close()

    def close(self) -> None:
        self.listener.close()


def write_slow(repo) -> None:
    (repo / "slow" / "1").mkdir(parents=True)
    (repo / "slow" / "1" / "model.py").write_text(SLOW)
    (repo / "slow" / "config.json").write_text(json.dumps({
        "name": "slow", "platform": "python", "max_batch_size": 8,
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [4]}],
        "outputs": [{"name": "output", "datatype": "FP32", "shape": [4]}]}))


@pytest.fixture(scope="module")
def srv() -> Iterator[Server]:
    repo = short_tmpdir("zsrepo")
    for name in ("linear", "other"):
        write_model(repo, name, 1, "nn.Linear(4, 3)", linear_config(name))
    write_slow(repo)
    write_zeros(repo)
    server = Server(repo, extra=["--model-control-mode", "explicit", "--load-model", "linear",
                                 "--load-model", "slow", "--load-model", "zeros",
                                 "--allow-shared-memory",
                                 "--grpc-max-message-bytes", str(MAX_MESSAGE),
                                 "--grpc-response-compression", "gzip"])
    try:
        yield server.wait_ready()
    finally:
        server.stop()
        shutil.rmtree(repo, ignore_errors=True)


@pytest.fixture(scope="module")
def gc(srv: Server) -> Iterator[tg.InferenceServerClient]:
    c = tg.InferenceServerClient(srv.grpc_url)
    yield c
    c.close()


def linear_input(x: np.ndarray = X) -> tg.InferInput:
    return tg.InferInput("input", list(x.shape), "FP32").set_data_from_numpy(x)


def code_of(exc: InferenceServerException) -> str:
    return str(exc.status()).removeprefix("StatusCode.")


def rejected(srv: Server, reason: str) -> float:
    _, _, body = http("GET", srv.url + "/metrics")
    found = re.findall(rf'zeroserve_requests_rejected_total\{{[^}}]*reason="{reason}"'
                       r'[^}]*\} ([0-9.e+]+)', body.decode())
    return sum(float(v) for v in found)


def test_system_shared_memory_in_and_out(gc: tg.InferenceServerClient) -> None:
    want = gc.infer("linear", [linear_input()]).as_numpy("output")
    keys = {"in": "/zs_grpc_in", "out": "/zs_grpc_out"}
    handles = {k: shm.create_shared_memory_region(f"zs_{k}", key, 256)
               for k, key in keys.items()}
    try:
        shm.set_shared_memory_region(handles["in"], [X])
        for k, key in keys.items():
            gc.register_system_shared_memory(f"zs_{k}", key, 256)
        status = gc.get_system_shared_memory_status(as_json=True)["regions"]
        assert status["zs_in"]["key"] == keys["in"] and int(status["zs_in"]["byte_size"]) == 256
        inp = tg.InferInput("input", [2, 4], "FP32")
        inp.set_shared_memory("zs_in", X.nbytes)
        out = tg.InferRequestedOutput("output")
        out.set_shared_memory("zs_out", 256)
        result = gc.infer("linear", [inp], outputs=[out])
        assert result.get_response().raw_output_contents == [b""]
        placed = result.get_output("output")
        assert placed.parameters["shared_memory_region"].string_param == "zs_out"
        got = shm.get_contents_as_numpy(handles["out"], np.float32, [2, 3])
        np.testing.assert_allclose(got, want, rtol=1e-6)
        gc.unregister_system_shared_memory("zs_in")
        assert set(gc.get_system_shared_memory_status(as_json=True)["regions"]) == {"zs_out"}
        with pytest.raises(InferenceServerException) as err:
            gc.infer("linear", [inp])
        assert code_of(err.value) == "INVALID_ARGUMENT" and "zs_in" in err.value.message()
    finally:
        gc.unregister_system_shared_memory()
        for h in handles.values():
            shm.destroy_shared_memory_region(h)
    assert gc.get_system_shared_memory_status(as_json=True).get("regions", {}) == {}


def test_answers_are_compressed_with_the_servers_algorithm(srv: Server) -> None:
    """--grpc-response-compression gzip: 2 rows of zeros (512 KiB of FP32) reach
    tritonclient, unchanged, in a few KiB on the wire."""
    relay = Relay(srv.grpc_port)
    client = tg.InferenceServerClient(f"127.0.0.1:{relay.port}")
    try:
        got = client.infer("zeros", [linear_input()]).as_numpy("output")
        assert got.shape == (2, ZEROS) and not got.any()
        plain = got.nbytes
    finally:
        client.close()
        relay.close()
    wait_for(lambda: relay.from_server > 0, 10, "the relay to count the answer")
    assert relay.from_server < plain / 20, (relay.from_server, plain)


def test_cuda_shared_memory_without_a_gpu(gc: tg.InferenceServerClient) -> None:
    assert gc.get_cuda_shared_memory_status(as_json=True).get("regions", {}) == {}
    gc.unregister_cuda_shared_memory()
    with pytest.raises(InferenceServerException) as err:
        gc.register_cuda_shared_memory("r", b"\0" * 64, 0, 64)
    assert code_of(err.value) == "INVALID_ARGUMENT" and "GPUs not supported" in \
        err.value.message()


def test_repository_load_and_unload(gc: tg.InferenceServerClient) -> None:
    def states() -> dict[str, str]:
        return {m.name: m.state for m in gc.get_model_repository_index().models}
    assert not gc.is_model_ready("other")
    gc.load_model("other")
    assert gc.is_model_ready("other") and states()["other"] == "READY"
    assert gc.infer("other", [linear_input()]).as_numpy("output").shape == (2, 3)
    gc.unload_model("other")
    wait_for(lambda: not gc.is_model_ready("other"), 20, "other to unload")
    with pytest.raises(InferenceServerException) as err:
        gc.load_model("never")
    assert code_of(err.value) in ("INVALID_ARGUMENT", "NOT_FOUND")


def test_a_cancelled_call_leaves_the_queue(srv: Server) -> None:
    async def run() -> None:
        async with tga.InferenceServerClient(srv.grpc_url) as c:
            x = np.ones((1, 4), np.float32)
            inp = tga.InferInput("input", [1, 4], "FP32")
            inp.set_data_from_numpy(x)
            first = asyncio.ensure_future(c.infer("slow", [inp]))
            await asyncio.sleep(0.3)   # noqa: sleep-ok (the first is on the worker by then)
            queued = asyncio.ensure_future(c.infer("slow", [inp]))
            await asyncio.sleep(0.2)   # noqa: sleep-ok (the second reached the broker's queue)
            queued.cancel()
            with pytest.raises(asyncio.CancelledError):
                await queued
            np.testing.assert_array_equal((await first).as_numpy("output"), x)
    before = rejected(srv, "cancelled")
    stats = tg.InferenceServerClient(srv.grpc_url)
    try:
        count = stats.get_inference_statistics("slow").model_stats[0].inference_count
        asyncio.run(run())
        wait_for(lambda: rejected(srv, "cancelled") > before, 10, "the withdrawal counted")
        assert stats.get_inference_statistics("slow").model_stats[0].inference_count \
            == count + 1   # the cancelled one never ran
    finally:
        stats.close()


def test_the_call_deadline_bounds_the_request(gc: tg.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException) as err:   # 0.3 s: the model takes 1 s
        gc.infer("slow", [tg.InferInput("input", [1, 4], "FP32").set_data_from_numpy(
            np.ones((1, 4), np.float32))], client_timeout=0.3)
    assert code_of(err.value) == "DEADLINE_EXCEEDED"
    with pytest.raises(InferenceServerException) as err:   # timeout: 1 µs, gone at the door
        gc.infer("linear", [linear_input()], timeout=1)
    assert code_of(err.value) == "DEADLINE_EXCEEDED"
    assert gc.is_server_ready()


def test_an_oversized_message_is_refused_and_serving_goes_on(
        gc: tg.InferenceServerClient) -> None:
    big = np.ones((MAX_MESSAGE // 16 + 8, 4), np.float32)
    assert big.nbytes > MAX_MESSAGE
    with pytest.raises(InferenceServerException) as err:
        gc.infer("linear", [linear_input(big)])
    assert code_of(err.value) == "RESOURCE_EXHAUSTED"
    assert gc.infer("linear", [linear_input()]).as_numpy("output").shape == (2, 3)


def test_a_taken_grpc_port_fails_the_start(srv: Server) -> None:
    out = subprocess.run([*ZEROSERVE, "gateway", "--runtime-dir", str(srv.runtime),
                          "--http-port", str(free_port()), "--grpc-port", str(srv.grpc_port)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert f"cannot listen for gRPC on 127.0.0.1:{srv.grpc_port}" in out.stderr


# -- tenants -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tenants() -> Iterator[tuple[Server, str, str]]:
    repo = short_tmpdir("zsrepo")
    for name in ("linear", "other"):
        write_model(repo, name, 1, "nn.Linear(4, 3)", linear_config(name))
    alice, alice_hash = new_key()
    bob, bob_hash = new_key()
    path = repo.parent / f"{repo.name}-tenants.toml"
    path.write_text(f'[tenants.alice]\nkeys = ["{alice_hash}"]\n\n'
                    f'[tenants.bob]\nkeys = ["{bob_hash}"]\nmodels = ["linear"]\n')
    server = Server(repo, extra=["--tenants", str(path)])
    try:
        yield server.wait_ready(), alice, bob
    finally:
        server.stop()
        shutil.rmtree(repo, ignore_errors=True)
        path.unlink(missing_ok=True)


def test_tenants_govern_grpc_calls(tenants: tuple[Server, str, str]) -> None:
    server, alice, bob = tenants
    c = tg.InferenceServerClient(server.grpc_url)
    try:
        with pytest.raises(InferenceServerException) as err:
            c.infer("linear", [linear_input()])
        assert code_of(err.value) == "UNAUTHENTICATED"
        with pytest.raises(InferenceServerException) as err:
            c.infer("linear", [linear_input()], headers={"authorization": "Bearer wrong"})
        assert code_of(err.value) == "UNAUTHENTICATED"
        for key in (alice, bob):
            got = c.infer("linear", [linear_input()],
                          headers={"authorization": f"Bearer {key}"})
            assert got.as_numpy("output").shape == (2, 3)
        with pytest.raises(InferenceServerException) as err:
            c.infer("other", [linear_input()], headers={"authorization": f"Bearer {bob}"})
        assert code_of(err.value) in ("PERMISSION_DENIED", "INVALID_ARGUMENT")
        assert c.infer("other", [linear_input()], headers={"x-api-key": alice}) \
            .as_numpy("output").shape == (2, 3)
        # the reads are scoped too: nothing without a key, only its models with one
        for read in (lambda h: c.get_model_metadata("linear", headers=h),
                     lambda h: c.get_model_config("linear", headers=h),
                     lambda h: c.get_inference_statistics(headers=h),
                     lambda h: c.get_model_repository_index(headers=h)):
            with pytest.raises(InferenceServerException) as err:
                read({})
            assert code_of(err.value) == "UNAUTHENTICATED"
        assert c.is_server_live() and c.is_server_ready()   # health needs no key
        as_bob = {"authorization": f"Bearer {bob}"}
        assert c.get_model_metadata("linear", headers=as_bob).name == "linear"
        with pytest.raises(InferenceServerException) as err:
            c.get_model_metadata("other", headers=as_bob)
        assert code_of(err.value) == "INVALID_ARGUMENT"   # as if it did not exist
        assert {m.name for m in c.get_model_repository_index(headers=as_bob).models} == \
            {"linear"}
    finally:
        c.close()
