"""Lesson 3 (multi_gpu_torchrun.py): workers die, torchrun restarts them, a preempted job stops
with a snapshot and exits 128 + the signal, and every run resumes from the snapshot and ends
exactly where an uninterrupted run ends, printing the same losses on the way. Real torchrun, 2
processes, gloo, where torchrun is what is tested (restarts, signals, exit codes); the
uninterrupted run and the runs that only read a snapshot run the lesson's main() in processes
forked with the variables torchrun sets (conftest.run_spawned: no agent, no import of torch in
each process). tests/restart_faults.py slows the steps down where a kill must land mid-run."""

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
    kill_tree,
    run_python,
    run_spawned,
    run_torchrun,
    torchrun_cmd,
)

import multi_gpu_torchrun

SCRIPT = "multi_gpu_torchrun.py"
SLOWED = "tests/restart_faults.py"
# 256 samples / a global batch of 32 (2 ranks x 16) = 8 steps an epoch, 3 epochs = 24 steps; a
# snapshot every 3 steps and at every epoch end, a log line (and a stop check) every 3 steps. A
# wide model (~13 MB snapshots) so that a write takes long enough to be caught in the middle.
RUN = ["--epochs", "3", "--samples", "256", "--batch-size", "16", "--hidden", "1024"]
RUN += ["--save-every", "3", "--log-every", "3"]
STEPS = 24
TIMEOUT = 240
SCHEMA = {"model", "optimizer", "step", "epoch", "global_batch", "world_size", "rng", "data"}


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def lines(output, keyword):
    return [line for line in output.splitlines() if line.startswith(keyword)]


def losses(output):
    """{step: loss} from the progress lines `epoch E/3 | step S/24 | loss L | ...`."""
    found = re.findall(r"^epoch \d+/\d+ \| step (\d+)/\d+ \| loss (\S+) \|", output, re.M)
    return {int(step): loss for step, loss in found}


def starts(output):
    """(restart, step) of every `start:` line: where each attempt began."""
    return [
        (int(restart), int(step))
        for step, restart in re.findall(
            r"^start: .*\| step (\d+)/\d+ \| restart (\d+)/", output, re.M
        )
    ]


def assert_same_state(a, b):
    """Bitwise: the same weights and the same optimizer state (AdamW's moments, step counts)."""
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), f"weights differ: {k}"
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        for k in sa[i]:
            assert torch.equal(sa[i][k], sb[i][k]), f"optimizer state differs: {i}.{k}"


def assert_same_losses(output, expected):
    """Every loss a resumed run prints is the one the uninterrupted run printed at that step."""
    printed = losses(output)
    assert printed, output[-2000:]
    differ = {s: (loss, expected.get(s)) for s, loss in printed.items() if loss != expected.get(s)}
    assert not differ, f"step: (printed, uninterrupted) {differ}"


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """An uninterrupted run: what every interrupted run must end with, and the losses it prints.
    Then the same command again, which finds the job complete: it trains and saves nothing."""
    ckdir = tmp_path_factory.mktemp("baseline")
    command = [*RUN, "--checkpoint-dir", ckdir]
    r, _ = run_spawned(SCRIPT, *command)
    assert_ok(r)
    assert lines(r.stdout, "done:") and starts(r.stdout)[0] == (0, 0), r.stdout[-2000:]
    snapshot = load(ckdir / "last.pt")
    again, _ = run_spawned(SCRIPT, *command)
    assert_ok(again)
    assert lines(again.stdout, "resumed:") and lines(again.stdout, "done:"), again.stdout
    assert not losses(again.stdout) and not lines(again.stdout, "saved:"), again.stdout
    assert_same_state(load(ckdir / "last.pt"), snapshot)
    return snapshot, losses(r.stdout)


def test_uninterrupted_run_learns_and_saves_the_schema(baseline):
    snapshot, printed = baseline
    assert snapshot.keys() == SCHEMA
    assert (snapshot["step"], snapshot["epoch"], snapshot["global_batch"]) == (STEPS, 3, 32)
    assert snapshot["world_size"] == 2 and len(snapshot["rng"]) == 2
    # Each rank a random stream of its own: dropout draws other masks on each rank.
    assert not torch.equal(snapshot["rng"][0]["cpu"], snapshot["rng"][1]["cpu"])
    # A fused optimizer on the CPU too: its settings travel in the snapshot, and a non-fused
    # snapshot resumed on a GPU would run non-fused there (docs/restarts.md).
    assert all(group["fused"] for group in snapshot["optimizer"]["param_groups"])
    assert sorted(printed) == list(range(3, STEPS + 1, 3))
    assert float(printed[STEPS]) < 0.5 * float(printed[3]), printed


