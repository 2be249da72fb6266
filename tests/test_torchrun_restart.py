"""Lesson 3 (multi_gpu_torchrun.py): workers die, torchrun restarts them, training resumes from
the snapshot and ends exactly where an uninterrupted run ends. Real torchrun, 2 processes, gloo."""

import glob
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import (
    ROOT,
    assert_ok,
    cpu_env,
    error_lines,
    free_port,
    run,
    run_python,
    run_torchrun,
    run_torchrun_nodes,
    torchrun_cmd,
)

import multi_gpu_torchrun

SCRIPT = "multi_gpu_torchrun.py"
# 256 samples / 2 ranks / batch 16 = 8 steps per epoch, 3 epochs = 24 steps; a snapshot every
# 3 steps and at every epoch end. A wide model (~13 MB snapshots) so that a write takes long
# enough to be caught in the middle by the kill-while-writing test; every test shares this run.
RUN = [
    "--epochs",
    "3",
    "--samples",
    "256",
    "--batch-size",
    "16",
    "--hidden",
    "1024",
    "--save-every",
    "3",
]
TIMEOUT = 240


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def done_lines(result):
    return [line for line in result.stdout.splitlines() if line.startswith("done:")]


def assert_same_state(a, b):
    """Bitwise: the same weights and the same optimizer state (Adam moments, step counts)."""
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), f"weights differ: {k}"
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        for k in sa[i]:
            assert torch.equal(sa[i][k], sb[i][k]), f"optimizer state differs: {i}.{k}"


# Restarts for runs that must succeed: the kill tests need 1. The rest absorb a rare abort of a
# gloo worker at process exit *after* training finished and the last snapshot was written
# ("terminate called without an active exception", SIGABRT; a few in 100 runs on torch 2.14.1,
# with or without a kill). The extra attempt loads the finished snapshot, trains and saves
# nothing and prints a second done: line; the snapshot and its history are unchanged by it, and
# a real second restart would show in the history.
RESTARTS = ["--max-restarts=2"]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """An uninterrupted run: what every interrupted run must end with."""
    ckdir = tmp_path_factory.mktemp("baseline")
    r = run_torchrun(SCRIPT, *RUN, "--checkpoint-dir", ckdir, timeout=TIMEOUT, extra=RESTARTS)
    assert_ok(r)
    assert done_lines(r)
    # A second launch finds the job complete: nothing to train, the same state.
    snap = load(ckdir / "snapshot.pt")
    again = run_torchrun(SCRIPT, *RUN, "--checkpoint-dir", ckdir, timeout=TIMEOUT, extra=RESTARTS)
    assert_ok(again)
    assert "steps this attempt 0" in done_lines(again)[0]
    assert_same_state(load(ckdir / "snapshot.pt"), snap)
    return snap


def test_uninterrupted_run_learns(baseline):
    assert baseline["history"]["starts"] == [[0, 0, 2]]
    assert (baseline["epoch"], baseline["samples"], baseline["step"]) == (3, 0, 24)
    assert baseline["history"]["samples"] == [256, 256, 256]
    losses = baseline["history"]["losses"]
    assert len(losses) == 3 and losses[-1] < 0.5 * losses[0], losses


@pytest.mark.slow
def test_fail_at_step_restarts_and_matches_uninterrupted(tmp_path, baseline):
    r = run_torchrun(
        SCRIPT,
        *RUN,
        "--checkpoint-dir",
        tmp_path,
        "--fail-at-step",
        "11",
        timeout=TIMEOUT,
        extra=RESTARTS,
    )
    assert_ok(r)
    assert done_lines(r)
    snap = load(tmp_path / "snapshot.pt")
    # Attempt 0 started at step 0; rank 1 died after step 11; attempt 1 resumed at the last
    # snapshot before that, step 9 (saves every 3 steps) - not from scratch.
    assert snap["history"]["starts"] == [[0, 0, 2], [1, 9, 2]]
    assert (tmp_path / "snapshot.pt.failed").exists()
    assert_same_state(snap, baseline)


