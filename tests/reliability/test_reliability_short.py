"""The short `make reliability` inside `make test`: mixed requests (the SDK protocols and an MCP
server registered by URL) through a stack of its own while every kind of fault is done once, in
two steps of short outages, the load running until the last is back (~100 requests, ~25 s);
every invariant of tests/reliability/ledger.py must hold. The full run is `make reliability`."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.reliability.run import Options, run

pytestmark = pytest.mark.integration


async def test_short_reliability_run_keeps_every_invariant(tmp_path: Path) -> None:
    code = await run(Options(requests=200, rate=10.0, short=True, tmp=tmp_path))
    assert code == 0, (tmp_path / "report.md").read_text()