def start_job(log, *args, extra=()):
    """A torchrun job of the slowed lesson in the background, its stdout and stderr to log, a
    file opened for appending (so that reading it does not move where the job writes)."""
    return subprocess.Popen(
        [str(c) for c in torchrun_cmd(SLOWED, *args, extra=extra)],
        cwd=ROOT,
        env=cpu_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def finish(proc, log, timeout=TIMEOUT):
    """Wait for the job; its exit code and output. Every process of it is gone after."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        pytest.fail(f"timed out\n{read(log)[-3000:]}")
    finally:
        kill_tree(proc.pid)
    return proc.returncode, read(log)


def read(log):
    log.seek(0)
    return log.read()


def wait_for(condition, proc, log, timeout=TIMEOUT, poll=0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if proc.poll() is not None:
            code, out = finish(proc, log)
            pytest.fail(f"the run ended (exit {code}) first\n{out[-3000:]}")
        time.sleep(poll)
    kill_tree(proc.pid)
    pytest.fail(f"condition not reached in time\n{read(log)[-3000:]}")


def worker_pid(agent_pid, rank, restart=0):
    """The pid of the torchrun worker with this RANK in this attempt (torchrun starts workers as
    its direct children and passes RANK / TORCHELASTIC_RESTART_COUNT in their environment)."""
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            if parent != agent_pid:
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except (OSError, IndexError, ValueError):
            continue
        if (
            env.get(b"RANK") == str(rank).encode()
            and env.get(b"TORCHELASTIC_RESTART_COUNT") == str(restart).encode()
        ):
            return int(entry)
    return None


SAVED = {}  # path -> (mtime, step): saved_step loads a file once per change


def saved_step(path):
    """The step of the snapshot at path (None if there is none yet): loaded when it changed."""
    try:
        stamp = os.stat(path).st_mtime_ns
        if SAVED.get(path, (None,))[0] != stamp:
            SAVED[path] = (stamp, load(path)["step"])
    except Exception:  # not there yet, or being replaced
        return None
    return SAVED[path][1]


def saved_after(path, step):
    """The snapshot's step once it is past step, else None."""
    saved = saved_step(path)
    return saved if saved is not None and saved > step else None


@pytest.mark.slow
def test_killed_three_ways_it_restarts_each_time_and_ends_as_if_never_interrupted(
    tmp_path, baseline
):
    """One job (0.1 s a step), three deaths, torchrun restarts it each time. 1) --fail-at-step
    11: rank 1 SIGKILLs itself; attempt 1 resumes at step 9, the last snapshot. 2) Rank 0, the
    writer, frozen while its temp file exists (mid-write): the snapshot on disk is still the
    previous one; SIGKILLed there, attempt 2 resumes from that one. 3) Once attempt 2 has saved,
    rank 1 SIGKILLed from outside: attempt 3 resumes from that save, not from scratch. The end:
    the uninterrupted run's weights and optimizer state, bit for bit, and its losses."""
    path = tmp_path / "last.pt"
    log = open(tmp_path / "job.log", "a+")
    command = [*RUN, "--checkpoint-dir", tmp_path, "--fail-at-step", "11", "--step-delay", "0.1"]
    proc = start_job(log, *command, extra=["--max-restarts=4"])
    writer = wait_for(lambda: worker_pid(proc.pid, rank=0, restart=1), proc, log)
    caught = None
    deadline = time.monotonic() + TIMEOUT
    while caught is None and time.monotonic() < deadline and proc.poll() is None:
        # save_checkpoint writes <path>.<random>.tmp, then renames it to <path>.
        temps = glob.glob(glob.escape(str(path)) + ".*.tmp")
        if not temps:
            time.sleep(0.001)
            continue
        os.kill(writer, signal.SIGSTOP)
        if os.path.exists(temps[0]):  # still writing (not yet renamed): caught mid-write
            caught = load(path)["step"]
        else:
            os.kill(writer, signal.SIGCONT)
    assert caught, "never caught a snapshot write in progress"
    os.kill(writer, signal.SIGKILL)
    seen = wait_for(lambda: saved_after(path, caught), proc, log)
    victim = wait_for(lambda: worker_pid(proc.pid, rank=1, restart=2), proc, log)
    os.kill(victim, signal.SIGKILL)
    code, out = finish(proc, log)
    assert code == 0, out[-3000:]
    assert "fail: rank 1 | step 11 | SIGKILL (--fail-at-step)" in out
    attempts = starts(out)
    assert attempts[:3] == [(0, 0), (1, 9), (2, caught)], attempts
    assert len(attempts) == 4 and attempts[3][0] == 3 and seen <= attempts[3][1] < STEPS, attempts
    snapshot, printed = baseline
    assert_same_state(load(path), snapshot)
    assert_same_losses(out, printed)


@pytest.mark.slow
def test_without_restarts_a_crash_fails_preemptions_save_and_relaunches_resume(tmp_path, baseline):
    """Four launches, no restarts: a crash, a SIGUSR1 to one worker (what Slurm's --signal sends
    every task), a SIGTERM to torchrun (a spot instance reclaimed, `kill`), then a clean finish
    (forked ranks: conftest.run_spawned).
    Each launch resumes where the last one stopped; the end equals the uninterrupted run bitwise
    and every loss printed on the way equals the uninterrupted run's."""
    path = tmp_path / "last.pt"
    command = [*RUN, "--checkpoint-dir", tmp_path]
    no_restarts = ["--max-restarts=0"]
    r = run_torchrun(SCRIPT, *command, "--fail-at-step", "11", timeout=TIMEOUT, extra=no_restarts)
    assert r.returncode != 0 and not lines(r.stdout, "done:")
    # torchrun names the rank that died and how.
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)\s+exitcode\s*: -9", r.stderr), r.stderr[-3000:]
    assert load(path)["step"] == 9  # the last snapshot survives the failed job
    outputs = [r.stdout]

    # 0.1 s a step from here on. As soon as a launch has resumed, a stop signal: the ranks finish
    # their step, agree at the next check where to stop, save, and exit 128 + the signal.
    stops = [9]
    for name in ("SIGUSR1", "SIGTERM"):
        log = open(tmp_path / f"{name}.log", "a+")
        proc = start_job(log, *command, "--step-delay", "0.1", extra=no_restarts)
        wait_for(lambda log=log: lines(read(log), "resumed:"), proc, log)
        if name == "SIGUSR1":
            # To rank 1 alone: rank 0 learns of it at the next check, and both stop there.
            os.kill(worker_pid(proc.pid, 1), signal.SIGUSR1)
        else:
            # torchrun passes SIGTERM on to its workers and waits for them (30 s by default).
            os.kill(proc.pid, signal.SIGTERM)
        code, out = finish(proc, log)
        assert code != 0 and not lines(out, "done:"), out[-3000:]
        if name == "SIGUSR1":
            # Both workers exited 128 + 10; torchrun reports it.
            assert re.search(r"exitcode\s*: 138", out), out[-3000:]
        (stopped,) = lines(out, "preempted:")
        step = int(
            re.match(rf"preempted: signal {name} \| step (\d+)/{STEPS} \| snapshot ", stopped)[1]
        )
        assert stops[-1] < step < STEPS and load(path)["step"] == step, (stops, stopped)
        assert starts(out) == [(0, stops[-1])], out[-3000:]
        stops.append(step)
        outputs.append(out)

    # The last launch only resumes and finishes: the lesson's ranks without the agent.
    r, _ = run_spawned(SCRIPT, *command)
    assert_ok(r)
    assert starts(r.stdout) == [(0, stops[-1])]
    snapshot, printed = baseline
    assert_same_state(load(path), snapshot)
    assert_same_losses("\n".join(outputs + [r.stdout]), printed)


