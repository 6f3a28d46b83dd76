"""`reach up` refuses a dev-server database another running stack holds (two dev servers on
one SQLite file corrupt each other: nothing refused the second), and a stack killed outright
leaves nothing that blocks the next one."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import pytest

from gateway_api.devserver import database_lock
from tests.helpers import wait_until
from tests.integration.test_up import Up, processes_mentioning, up_env

pytestmark = pytest.mark.integration


class Stack(Up):
    """`reach up --no-demo` in its own process, its output in a file of `tmp`."""

    def __init__(self, tmp: Path, env: dict[str, str]) -> None:
        super().__init__(tmp, env, "--no-demo", name="up-shared")

    async def answers(self) -> bool:
        url = f"http://127.0.0.1:{self.env['REACH_LISTEN_PORT']}/reach/capabilities"
        async with httpx.AsyncClient(trust_env=False, timeout=10) as http:
            return (await http.get(url)).status_code == 200


async def test_a_second_stack_on_the_same_database_is_refused_and_a_killed_ones_is_not(
    tmp_path: Path,
) -> None:
    db = tmp_path / "state" / "temporal.db"
    first = Stack(tmp_path, up_env(tmp_path))
    try:
        await first.ready()
        # Every port moved (up_env hands out free ones), the database left as it was.
        second = Stack(tmp_path, up_env(tmp_path))
        try:

            async def refused() -> bool:  # it ran beside the first, on its database
                return second.proc.poll() is not None or "Agent-Reach is up." in second.output()

            await wait_until(refused, 60, every_s=0.2)
        finally:
            if second.proc.poll() is None:
                await second.ended(signal.SIGINT)
        said = second.output()
        assert second.proc.returncode == 1, said
        assert f"the Temporal dev server database {db} is in use by another running stack" in said
        assert f"(pid {first.proc.pid})" in said
        assert "REACH_TEMPORAL__DEV_SERVER__DB_FILENAME" in said
        assert "starting Temporal dev server" not in said  # refused before it started one
        assert "Traceback" not in said
        assert await first.answers()
        # Killed outright: its lock file stays, its lock goes with it and its dev server.
        assert await first.ended(signal.SIGKILL) == -signal.SIGKILL

        async def server_gone() -> bool:
            return processes_mentioning(str(db)) == []

        await wait_until(server_gone, 30)
        assert database_lock(str(db)).exists()
        third = Stack(tmp_path, up_env(tmp_path))
        try:
            await third.ready()
            assert await third.answers()
        finally:
            assert await third.ended(signal.SIGINT) == 0, third.output()
    finally:
        if first.proc.poll() is None:
            await first.ended(signal.SIGINT)
    assert processes_mentioning(str(db)) == []
