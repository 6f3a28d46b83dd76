"""The dev server's database is one stack's at a time (`devserver.hold_database`): two dev
servers on one SQLite file corrupt each other, and nothing refused the second."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gateway_api.devserver import DB_SETTING, DatabaseInUse, database_lock, hold_database


def test_a_held_database_is_refused_naming_the_file_the_holder_and_the_setting(
    tmp_path: Path,
) -> None:
    db = str(tmp_path / "state" / "temporal.db")
    first = hold_database(db)
    try:
        with pytest.raises(DatabaseInUse) as refused:
            hold_database(db)
        said = str(refused.value)
        assert f"database {db} is in use by another running stack (pid {os.getpid()})" in said
        assert DB_SETTING in said
        assert "REACH_TEMPORAL__DEV_SERVER__DB_FILENAME" in said
    finally:
        os.close(first)
    os.close(hold_database(db))  # let go: anyone's again


def test_a_killed_holders_lock_file_does_not_block(tmp_path: Path) -> None:
    """A stack SIGKILLed leaves its lock file behind; the lock goes with the process."""
    db = str(tmp_path / "temporal.db")
    code = (
        "import sys, time; from gateway_api.devserver import hold_database; "
        f"hold_database({db!r}); print('held', flush=True); time.sleep(600)"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=os.getcwd()
    )
    assert holder.stdout is not None
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(DatabaseInUse, match=f"pid {holder.pid}"):
            hold_database(db)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(30)
        holder.stdout.close()
    assert database_lock(db).exists()  # stale, and no obstacle
    deadline = time.monotonic() + 10
    while True:
        try:
            os.close(hold_database(db))
            break
        except DatabaseInUse:
            assert time.monotonic() < deadline, "the dead holder's lock was never released"
            time.sleep(0.05)


def test_a_symlink_to_a_held_database_is_refused(tmp_path: Path) -> None:
    """The lock is named from the database's real path: a second stack given a symlink to the
    first one's database would otherwise take a lock of its own beside it."""
    db = str(tmp_path / "temporal.db")
    link = tmp_path / "alias.db"
    link.symlink_to(db)
    first = hold_database(db)
    try:
        with pytest.raises(DatabaseInUse, match="in use by another running stack"):
            hold_database(str(link))
    finally:
        os.close(first)
