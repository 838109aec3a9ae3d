#!/usr/bin/env bash
# Regenerate stg/trace/proto/*_pb2.py from the .proto files beside them.
# protoc 31.1 (grpcio-tools 1.75.x) emits gencode 6.31.1, which runs on protobuf 6.31.1 and newer,
# the same floor as mlc-chakra's own module.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(mktemp -d)
python3 -m venv "$venv"
"$venv/bin/pip" install -q 'grpcio-tools==1.75.1'
"$venv/bin/python" -m grpc_tools.protoc -I . --python_out=. --pyi_out=. stg/trace/proto/chakra_v004.proto stg/trace/proto/chakra_v001.proto
rm -rf "$venv"