def proc_children(pid):
    """Pids whose parent is pid (read from /proc, no psutil)."""
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                kids.append(int(entry))
    return kids


def worker_pid(agent_pid, rank, restart=0):
    """The pid of the torchrun worker with this RANK in this attempt (torchrun starts workers as
    its direct children and passes RANK / TORCHELASTIC_RESTART_COUNT in their environment)."""
    for pid in proc_children(agent_pid):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if (
            env.get(b"RANK") == str(rank).encode()
            and env.get(b"TORCHELASTIC_RESTART_COUNT") == str(restart).encode()
        ):
            return pid
    return None


def start_torchrun(*args, extra=()):
    return subprocess.Popen(
        [str(c) for c in torchrun_cmd(SCRIPT, *args, extra=extra)],
        env=cpu_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def finish(proc, timeout=TIMEOUT):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"timed out\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-3000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def wait_for(condition, proc, timeout=TIMEOUT, poll=0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if proc.poll() is not None:
            r = finish(proc)
            pytest.fail(
                f"the run ended (exit {r.returncode}) before the kill\n{r.stdout[-2000:]}"
                f"\n{r.stderr[-2000:]}"
            )
        time.sleep(poll)
    finish(proc, timeout=1)
    pytest.fail("condition not reached in time")


@pytest.mark.slow
def test_kill_mid_write_then_kill_9_each_restart_and_match_uninterrupted(tmp_path, baseline):
    """One job, two deaths. 1) Freeze rank 0 (the writer) while its temp file exists, i.e.
    mid-write, check the snapshot on disk is still the previous, loadable one, then SIGKILL the
    writer: the restarted job resumes from that snapshot. 2) Once the restarted job has saved a
    snapshot of its own, SIGKILL rank 1 from outside: it resumes again, from that snapshot, not
    from scratch. It must end like an uninterrupted run."""
    path = tmp_path / "snapshot.pt"
    # --step-delay only slows the loop (0.1 s a step, ~2.5 s in all) so the kills land mid-run.
    proc = start_torchrun(
        *RUN, "--checkpoint-dir", tmp_path, "--step-delay", "0.1", extra=["--max-restarts=3"]
    )
    caught = None
    deadline = time.monotonic() + TIMEOUT
    writer = wait_for(lambda: worker_pid(proc.pid, rank=0), proc)
    while caught is None and time.monotonic() < deadline and proc.poll() is None:
        # save_checkpoint writes <path>.<random>.tmp, then renames it to <path>.
        temps = glob.glob(glob.escape(str(path)) + ".*.tmp") if path.exists() else []
        if not temps:
            time.sleep(0.001)
            continue
        os.kill(writer, signal.SIGSTOP)
        if os.path.exists(temps[0]):  # still writing (not yet renamed): caught mid-write
            caught = (writer, load(path)["step"], temps[0])
        else:
            os.kill(writer, signal.SIGCONT)
    assert caught, "never caught a snapshot write in progress"
    writer, step_on_disk, temp = caught
    os.kill(writer, signal.SIGKILL)

    def saved_by_attempt_1():
        try:
            snap = load(path)
        except Exception:  # being replaced
            return None
        return len(snap["history"]["starts"]) == 2 and snap["step"] > step_on_disk and snap["step"]

    seen = wait_for(saved_by_attempt_1, proc)
    victim = wait_for(lambda: worker_pid(proc.pid, rank=1, restart=1), proc)
    os.kill(victim, signal.SIGKILL)
    r = finish(proc)
    assert_ok(r)
    assert done_lines(r)
    snap = load(path)
    starts = snap["history"]["starts"]
    assert starts[:2] == [[0, 0, 2], [1, step_on_disk, 2]], starts
    assert len(starts) == 3 and starts[2][0] == 2 and seen <= starts[2][1] < 24, (seen, starts)
    # The restarted rank 0 removed the torn temp file.
    assert not glob.glob(glob.escape(str(path)) + ".*.tmp")
    assert_same_state(snap, baseline)


LOADED = {}  # path -> (mtime, snapshot): saved_by_attempt loads a file once per change


def saved_by_attempt(path, attempt, after_step):
    """The snapshot's step once the attempt-th launch or restart (1-based) saved one past
    after_step, else None. Loads the file only when it changed."""
    try:
        stamp = os.stat(path).st_mtime_ns
    except FileNotFoundError:
        return None
    if LOADED.get(path, (None,))[0] != stamp:
        try:
            LOADED[path] = (stamp, load(path))
        except Exception:  # being replaced
            return None
    snap = LOADED[path][1]
    if len(snap["history"]["starts"]) == attempt and snap["step"] > after_step:
        return snap["step"]
    return None


def preempted_step(result, name):
    """The step of the one `preempted: signal NAME | step S/T | snapshot P` line."""
    lines = [line for line in result.stdout.splitlines() if line.startswith("preempted:")]
    assert len(lines) == 1 and not done_lines(result), result.stdout[-3000:]
    match = re.match(rf"preempted: signal {name} \| step (\d+)/24 \| snapshot ", lines[0])
    assert match, lines
    return int(match.group(1))


@pytest.mark.slow
def test_no_restarts_fails_clearly_preemptions_save_and_relaunches_resume(tmp_path, baseline):
    """Four launches of one command, without restarts: a crash, a SIGUSR1 to the workers (what
    Slurm's --signal sends), a SIGTERM to torchrun (a spot instance reclaimed, `kill`), then a
    clean finish. Each launch resumes where the last left off; the end equals the uninterrupted
    run bitwise."""
    path = tmp_path / "snapshot.pt"
    # --stop-check-every 2: the ranks look for a stop signal every 2 steps (the default, 10, would
    # outlast this 24-step run); --step-delay: 0.1 s a step, so the signals land mid-run.
    command = [*RUN, "--checkpoint-dir", tmp_path, "--fail-at-step", "11"]
    command += ["--stop-check-every", "2", "--step-delay", "0.1"]
    no_restarts = ["--max-restarts=0"]
    r = run_torchrun(SCRIPT, *command, timeout=TIMEOUT, extra=no_restarts)
    assert r.returncode != 0
    assert not done_lines(r)
    # Who says it first is a race: rank 0 (it noticed the lost peer) or torchrun (it stopped rank
    # 0 first, and names the failed rank and its signal). One of them must, in one place.
    ours = any(line.startswith("error: rank 0 lost the other ranks") for line in error_lines(r))
    killed = re.search(r"rank\s*: 1 \(local_rank: 1\)\s+exitcode\s*: -9", r.stderr)
    assert ours or killed, r.stderr[-3000:]
    assert load(path)["step"] == 9  # the last snapshot survives the failed job

    # Launched again (the marker stops a second suicide); SIGUSR1 to both workers once this
    # launch has saved: each rank finishes its step, they agree on where to stop, rank 0 saves,
    # and every rank exits 128 + 10.
    proc = start_torchrun(*command, extra=no_restarts)
    wait_for(lambda: saved_by_attempt(path, 2, 9), proc)
    for rank in (0, 1):
        os.kill(worker_pid(proc.pid, rank), signal.SIGUSR1)
    r = finish(proc)
    assert r.returncode != 0
    assert re.search(r"exitcode\s*: 138", r.stderr), r.stderr[-3000:]
    first_stop = preempted_step(r, "SIGUSR1")
    assert 9 < first_stop < 24 and load(path)["step"] == first_stop

    # Again; SIGTERM to torchrun itself: it forwards the signal to its workers and waits
    # (--shutdown-timeout, 30 s by default) before it SIGKILLs them.
    proc = start_torchrun(*command, extra=no_restarts)
    wait_for(lambda: saved_by_attempt(path, 3, first_stop), proc)
    signalled = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    r = finish(proc)
    print(f"torchrun exited {time.monotonic() - signalled:.1f} s after its SIGTERM")
    assert r.returncode != 0
    second_stop = preempted_step(r, "SIGTERM")
    assert first_stop < second_stop < 24 and load(path)["step"] == second_stop

    # The same command once more: it resumes and ends where the uninterrupted run ends.
    r = run_torchrun(SCRIPT, *command, timeout=TIMEOUT, extra=no_restarts)
    assert_ok(r)
    snap = load(path)
    assert snap["history"]["starts"] == [
        [0, 0, 2],
        [0, 9, 2],
        [0, first_stop, 2],
        [0, second_stop, 2],
    ]
    assert snap["history"]["samples"] == [256, 256, 256]
    assert_same_state(snap, baseline)


@pytest.mark.parametrize(
    "args",
    [
        ["--save-every", "-1"],
        ["--epochs", "0"],
        ["--epochs", "three"],  # not a number
        ["3", "1"],  # the old positional TOTAL_EPOCHS SAVE_EVERY
        ["--batch-size", "0"],
        ["--fail-at-step", "-1"],
        ["--global-batch-size", "-64"],
        ["--stop-check-every", "0"],
        ["--preempt-signals", "SIGKILL"],  # cannot be caught
        ["--dropout", "1"],
    ],
)
def test_bad_arguments_one_error_line(args, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as e:
        multi_gpu_torchrun.parse_args(args)
    err = capsys.readouterr().err
    assert (
        e.value.code == 2
        and len([line for line in err.splitlines() if line.startswith("error: ")]) == 1
    ), err


def test_bad_argument_from_the_command_line_is_one_clean_line():
    r = run_python(SCRIPT, "--epochs", "0", timeout=TIMEOUT)
    assert r.returncode == 2
    assert len(error_lines(r)) == 1, r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("rank,lines", [("0", 1), ("1", 0)])
def test_bad_fail_rank_under_torchrun_one_error_line(rank, lines, capsys, monkeypatch):
    """Every torchrun worker parses the flags: rank 0 prints the mistake, the others exit."""
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as e:
        multi_gpu_torchrun.parse_args(["--fail-at-step", "3", "--fail-rank", "2"])
    err = capsys.readouterr().err
    assert (
        e.value.code == 2
        and len([line for line in err.splitlines() if line.startswith("error: ")]) == lines
    )


def test_snapshot_from_another_model_is_one_error_line(tmp_path, baseline):
    torch.save(baseline, tmp_path / "snapshot.pt")
    # One process with the variables torchrun would set: no agent needed to read the error.
    env = cpu_env(RANK=0, WORLD_SIZE=1, MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port())
    argv = [*RUN[:-4], "--hidden", "64", "--checkpoint-dir", tmp_path]
    r = run([sys.executable, ROOT / SCRIPT, *argv], timeout=TIMEOUT, env=env)
    assert r.returncode != 0
    assert error_lines(r) and all("does not match" in line for line in error_lines(r)), r.stderr[
        -3000:
    ]


def test_ranks_that_disagree_on_the_snapshot_stop_in_one_line(tmp_path, baseline):
    """Node-local disks (or a network file system caching 'no such file'): node 0 sees a
    snapshot, node 1 does not. Resuming on one and starting afresh on the other would hang in a
    collective; the ranks agree first, and stop with one line."""
    (tmp_path / "node0").mkdir()
    torch.save(baseline, tmp_path / "node0" / "snapshot.pt")
    nodes = [[*RUN, "--checkpoint-dir", tmp_path / f"node{node}"] for node in (0, 1)]
    results = run_torchrun_nodes(SCRIPT, nodes, timeout=TIMEOUT)
    errors = [line for r in results for line in error_lines(r)]
    assert all(r.returncode != 0 and not done_lines(r) for r in results), errors
    assert len(errors) == 1 and "is seen by 1 of 2 ranks" in errors[0], errors
