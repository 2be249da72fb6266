"""Lesson 8 (ddp_debug.py): each fault breaks the job, ends it within the short timeout with no
process left behind, and its diagnosis names the culprit rank and the line or the operation; each
fix runs, and Join's gradients are what it promises, computed here by hand.

The faults run as the README prints them: these tests assert on the same runs whose output
test_readme.py compares with what the README shows (conftest.readme_run runs each command once)."""

import os
import re
import subprocess
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from conftest import ROOT, cpu_env, free_port, spawn, torchrun_env

import ddp_common
import ddp_debug

SOURCE = (ROOT / "ddp_debug.py").read_text().splitlines()


def line_of(code):
    """The line number of the one line of ddp_debug.py that holds `code`."""
    found = [i + 1 for i, line in enumerate(SOURCE) if code in line]
    assert len(found) == 1, (code, found)
    return found[0]


def ended_by_itself(result):
    """The launch failed, by itself and soon (the README prints `exit code $?` after a failed
    one), and left no process behind."""
    codes = re.findall(r"^exit code (\d+)$", result.stdout, re.M)
    assert len(codes) == 1 and codes[0] != "0", result.stdout[-2000:]
    assert result.seconds < 150
    assert not result.left, f"processes left behind: {result.left}"


def test_uneven_hangs_until_the_timeout_and_py_spy_shows_each_rank_s_line(readme_run):
    """2 ranks; rank 1's shard is short. py-spy, run while the job hangs, finds one rank waiting in
    the next step's gradient all-reduce (inside loss.backward()) and the other at the end-of-epoch
    barrier, until the 20 s timeout ends the job."""
    result = readme_run("--fault uneven --timeout 20")
    assert result.returncode == 0, result.stderr[-2000:]
    dumps = re.split(r"^Process \d+: ", result.stdout, flags=re.M)[1:]
    backward = f"train (ddp_debug.py:{line_of('loss.backward()')})"
    barrier = f"train (ddp_debug.py:{line_of('    dist.barrier()')})"
    assert len(dumps) == 2, result.stdout
    assert len([dump for dump in dumps if backward in dump]) == 1, result.stdout
    assert len([dump for dump in dumps if barrier in dump]) == 1, result.stdout
    # The README's `wait $! || grep "Timed out" uneven.log`: torchrun failed, on the timeout.
    assert "Timed out waiting 20000ms" in result.stdout, result.stdout[-2000:]
    assert result.seconds < 150
    assert not result.left, f"processes left behind: {result.left}"


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


def test_crash_under_record_puts_the_real_exception_in_torchrun_s_summary(readme_run):
    result = readme_run("--fault crash")
    ended_by_itself(result)
    out = result.stdout + result.stderr
    summary = out[out.index("Root Cause (first observed failure)") :]
    assert re.search(r"rank\s+: 1 \(local_rank: 1\)", summary), summary
    assert "ValueError: bad sample in batch 3: cannot decode" in summary, summary
    assert "error_file: <N/A>" not in summary
    # --tee and --local-ranks-filter: rank 1's own lines on the console, each naming the rank.
    assert re.search(r"^\[default1\]:\[rank1\]: ValueError: bad sample in batch 3", out, re.M)
    assert "[default0]:" not in out
    assert list((result.cwd / "logs").rglob("error.json")), "no error file under --log-dir"


def test_straggler_is_named_by_monitored_barrier_and_killed(readme_run):
    """2 ranks, rank 1 stalls: rank 0's monitored_barrier names it within the timeout."""
    result = readme_run("--fault straggler --monitored-barrier")
    ended_by_itself(result)
    out = result.stdout + result.stderr
    assert re.search(r"\[rank0\]: RuntimeError: .*Ranks 1 failed to pass monitoredBarrier", out)


