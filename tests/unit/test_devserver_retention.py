"""The dev server's retention update is tried again while the server is not serving its
namespace yet: on a busy box the port opens first, and the first `temporal operator namespace
update` exits 1 (the test session's server and `reach up` then failed to start)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway_api import devserver
from gateway_api.devserver import DevServer


class Refusing(DevServer):
    """A dev server whose retention command fails its first `refusals` runs (a real process,
    `sh`, standing in for the `temporal` CLI)."""

    def __init__(self, tmp: Path, refusals: int) -> None:
        super().__init__(str(tmp / "t.db"), 1, None)
        self.count = tmp / "runs"
        self.refusals = refusals

    def retention_command(self, hours: float) -> list[str]:
        script = (
            f'echo x >> "{self.count}"; '
            f'[ "$(wc -l < "{self.count}")" -gt {self.refusals} ] || '
            "{ echo 'namespace default not found' >&2; exit 1; }"
        )
        return ["sh", "-c", script]

    def runs(self) -> int:
        return len(self.count.read_text().splitlines())


def test_a_refused_retention_update_is_tried_again(tmp_path: Path) -> None:
    server = Refusing(tmp_path, refusals=2)
    server.set_retention(48)
    assert server.runs() == 3


async def test_a_refused_retention_update_is_tried_again_async(tmp_path: Path) -> None:
    server = Refusing(tmp_path, refusals=2)
    await server.set_retention_async(48)
    assert server.runs() == 3


def test_a_retention_update_refused_for_good_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(devserver, "RETENTION_WAIT_S", 0.5)
    server = Refusing(tmp_path, refusals=10**6)
    with pytest.raises(RuntimeError, match="namespace default not found"):
        server.set_retention(48)
    assert server.runs() >= 2
