"""Lesson 8 (ddp_debug.py): each fault breaks the job, ends it within the short timeout with no
process left behind, and its diagnosis names the culprit rank and the line or the operation; each
fix runs, and Join's gradients are what it promises, computed here by hand."""

import os
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch
from conftest import ROOT, cpu_env, kill_tree, spawn, torchrun_cmd, torchrun_env

import ddp_common
import ddp_debug

SOURCE = (ROOT / "ddp_debug.py").read_text().splitlines()


def line_of(code):
    """The line number of the one line of ddp_debug.py that holds `code`."""
    found = [i + 1 for i, line in enumerate(SOURCE) if code in line]
    assert len(found) == 1, (code, found)
    return found[0]


def processes_with(token):
    """Processes whose environment carries token: what is left of one launch."""
    left = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if token.encode() in f.read():
                    left.append(int(entry))
        except OSError:
            continue
    return left


class Job:
    """A torchrun launch of the lesson, its output in a file, its processes tagged."""

    def __init__(self, tmp_path, *args, nproc=2, extra=(), env=None):
        self.token = f"DDP_DEBUG_TEST={uuid.uuid4().hex}"
        self.log = tmp_path / f"job-{self.token[-8:]}.log"
        name, value = self.token.split("=")
        environment = cpu_env(**{name: value}, **(env or {}))
        cmd = torchrun_cmd("ddp_debug.py", *args, nproc=nproc, extra=extra)
        self.start = time.monotonic()
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                [str(c) for c in cmd],
                cwd=tmp_path,
                env=environment,
                stdout=out,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )

    def output(self):
        return self.log.read_text()

    def wait_for(self, pattern, timeout=120):
        """Wait until the output matches pattern (the job got that far)."""
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.output(), re.M):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"never printed {pattern!r}:\n{self.output()[-3000:]}")
            time.sleep(0.5)

    def workers(self):
        return [pid for pid in processes_with(self.token) if pid != self.proc.pid]

    def end(self, timeout=150):
        """Wait for the job to end by itself; then no process of it may be left."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            pytest.fail(f"still running after {timeout}s:\n{self.output()[-3000:]}")
        seconds = time.monotonic() - self.start
        # torchrun has stopped its workers before it exits; give the kernel a moment to reap.
        time.sleep(1)
        left = processes_with(self.token)
        self.stop()
        assert not left, f"processes left behind: {left}"
        return code, seconds

    def stop(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        kill_tree(self.proc.pid, *processes_with(self.token))


def test_uneven_hangs_until_the_timeout_and_py_spy_shows_each_rank_s_line(tmp_path):
    """3 ranks; rank 2 has 3 batches, the others 8: ranks 0 and 1 wait in step 4's gradient
    all-reduce, rank 2 at the end-of-epoch barrier, until the 10 s timeout ends the job."""
    job = Job(tmp_path, "--fault", "uneven", "--timeout", "20", nproc=3)
    job.wait_for(r"^step 2/8")
    time.sleep(3)
    stacks = {}
    for pid in job.workers():
        dump = subprocess.run(
            ["py-spy", "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60
        )
        environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        rank = int(next(v for v in environ if v.startswith(b"RANK=")).split(b"=")[1])
        stacks[rank] = dump.stdout + dump.stderr
    code, seconds = job.end()
    assert code != 0 and seconds < 150
    backward = f"train (ddp_debug.py:{line_of('loss.backward()')})"
    barrier = f"train (ddp_debug.py:{line_of('    dist.barrier()')})"
    assert sorted(stacks) == [0, 1, 2], stacks
    assert backward in stacks[0] and backward in stacks[1], stacks
    assert barrier in stacks[2], stacks[2]
    assert "Timed out waiting 20000ms" in job.output()


def test_the_readme_names_the_lines_py_spy_shows():
    """The stacks the README shows, and its prose, point at the lines of ddp_debug.py as it is."""
    readme = (ROOT / "README.md").read_text()
    backward = line_of("loss.backward()")
    barrier = line_of("    dist.barrier()")
    assert f"train (ddp_debug.py:{backward})" in readme
    assert f"train (ddp_debug.py:{barrier})" in readme
    assert f"Line {backward} is `loss.backward()`, line {barrier} the end-of-epoch" in readme
    # The fault handler's stack (mismatch) and torchrun's summary (crash).
    assert f'ddp_debug.py", line {line_of("            dist.all_reduce(mean)")} in log' in readme
    assert f'ddp_debug.py", line {line_of("    log(loss, step, args, ddp)")} in train' in readme
    assert f'ddp_debug.py", line {line_of("cannot decode")}, in load' in readme


def test_crash_under_record_puts_the_real_exception_in_torchrun_s_summary(tmp_path):
    job = Job(
        tmp_path,
        "--fault",
        "crash",
        nproc=2,
        extra=("--log-dir", tmp_path / "logs", "--tee", "3", "--local-ranks-filter", "1"),
    )
    code, seconds = job.end()
    out = job.output()
    assert code != 0 and seconds < 150
    summary = out[out.index("Root Cause (first observed failure)") :]
    assert re.search(r"rank\s+: 1 \(local_rank: 1\)", summary), summary
    assert "ValueError: bad sample in batch 3: cannot decode" in summary, summary
    assert "error_file: <N/A>" not in summary
    # --tee and --local-ranks-filter: rank 1's own lines on the console, each naming the rank.
    assert re.search(r"^\[default1\]:\[rank1\]: ValueError: bad sample in batch 3", out, re.M)
    assert "[default0]:" not in out
    assert list((tmp_path / "logs").rglob("error.json")), "no error file under --log-dir"


def test_straggler_is_named_by_monitored_barrier_and_killed(tmp_path):
    """3 ranks, rank 1 stalls: rank 0's monitored_barrier names it within the timeout."""
    job = Job(tmp_path, "--fault", "straggler", "--bad-rank", "1", "--monitored-barrier", nproc=3)
    code, seconds = job.end()
    out = job.output()
    assert code != 0 and seconds < 150
    assert re.search(r"\[rank0\]: RuntimeError: .*Ranks 1 failed to pass monitoredBarrier", out)


