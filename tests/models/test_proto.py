"""The vendored protos: the checked-in modules are what the pinned generator makes of
the .proto files, and they load beside tritonclient.grpc in one process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

PROTO = ROOT / "models" / "proto"


def test_checked_in_modules_are_what_the_generator_makes(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    from zeroserve.models.proto import generate

    written = generate.generate(tmp_path)
    assert [p.name for p in written] == ["model_config_pb2.py", "grpc_service_pb2.py",
                                         "health_pb2.py"]
    for fresh in written:
        assert fresh.read_text() == (PROTO / fresh.name).read_text(), \
            f"{fresh.name} differs: run python -m zeroserve.models.proto.generate"


def test_the_rewrite_leaves_no_default_pool_and_no_absolute_sibling_import() -> None:
    for module in ("grpc_service_pb2.py", "model_config_pb2.py", "health_pb2.py"):
        text = (PROTO / module).read_text()
        assert "Default().AddSerializedFile" not in text
        assert "_POOL.AddSerializedFile" in text
        assert "\nimport model_config_pb2" not in text


def run_fresh(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True,
                          text=True, timeout=60, cwd="/")


@pytest.mark.parametrize("order", ["ours first", "tritonclient first"])
def test_loads_beside_tritonclient_grpc_in_one_process(order: str) -> None:
    ours = "from zeroserve.models.proto import grpc_service_pb2, health_pb2\n"
    theirs = "import tritonclient.grpc, tritonclient.grpc.aio\n"
    code = (ours + theirs if order == "ours first" else theirs + ours) + (
        "from tritonclient.grpc import service_pb2\n"
        "req = grpc_service_pb2.ModelInferRequest(model_name='m', id='7')\n"
        "req.parameters['priority'].uint64_param = 2\n"
        "back = service_pb2.ModelInferRequest.FromString(req.SerializeToString())\n"
        "assert back.parameters['priority'].uint64_param == 2 and back.id == '7'\n"
        "assert type(back) is not grpc_service_pb2.ModelInferRequest\n")
    out = run_fresh(code)
    assert out.returncode == 0, out.stderr


def test_our_files_stay_out_of_the_default_pool() -> None:
    out = run_fresh(
        "from google.protobuf import descriptor_pool\n"
        "from zeroserve.models.proto import POOL, grpc_service_pb2, model_config_pb2\n"
        "assert grpc_service_pb2.DESCRIPTOR.pool is POOL\n"
        "assert model_config_pb2.DESCRIPTOR.pool is POOL\n"
        "try:\n"
        "    descriptor_pool.Default().FindFileByName('grpc_service.proto')\n"
        "except KeyError:\n"
        "    print('absent')\n")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "absent"


def test_the_same_messages_in_the_default_pool_would_collide() -> None:
    """What the private pool avoids: tritonclient's file and another file defining the
    same messages in one pool fail at once (so the tests above can fail)."""
    out = run_fresh(
        "import tritonclient.grpc\n"
        "from google.protobuf import descriptor_pb2, descriptor_pool\n"
        "from zeroserve.models.proto import grpc_service_pb2\n"
        "fd = descriptor_pb2.FileDescriptorProto()\n"
        "grpc_service_pb2.DESCRIPTOR.CopyToProto(fd)\n"
        "fd.name = 'zeroserve/grpc_service.proto'\n"
        "descriptor_pool.Default().AddSerializedFile(fd.SerializeToString())\n")
    assert out.returncode != 0
    assert "duplicate" in out.stderr.lower()


def test_a_triton_config_pbtxt_parses_into_model_config() -> None:
    from google.protobuf import text_format
    from zeroserve.models.proto import model_config_pb2

    config = text_format.Parse(
        'name: "m" platform: "pytorch_libtorch" max_batch_size: 8 '
        'input { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 3 ] } '
        'dynamic_batching { max_queue_delay_microseconds: 100 }',
        model_config_pb2.ModelConfig())
    assert config.input[0].data_type == model_config_pb2.TYPE_FP32
    assert list(config.input[0].dims) == [3]
    assert config.dynamic_batching.max_queue_delay_microseconds == 100
