"""Regenerate the ``*_pb2.py`` modules beside this file from the vendored ``.proto``
files: ``python -m zeroserve.models.proto.generate [DIR]`` (default: here).

protoc's output is changed in two places: the files go into this package's own
descriptor pool (see ``__init__.py``), and the import of ``model_config_pb2`` is made
relative, so the modules work inside the package. Needs the grpcio-tools version that
constraints.txt pins (its protoc writes the ``Protobuf Python Version`` line);
tests/models/test_proto.py regenerates and compares.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTOS = ("model_config.proto", "grpc_service.proto", "health.proto")
POOL_IMPORT = "from zeroserve.models.proto import POOL as _POOL\n"


def rewrite(source: str) -> str:
    """protoc's module, with the private pool and the relative sibling import."""
    out, n = re.subn(r"_descriptor_pool\.Default\(\)", "_POOL", source)
    if n != 1:
        raise RuntimeError(f"expected one use of the default pool, found {n}")
    out = out.replace("from google.protobuf import descriptor_pool as _descriptor_pool\n",
                      POOL_IMPORT, 1)
    out = re.sub(r"^import (\w+_pb2) as (\w+)$", r"from . import \1 as \2", out,
                 flags=re.MULTILINE)
    return out


def generate(target: Path) -> list[Path]:
    from grpc_tools import protoc   # only here: grpcio-tools is a test/dev dependency
    with tempfile.TemporaryDirectory() as tmp:
        rc = protoc.main(["protoc", f"-I{HERE}", f"--python_out={tmp}",
                          *(str(HERE / name) for name in PROTOS)])
        if rc != 0:
            raise RuntimeError(f"protoc failed ({rc})")
        written = []
        for name in PROTOS:
            module = name.replace(".proto", "_pb2.py")
            path = target / module
            path.write_text(rewrite((Path(tmp) / module).read_text()))
            written.append(path)
    return written


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE):
        print(path)
