"""The short `make reliability` inside `make test`: ~150 mixed requests through a stack of its
own while every kind of fault is done once (shorter outages than the full run); every
invariant of tests/reliability/ledger.py must hold. The full run is `make reliability`."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.reliability.run import Options, run

pytestmark = pytest.mark.integration


async def test_short_reliability_run_keeps_every_invariant(tmp_path: Path) -> None:
    code = await run(Options(requests=150, rate=5.0, short=True, tmp=tmp_path))
    assert code == 0, (tmp_path / "report.md").read_text()
