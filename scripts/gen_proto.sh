#!/usr/bin/env bash
# Regenerate the committed protobuf/gRPC code from proto/kvproto/v1/kvstore.proto and
# proto/kvproto/v1/gpu.proto.
#
# This script is the only way kvstore_pb2.py, kvstore_pb2.pyi and kvstore_pb2_grpc.py
# (and gpu_pb2.py, gpu_pb2.pyi, gpu_pb2_grpc.py) are made; tests/test_proto_drift.py
# runs it into a temp dir and fails when the committed files differ. Compiled with `-I proto`, so generated imports read
# `from kvproto.v1 import kvstore_pb2`.
#
# usage: scripts/gen_proto.sh [OUT_ROOT]   (default: proto, i.e. in place)
# PYTHON selects the interpreter (default: the repo's .venv, else python3); it needs
# grpcio-tools.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-$repo/proto}"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$repo/.venv/bin/python" ]]; then PYTHON="$repo/.venv/bin/python"; else PYTHON=python3; fi
fi

mkdir -p "$out/kvproto/v1"
cd "$repo"
"$PYTHON" -m grpc_tools.protoc \
    -I proto \
    --python_out="$out" \
    --pyi_out="$out" \
    --grpc_python_out="$out" \
    proto/kvproto/v1/kvstore.proto \
    proto/kvproto/v1/gpu.proto
