"""The test harness itself (conftest.py): a run that hangs is ended in full, however its
processes hid from the launcher's process group, and leaves nothing running."""

import subprocess
import time

import pytest
from conftest import run


def test_a_timed_out_run_kills_workers_in_sessions_of_their_own():
    """torchrun starts its workers in sessions of their own: killing the launcher's group is not
    enough, and a worker still holding the output pipes would keep the test waiting."""
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match="timed out after 2s"):
        run(["bash", "-c", "setsid sleep 31.4159 & sleep 100"], timeout=2)
    assert time.monotonic() - start < 12
    left = subprocess.run(["pgrep", "-f", "sleep 31.4159"], capture_output=True, text=True)
    assert left.stdout.strip() == "", "a worker outlived its timed-out run"
