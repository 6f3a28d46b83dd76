"""`reach.process.settle_heap`: what a started gateway or worker does to its collector."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# In a child process: freezing the test runner's own heap would outlive this test.
PROBE = """
import gc
from reach.process import GC_THRESHOLD, settle_heap

before = gc.get_freeze_count()
settle_heap()
print(before, gc.get_freeze_count(), gc.get_threshold() == GC_THRESHOLD)
"""


def test_settle_heap_freezes_what_start_up_built_and_collects_less_often() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    before, after, threshold_set = out.stdout.split()
    assert before == "0"
    assert int(after) > 1000  # the modules, settings and clients start-up loaded
    assert threshold_set == "True"