@pytest.mark.parametrize(
    "args",
    [
        ["--epochs", "0"],
        ["--save-every", "-1"],
        ["--global-batch-size", "-64"],
        ["--dropout", "1"],
        ["3", "1"],  # the old positional TOTAL_EPOCHS SAVE_EVERY
    ],
)
def test_bad_arguments_one_error_line(args, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(sys, "argv", [SCRIPT, *args])
    with pytest.raises(SystemExit) as e:
        multi_gpu_torchrun.parse_args()
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert e.value.code == 2 and len(errors) == 1, errors


def test_bad_argument_from_the_command_line_is_one_clean_line():
    r = run_python(SCRIPT, "--epochs", "0", timeout=TIMEOUT)
    assert r.returncode == 2 and len(error_lines(r)) == 1, r.stderr
    assert "Traceback" not in r.stderr


def test_snapshot_from_another_model_is_one_error_line(tmp_path, baseline):
    torch.save(baseline[0], tmp_path / "last.pt")
    [r] = run_spawned(SCRIPT, *RUN, "--hidden", "64", "--checkpoint-dir", tmp_path, nproc=1)
    errors = error_lines(r)
    assert r.returncode == 1 and len(errors) == 1, r.stderr[-3000:]
    assert "cannot be used" in errors[0], errors


def test_ranks_that_disagree_on_the_snapshot_stop_in_one_line(tmp_path, baseline):
    """Node-local disks (or a network file system caching 'no such file'): node 0 sees a
    snapshot, node 1 does not. Resuming on one and starting afresh on the other would hang in a
    collective; the ranks compare what they found, and stop with one line."""
    (tmp_path / "node0").mkdir()
    torch.save(baseline[0], tmp_path / "node0" / "last.pt")
    nodes = [[*RUN, "--checkpoint-dir", tmp_path / f"node{node}"] for node in (0, 1)]
    results = run_spawned(SCRIPT, nodes=nodes)
    errors = [line for r in results for line in error_lines(r)]
    assert all(r.returncode != 0 and not lines(r.stdout, "done:") for r in results), errors
    assert len(errors) == 1 and "step by rank: [24, None]" in errors[0], errors
