#!/usr/bin/env bash
# Regenerate agent_reach_proto/ from protos/agent_reach_proto/*.proto (`make proto`).
# The generated modules are committed, so installing Agent-Reach needs no protoc; a unit test
# fails when they are out of date.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-.}"
"${PYTHON:-.venv/bin/python}" -m grpc_tools.protoc -I protos \
  --python_out="$out" --pyi_out="$out" protos/agent_reach_proto/*.proto