def test_mismatch_is_caught_and_the_stack_names_the_rank_0_only_all_reduce(readme_run):
    """2 ranks: rank 0's logging all-reduce meets rank 1's gradient all-reduce; gloo sees the
    sizes differ and aborts; rank 0's stack ends at the all-reduce under `if ddp.rank == 0:`. The
    fixed run (--fix every-rank) then finishes."""
    result = readme_run("--fault mismatch || ")
    ended_by_itself(result)
    out = result.stdout + result.stderr
    assert "Is there a distributed collective mismatch in your code?" in out, out[-3000:]
    # torchrun's report names a rank; which one it calls the root cause depends on which exit it
    # sees first (rank 0's abort, or rank 1 stopped by torchrun): the stack below is the answer.
    assert "Root Cause (first observed failure)" in out
    culprit = line_of("            dist.all_reduce(mean)")
    assert re.search(rf"ddp_debug.py\"?, line {culprit},? in log", out), out[-4000:]
    assert "done: fault mismatch | fix every-rank | world 2" in result.stdout


def test_unused_parameters_are_named_per_rank(readme_run):
    """TORCH_DISTRIBUTED_DEBUG=INFO (DETAIL crashes DDP's constructor on gloo in torch 2.15); the
    fixed run (--fix find-unused) then finishes."""
    result = readme_run("--fault unused || ")
    ended_by_itself(result)
    out = result.stdout + result.stderr
    assert "Expected to have finished reduction in the prior iteration" in out
    for rank in (0, 1):
        assert f"Parameters which did not receive grad for rank {rank}: aux.bias, aux.weight" in out
    assert "done: fault unused | fix find-unused | world 2" in result.stdout


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
    torch.manual_seed(args.seed)
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


@pytest.mark.parametrize(
    "rank, argv, expected",
    [
        (
            "0",
            ["--fault", "crash", "--fix", "join"],
            "error: --fix join does not fix --fault crash",
        ),
        ("0", ["--timeout", "nan"], "error: --timeout must be"),
        ("0", ["--max-steps", "0"], "error: argument --max-steps: '0' is not a whole number"),
        # Every rank parses: the others stop as quietly (torchrun: one line, not one per rank).
        ("1", ["--fault", "crash", "--fix", "join"], ""),
    ],
)
def test_a_usage_mistake_is_one_error_line_from_rank_0(rank, argv, expected):
    result = subprocess.run(
        [sys.executable, ROOT / "ddp_debug.py", *argv],
        capture_output=True,
        text=True,
        env={**cpu_env(), "RANK": rank},
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.startswith(expected) and result.stderr.count("\n") == (rank == "0")


def test_a_fault_that_needs_two_ranks_is_refused_on_one():
    """On one rank nothing waits for anything: --fault straggler would sleep 100 x --timeout."""
    one_rank = dict(RANK=0, WORLD_SIZE=1, LOCAL_RANK=0, LOCAL_WORLD_SIZE=1)
    result = subprocess.run(
        [sys.executable, ROOT / "ddp_debug.py", "--fault", "straggler"],
        capture_output=True,
        text=True,
        env=cpu_env(**one_rank, MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port()),
        timeout=120,
    )
    assert (result.returncode, result.stderr) == (
        2,
        "error: --fault straggler needs 2 or more ranks: start it with --nproc_per_node=2\n",
    )


def _monitored_barrier_beside_nccl(rank, world_size, port, out_dir):
    """A default group with no CPU backend, as NCCL's is ("cuda:gloo" stands in on a CPU)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("cuda:gloo", rank=rank, world_size=world_size)
    outcome = {}
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=10))
        outcome["default"] = "passed"
    except Exception as e:
        outcome["default"] = str(e)
    # What ddp_debug.py --monitored-barrier does: a gloo group of its own.
    dist.monitored_barrier(dist.new_group(backend="gloo"), timeout=timedelta(seconds=10))
    outcome["gloo group"] = "passed"
    torch.save(outcome, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


def test_monitored_barrier_needs_the_gloo_group_the_lesson_makes_beside_nccl(tmp_path):
    """monitored_barrier refuses a group without a CPU backend (NCCL's default group): the
    lesson creates a gloo group for it. The NCCL run itself: tests/gpu_check.sh."""
    spawn(_monitored_barrier_beside_nccl, 2, str(tmp_path))
    outcome = torch.load(tmp_path / "rank0.pt")
    # torch 2.14: "requires a group with a CPU-capable backend"; 2.11: "only ... for GLOO".
    assert outcome["default"] != "passed" and outcome["gloo group"] == "passed", outcome
    source = (ROOT / "ddp_debug.py").read_text()
    assert 'monitor = dist.new_group(backend="gloo")' in source
    assert "dist.monitored_barrier(monitor," in source
