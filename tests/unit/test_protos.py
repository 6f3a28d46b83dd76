"""The committed protobuf modules are what `make proto` makes of the committed .proto files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from agent_reach_proto import agent_pb2, gateway_pb2

ROOT = Path(__file__).resolve().parents[2]


def test_generated_modules_are_up_to_date(tmp_path: Path) -> None:
    subprocess.run(
        ["bash", str(ROOT / "protos" / "generate.sh"), str(tmp_path)],
        check=True,
        env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
    )
    for name in ("agent_pb2.py", "agent_pb2.pyi", "gateway_pb2.py", "gateway_pb2.pyi"):
        fresh = (tmp_path / "agent_reach_proto" / name).read_text()
        committed = (ROOT / "agent_reach_proto" / name).read_text()
        assert fresh == committed, f"agent_reach_proto/{name} is stale: run `make proto`"


def test_the_services_have_their_wire_names() -> None:
    assert agent_pb2.DESCRIPTOR.services_by_name["Agent"].full_name == "reach.agent.v1.Agent"
    front = gateway_pb2.DESCRIPTOR.services_by_name["Reach"]
    assert front.full_name == "reach.v1.Reach"
    assert [m.name for m in front.methods] == ["Invoke", "Join", "Heartbeat"]
