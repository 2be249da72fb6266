"""The test harness itself (conftest.py): a run that hangs is ended in full, however its
processes hid from the launcher's process group, and leaves nothing running. And the planted-bug
list (plant_bugs.py) still follows the code it plants in."""

import subprocess
import time

import plant_bugs
import pytest
from conftest import ROOT, run


def test_a_timed_out_run_kills_workers_in_sessions_of_their_own():
    """torchrun starts its workers in sessions of their own: killing the launcher's group is not
    enough, and a worker still holding the output pipes would keep the test waiting."""
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match="timed out after 2s"):
        run(["bash", "-c", "setsid sleep 31.4159 & sleep 100"], timeout=2)
    assert time.monotonic() - start < 12
    left = subprocess.run(["pgrep", "-f", "sleep 31.4159"], capture_output=True, text=True)
    assert left.stdout.strip() == "", "a worker outlived its timed-out run"


def test_every_planted_bug_names_a_line_and_tests_that_exist():
    """python tests/plant_bugs.py takes minutes a bug, so CI does not run it; but a planted line
    that an edit changed (STALE there) or a catching test renamed would go unseen until then."""
    wrong = []
    for name, file, original, _, tests in plant_bugs.BUGS:
        if (ROOT / file).read_text().count(original) != 1:
            wrong.append(f"{name}: the line is not in {file} exactly once: {original!r}")
        for test in tests:
            path, function = test.split("::")
            if f"def {function.split('[')[0]}(" not in (ROOT / path).read_text():
                wrong.append(f"{name}: no {test}")
    assert not wrong, "\n".join(wrong)