def test_mismatch_is_caught_and_the_stack_names_the_rank_0_only_all_reduce(tmp_path):
    """2 ranks: rank 0's logging all-reduce meets rank 1's gradient all-reduce; gloo sees the
    sizes differ and aborts; rank 0's stack ends at the all-reduce under `if ddp.is_main:`."""
    job = Job(tmp_path, "--fault", "mismatch", nproc=2)
    code, seconds = job.end()
    out = job.output()
    assert code != 0 and seconds < 150
    assert "Is there a distributed collective mismatch in your code?" in out, out[-3000:]
    # The rank: gloo aborts rank 0 (it received more than it expected), torchrun's root cause.
    summary = out[out.index("Root Cause (first observed failure)") :]
    assert re.search(r"rank\s+: 0 \(local_rank: 0\)", summary), summary
    culprit = line_of("            dist.all_reduce(mean)")
    assert re.search(rf"ddp_debug.py\"?, line {culprit},? in log", out), out[-4000:]


def test_unused_parameters_are_named_per_rank(tmp_path):
    """TORCH_DISTRIBUTED_DEBUG=INFO (DETAIL crashes DDP's constructor on gloo in torch 2.15)."""
    job = Job(tmp_path, "--fault", "unused", nproc=2, env={"TORCH_DISTRIBUTED_DEBUG": "INFO"})
    code, seconds = job.end()
    out = job.output()
    assert code != 0 and seconds < 150
    assert "Expected to have finished reduction in the prior iteration" in out
    for rank in (0, 1):
        assert f"Parameters which did not receive grad for rank {rank}: aux.bias, aux.weight" in out


def _fixed_runs(rank, world_size, port, out_dir):
    """Every fix in one process group; record each step's gradients and the final weights."""
    torchrun_env(rank, world_size, port)
    grads = []
    step = torch.optim.SGD.step

    def recording_step(self, *args, **kwargs):
        params = self.param_groups[0]["params"]
        # A parameter no rank used this step keeps no gradient (find_unused_parameters).
        grads.append([torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params])
        return step(self, *args, **kwargs)

    torch.optim.SGD.step = recording_step
    ddp = ddp_common.setup("gloo", timeout_s=30)
    results = {}
    runs = [
        ("uneven", "join"),
        ("uneven", "sampler"),
        ("mismatch", "every-rank"),
        ("unused", "find-unused"),
        ("unused", "model"),
        ("none", "none"),
    ]
    for fault, fix in runs:
        args = ddp_debug.parse_args(["--fault", fault, "--fix", fix, "--bad-rank", "2"])
        grads.clear()
        model = ddp_debug.train(args, ddp)
        weights = [p.detach().clone() for p in model.parameters()]
        results[fault, fix] = {"grads": list(grads), "weights": weights}
    torch.save(results, f"{out_dir}/rank{rank}.pt")
    ddp_common.cleanup()


def test_fixes_run_and_join_shadows_the_ranks_that_ran_out_with_zeros(tmp_path):
    spawn(_fixed_runs, 3, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(3)]
    for key in ranks[0]:
        # Every fixed run ends with identical replicas.
        for r in (1, 2):
            for a, b in zip(ranks[0][key]["weights"], ranks[r][key]["weights"], strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0, msg=str(key))
    steps = [len(ranks[r]["uneven", "join"]["grads"]) for r in range(3)]
    assert steps == [8, 8, 3]
    # The sampler pads the 76 samples to 3 x 26: 7 batches of 4 (the last one of 2) per rank.
    per_rank = -(-(8 + 8 + 3) * 4 // 3)
    batches = -(-per_rank // 4)
    assert [len(ranks[r]["uneven", "sampler"]["grads"]) for r in range(3)] == [batches] * 3
    # Join by hand: each active rank's own gradient, summed, over the world size (3): the rank
    # that ran out (2, after 3 steps) adds zeros.
    args = ddp_debug.parse_args(["--fault", "uneven", "--bad-rank", "2"])
    ddp_common.set_seed(args.seed)
    model = ddp_debug.Net()
    loaders = [iter(torch.utils.data.DataLoader(ddp_debug.shard(args, r, 3), 4)) for r in range(3)]
    for step in range(8):
        total = [torch.zeros_like(p) for p in model.parameters()]
        for r in range(3):
            batch = next(loaders[r], None)
            if batch is None:
                continue
            model.zero_grad()
            ddp_debug.loss_of(model, *batch, step, args).backward()
            total = [t + p.grad for t, p in zip(total, model.parameters(), strict=True)]
        expected = [t / 3 for t in total]
        for r in range(3):
            if step < steps[r]:
                got = ranks[r]["uneven", "join"]["grads"][step]
                for e, g in zip(expected, got, strict=True):
                    torch.testing.assert_close(g, e, msg=f"step {step} rank {r}")
        with torch.no_grad():
            for p, e in zip(model.parameters(), expected, strict=True):
                p -= args.lr * e
    for p, w in zip(model.parameters(), ranks[0]["uneven", "join"]["weights"], strict=True):
        torch.testing.assert_close(w, p)


def test_a_fix_for_another_fault_is_a_one_line_error():
    result = subprocess.run(
        [sys.executable, ROOT / "ddp_debug.py", "--fault", "crash", "--fix", "join"],
        capture_output=True,
        text=True,
        env=cpu_env(),
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("error: --fix join does not fix --fault crash")
