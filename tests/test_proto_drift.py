"""The committed generated code must be what scripts/gen_proto.sh makes from the .proto.

Two checks:
1. Always: the descriptor compiled from proto/kvproto/v1/kvstore.proto (and gpu.proto)
   now equals the one embedded in the committed kvstore_pb2.py (gpu_pb2.py) (catches a
   .proto edited without regenerating, whatever grpcio-tools version is installed).
2. When the installed grpcio-tools is the version that made the committed files: the
   script's output into a temp dir is byte-for-byte the committed files (catches
   hand edits and a forgotten .pyi or _grpc.py). With another version the generated
   text legitimately differs (version stamps), so this check is skipped.
A failure means: run ``scripts/gen_proto.sh`` and commit its output.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

REPO = Path(__file__).resolve().parent.parent
GEN_DIR = REPO / "proto" / "kvproto" / "v1"
GENERATED = ("kvstore_pb2.py", "kvstore_pb2.pyi", "kvstore_pb2_grpc.py") + (
    "gpu_pb2.py", "gpu_pb2.pyi", "gpu_pb2_grpc.py"
)

grpc_tools = pytest.importorskip("grpc_tools", reason="grpcio-tools is needed to regenerate")


def _committed_grpc_version() -> str:
    text = (GEN_DIR / "kvstore_pb2_grpc.py").read_text()
    match = re.search(r"GRPC_GENERATED_VERSION = '([^']+)'", text)
    assert match, "kvstore_pb2_grpc.py has no GRPC_GENERATED_VERSION"
    return match.group(1)


def _without_json_names(file: descriptor_pb2.FileDescriptorProto) -> None:
    """protoc fills json_name in descriptor sets, not in the embedded descriptor."""
    pending = list(file.message_type)
    while pending:
        message = pending.pop()
        for field in message.field:
            field.ClearField("json_name")
        pending.extend(message.nested_type)


@pytest.mark.parametrize("name", ["kvstore", "gpu"])
def test_committed_descriptor_matches_the_proto(tmp_path: Path, name: str) -> None:
    import importlib

    module = importlib.import_module(f"kvproto.v1.{name}_pb2")
    out = tmp_path / f"{name}.pb"
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I", "proto", f"--descriptor_set_out={out}",
         f"proto/kvproto/v1/{name}.proto"],
        cwd=REPO, check=True, capture_output=True, timeout=120,
    )
    (fresh,) = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file
    committed = descriptor_pb2.FileDescriptorProto.FromString(module.DESCRIPTOR.serialized_pb)
    _without_json_names(fresh)
    assert fresh == committed, f"{name}.proto changed: run scripts/gen_proto.sh"


def test_generated_files_are_byte_exact(tmp_path: Path) -> None:
    from grpc_tools import grpc_version

    if _committed_grpc_version() != grpc_version.VERSION:
        pytest.skip(
            f"grpcio-tools {grpc_version.VERSION} installed; the committed files were made "
            f"by {_committed_grpc_version()}"
        )
    subprocess.run(
        ["bash", str(REPO / "scripts" / "gen_proto.sh"), str(tmp_path)],
        check=True,
        capture_output=True,
        env={**os.environ, "PYTHON": sys.executable},
        timeout=120,
    )
    stale = [
        name
        for name in GENERATED
        if (tmp_path / "kvproto" / "v1" / name).read_bytes() != (GEN_DIR / name).read_bytes()
    ]
    assert not stale, f"{stale} differ from their .proto: run scripts/gen_proto.sh"
