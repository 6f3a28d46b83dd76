"""A reader that stops early (`reach requests | head`) ends the command quietly, with the
status SIGPIPE gives in the shell: it said `error: [Errno 32] Broken pipe` and exited 1."""

from __future__ import annotations

import os
import subprocess
import sys

from gateway_api.cli import EXIT_BROKEN_PIPE
from tests.helpers import ROOT


def test_output_nobody_reads_ends_quietly() -> None:
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line: every write is EPIPE
    try:
        done = subprocess.run(
            [sys.executable, "-m", "gateway_api", "config", "check"],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            cwd=ROOT,
            env={**os.environ, "REACH_CONFIG": str(ROOT / "reach.yaml")},
        )
    finally:
        os.close(write)
    assert done.stderr == ""
    assert done.returncode == EXIT_BROKEN_PIPE


def test_output_that_is_read_is_unchanged() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "gateway_api", "config", "check"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "REACH_CONFIG": str(ROOT / "reach.yaml")},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("OK: ")
