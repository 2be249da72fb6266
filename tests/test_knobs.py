"""Lesson 7 (ddp_knobs.py, knobs_extras.py): ZeRO-1, SyncBatchNorm, communication hooks, and what
two of them change in a checkpoint. One mp.spawn of 2 processes runs the lesson's main() as torchrun
would (conftest.torchrun_env: a fresh process group per scenario) through every scenario below;
the tests read what a user sees: the printed lines, the checkpoints, the exit codes. To check the
hooks' bytes on the wire, the workers count what torch's DDP communication hooks hand to
torch.distributed.all_reduce. The README's torchrun command is checked end to end (its run is
shared with test_readme.py: conftest.readme_run)."""

import json
import math
import os
import re
import shutil
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    ROOT,
    assert_clean_failure,
    assert_ok,
    flat_tensors,
    free_port,
    main_output,
    run,
    run_torchrun,
    spawn,
    torchrun_env,
)

import knobs_extras

N_PARAMS = sum(p.numel() for p in knobs_extras.Net().parameters())  # 10,266
HOOKS = "torch.distributed.algorithms.ddp_comm_hooks"
# Resume: 256 per process and step -> 8 steps an epoch. 20 steps straight == 11 (inside epoch 2)
# + --resume auto + 9 (into epoch 3), with ZeRO and PowerSGD at once.
RESUME = ["--batch-size", "256", "--zero", "--comm-hook", "powersgd", "--powersgd-warmup", "3"]
RESUME += ["--powersgd-rank", "1", "--log-every", "4"]
# SyncBN: 2 processes x 8 against 1 x 16, a small learning rate: BatchNorm over 8 samples makes the
# net sensitive, and the ~1e-7 rounding of another summation order grows with the step size.
SMALL = ["--max-steps", "10", "--lr", "3e-4", "--log-every", "5"]
HOOK = ["--batch-size", "8", "--max-steps", "100", "--log-every", "25"]
SCENARIOS = {  # name -> (world size, flags); run in this order; {out}, {rank} filled in
    "usage_hook": (1, ["--comm-hook", "int8"]),
    "usage_warmup": (1, ["--powersgd-warmup", "1"]),
    "usage_batch": (1, ["--batch-size", "0"]),
    "plain": (2, SMALL + ["--batch-size", "8"]),
    "zero": (2, SMALL + ["--batch-size", "8", "--zero"]),
    "sync_bn": (2, SMALL + ["--batch-size", "8", "--sync-bn"]),
    "one_process": (1, SMALL + ["--batch-size", "16"]),
    "straight": (2, RESUME + ["--max-steps", "20", "--resume", "auto"]),
    "half": (2, RESUME + ["--max-steps", "11"]),
    "node_local": (2, RESUME + ["--resume", "auto", "--checkpoint-dir", "{out}/node{rank}"]),
    "rest": (2, RESUME + ["--max-steps", "20", "--resume", "auto"]),
    "other_world": (1, RESUME + ["--max-steps", "20", "--resume", "{out}/half/last.pt"]),
    "unsharded": (
        2,
        [f for f in RESUME if f != "--zero"]
        + ["--max-steps", "20", "--resume", "{out}/half/last.pt"],
    ),
    # After "rest": half/last.pt is at step 20.
    "other_batch": (2, RESUME + ["--batch-size", "128", "--resume", "{out}/half/last.pt"]),
    "past_max_steps": (2, RESUME + ["--max-steps", "12", "--resume", "{out}/half/last.pt"]),
    "fp16": (2, HOOK + ["--comm-hook", "fp16"]),
    "bf16": (2, HOOK + ["--comm-hook", "bf16"]),
    "powersgd": (
        2,
        HOOK + ["--comm-hook", "powersgd", "--powersgd-warmup", "5", "--powersgd-rank", "1"],
    ),
}
DIRS = {"rest": "half"}  # the second half continues in the first half's folder


class HookBytes:
    """Counts the bytes torch's DDP communication hooks hand to torch.distributed.all_reduce: what a
    hook puts on the wire (a bf16 bucket 2 bytes a gradient, a PowerSGD factor its own size).
    Without a hook DDP all-reduces in C++, unseen here: 4 bytes a gradient, by definition."""

    def __init__(self):
        import torch.distributed as dist

        self.bytes, real = 0, dist.all_reduce

        def counting(tensor, *args, **kwargs):
            if sys._getframe(1).f_globals["__name__"].startswith(HOOKS):
                self.bytes += tensor.nbytes
            return real(tensor, *args, **kwargs)

        dist.all_reduce = counting


def _run_main(argv):
    """ddp_knobs.main() with argv, as torchrun runs it: (stdout, stderr, exit code)."""
    code, stdout, stderr = main_output("ddp_knobs.py", argv)
    return stdout, stderr, code


def _worker(rank, world, port, out, ports):
    counter, results = HookBytes(), {}
    for name, (size, flags) in SCENARIOS.items():
        if rank >= size:
            continue
        torchrun_env(rank, size, ports[name])
        argv = [f.format(out=out, rank=rank) for f in flags]
        if "--checkpoint-dir" not in argv:
            argv += ["--checkpoint-dir", os.path.join(out, DIRS.get(name, name))]
        if name == "node_local" and rank == 0:
            # Node-local disks: only rank 0's holds a checkpoint.
            os.makedirs(f"{out}/node0")
            shutil.copy(f"{out}/half/last.pt", f"{out}/node0/last.pt")
        counter.bytes = 0
        stdout, stderr, code = _run_main(argv)
        results[name] = {"out": stdout, "err": stderr, "code": code, "hook_bytes": counter.bytes}
    with open(os.path.join(out, f"results{rank}.json"), "w") as f:
        json.dump(results, f)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("knobs")
    spawn(_worker, 2, str(out), {name: free_port() for name in SCENARIOS})
    results = [json.loads((out / f"results{r}.json").read_text()) for r in range(2)]
    return out, results


def _ckpt(out, name):
    return torch.load(out / DIRS.get(name, name) / "last.pt", weights_only=True)


def fields(text, keyword):
    """The `key value` fields of the last line that starts with `keyword:`."""
    line = [line for line in text.splitlines() if line.startswith(f"{keyword}:")][-1]
    return dict(re.findall(r"(\w+) ([^|]+?)(?: \||$)", line[len(keyword) + 2 :]))


def _done(runs, name):
    return fields(runs[1][0][name]["out"], "done")


def _moved(trained, init):
    """{name: |trained - init|} over the trained parameters (BatchNorm statistics aside)."""
    return {
        k: float((v - init[k]).norm())
        for k, v in trained.items()
        if v.is_floating_point() and not k.endswith(("running_mean", "running_var"))
    }


def _relative_gaps(a, b):
    """{name: |a - b| / how far b moved from its initial weights} over the trained parameters."""
    torch.manual_seed(0)  # the lesson's initial weights
    init = knobs_extras.Net().state_dict()
    moved = _moved(b, init)
    assert min(moved.values()) > 1e-4, moved
    return {k: float((a[k] - b[k]).norm()) / moved[k] for k in moved}


def _assert_equal(a, b):
    a, b = flat_tensors(a), flat_tensors(b)
    assert a.keys() == b.keys() and a
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, bad


# ---------------------------------------------------------------------------------------------
# --zero
# ---------------------------------------------------------------------------------------------
def test_zero_matches_the_unsharded_optimizer_with_half_its_state_per_process(runs):
    """Same 10 steps with and without ZeRO: the same weights, the same (consolidated) AdamW state
    in the unsharded optimizer's format, and rank 0 holds about half of it."""
    out, _ = runs
    plain, zero = _ckpt(out, "plain"), _ckpt(out, "zero")
    assert plain["step"] == zero["step"] == 10
    gaps = _relative_gaps(zero["model"], plain["model"])
    assert max(gaps.values()) < 1e-6, gaps
    a, b = flat_tensors(plain["optimizer"]), flat_tensors(zero["optimizer"])
    assert a.keys() == b.keys() and len(a) == 3 * 8  # step, exp_avg, exp_avg_sq of 8 parameters
    for key in a:
        assert torch.allclose(a[key].double(), b[key].double(), rtol=1e-6, atol=1e-9), key
    assert plain["optimizer"]["param_groups"] == zero["optimizer"]["param_groups"]
    # AdamW: two fp32 moments per parameter (and a step per tensor) on every process
    full, shard = (float(_done(runs, n)["opt_state"].split()[0]) for n in ("plain", "zero"))
    assert full == pytest.approx(8 * N_PARAMS / 2**20, abs=6e-4)
    assert 0 < shard <= 0.6 * full, (shard, full)


def test_resume_with_zero_and_powersgd_continues_bitwise(runs):
    """20 steps straight == 11 (inside epoch 2) + --resume auto: rank 0 saved the whole AdamW
    state after consolidate_state_dict on every process, and every process's PowerSGD state;
    each process takes back its shard and its own error feedback, after DDP has regrouped its
    buckets."""
    out, res = runs
    straight, resumed = _ckpt(out, "straight"), _ckpt(out, "rest")
    assert straight["step"] == resumed["step"] == 20 and straight["epoch"] == 2
    assert "resume: no " in res[0]["straight"]["out"]  # --resume auto, nothing there yet
    assert f"resumed: {out}/half/last.pt | step 11 | world 2 -> 2" in res[0]["rest"]["out"]
    ps = straight["powersgd"]
    assert len(ps) == 2 and ps[0]["iter"] == 20 and ps[0]["error_dict"]
    assert not all(
        torch.equal(ps[0]["error_dict"][k], ps[1]["error_dict"][k]) for k in ps[0]["error_dict"]
    )
    _assert_equal(straight["model"], resumed["model"])
    _assert_equal(straight["optimizer"], resumed["optimizer"])
    _assert_equal(straight["powersgd"], resumed["powersgd"])
    # The printed figures of the resumed run are the straight run's.
    assert fields(res[0]["rest"]["out"], "done")["val_loss"] == _done(runs, "straight")["val_loss"]


def test_a_zero_checkpoint_resumes_without_zero(runs):
    """The consolidated state has the unsharded optimizer's format: the first half's checkpoint,
    resumed without --zero, continues to the straight run's weights (to float rounding)."""
    out, _ = runs
    unsharded, straight = _ckpt(out, "unsharded"), _ckpt(out, "straight")
    assert unsharded["step"] == 20
    assert max(_relative_gaps(unsharded["model"], straight["model"]).values()) < 1e-6


def test_resume_stops_with_one_line_when_only_some_ranks_see_the_checkpoint(runs):
    """Node-local checkpoint folders where only rank 0's holds last.pt: every rank must resume
    from the same step, so all stop (exit 1, one line from rank 0) instead of rank 1 starting
    fresh (replicas that differ, then a hang)."""
    _, res = runs
    assert [res[r]["node_local"]["code"] for r in (0, 1)] == [1, 1]
    errors = [line for line in res[0]["node_local"]["err"].splitlines() if "error:" in line]
    assert errors == [
        "error: ranks found different checkpoints (step by rank: [11, None]): give every rank "
        "the same one, or remove them all"
    ]
    assert "error:" not in res[1]["node_local"]["err"]


def test_a_resume_on_another_world_size_is_refused_in_one_line(runs):
    """Lesson 7 keeps lesson 1's loader, so a step is B x W samples: on another world size a
    checkpoint's step would mean other samples. One process refuses the checkpoint of two."""
    _, res = runs
    result = res[0]["other_world"]
    errors = [line for line in result["err"].splitlines() if "error:" in line]
    assert result["code"] == 2 and len(errors) == 1, result
    assert "was saved by 2 processes x --batch-size 256: resume it so" in errors[0]


def test_a_resume_with_another_batch_size_is_refused_and_one_past_max_steps_trains_nothing(runs):
    """Another --batch-size would make the saved step other samples (it went through, training
    part of an epoch again); a run resumed at step 20 with --max-steps 12 ends there (it trained
    on to the end of --epochs: the loop stopped only at step == 12)."""
    _, res = runs
    result = res[0]["other_batch"]
    errors = [line for line in result["err"].splitlines() if "error:" in line]
    assert result["code"] == 2 and len(errors) == 1, result
    assert "x --batch-size 256: resume it so" in errors[0]
    assert not res[1]["other_batch"]["err"].count("error:")
    out = res[0]["past_max_steps"]["out"]
    assert "resumed:" in out and fields(out, "done")["steps"] == "20", out


# ---------------------------------------------------------------------------------------------
# --sync-bn
# ---------------------------------------------------------------------------------------------
BOUND = 1e-4


def test_sync_bn_two_processes_equal_one_process_with_the_global_batch(runs):
    """SyncBN normalises with the statistics of the GLOBAL batch: 2 processes x 8 take the same
    steps as 1 process x 16, weights and running statistics alike (the CPU stand-in here)."""
    out, _ = runs
    two, one = _ckpt(out, "sync_bn"), _ckpt(out, "one_process")
    assert two["step"] == one["step"] == 10 and two["model"].keys() == one["model"].keys()
    gaps = _relative_gaps(two["model"], one["model"])
    assert max(gaps.values()) < BOUND, gaps
    for name, b in one["model"].items():
        if name.endswith(("running_mean", "running_var")):
            assert torch.allclose(two["model"][name], b, rtol=1e-4, atol=1e-6), name
        elif name.endswith("num_batches_tracked"):
            assert int(two["model"][name]) == int(b) == 10


def test_plain_bn_breaks_the_equivalence(runs):
    """Without SyncBN each process normalises with its own 8 samples' statistics: the same global
    batch gives other gradients, and the runs drift far beyond the bound."""
    out, _ = runs
    gaps = _relative_gaps(_ckpt(out, "plain")["model"], _ckpt(out, "one_process")["model"])
    assert max(gaps.values()) > 100 * BOUND, gaps


def test_the_printed_validation_is_the_checkpoints(runs):
    """The model the checkpoint holds, evaluated here alone, scores the printed val_loss and
    val_acc: rank 0 evaluates its own replica, the one it saves (BatchNorm statistics included)."""
    out, _ = runs
    _, (x, y) = (d.tensors for d in knobs_extras.synthetic_images())
    for name in ("plain", "sync_bn", "rest", "powersgd"):
        model = knobs_extras.Net()
        model.load_state_dict(_ckpt(out, name)["model"])
        with torch.no_grad():
            logits = model.eval()(x)
        done = _done(runs, name)
        assert float(done["val_loss"]) == pytest.approx(F.cross_entropy(logits, y).item(), abs=1e-4)
        accuracy = 100 * (logits.argmax(1) == y).float().mean().item()
        assert float(done["val_acc"].rstrip("%")) == pytest.approx(accuracy, abs=0.01)


# ---------------------------------------------------------------------------------------------
# --comm-hook
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("hook", ["fp16", "bf16", "powersgd"])
def test_training_with_a_comm_hook_still_learns(runs, hook):
    _, res = runs
    done = _done(runs, hook)
    assert res[0][hook]["code"] == 0 and int(done["steps"]) == 100
    losses = [float(v) for v in re.findall(r"\| loss ([\d.]+)", res[0][hook]["out"])]
    assert losses[-1] < 0.6 * math.log(10), losses  # from ~ln(10) = 2.30 at the start
    assert float(done["val_acc"].rstrip("%")) > 50, done


@pytest.mark.parametrize("hook", ["fp16", "bf16"])
def test_16_bit_hooks_send_half_the_bytes(runs, hook):
    """Counted on the wire: every step each process all-reduces every gradient at 2 bytes, half
    of fp32's 4; the printed grad_comm says the same."""
    _, res = runs
    for rank in (0, 1):
        assert res[rank][hook]["hook_bytes"] == 100 * 2 * N_PARAMS
    assert float(_done(runs, hook)["grad_comm"].split()[0]) == round(2 * N_PARAMS / 2**10, 1)


def test_powersgd_sends_under_a_tenth_of_the_bytes_after_its_warm_up(runs):
    """Counted on the wire: 5 warm-up steps of whole fp32 gradients, then rank-1 factors (and
    the BatchNorm and bias vectors, uncompressed): under a tenth of fp32's bytes per step; the
    printed grad_comm is the same figure."""
    _, res = runs
    for rank in (0, 1):
        compressed = (res[rank]["powersgd"]["hook_bytes"] - 5 * 4 * N_PARAMS) / (100 - 5)
        assert 0 < compressed < 0.1 * 4 * N_PARAMS, compressed
    printed = float(_done(runs, "powersgd")["grad_comm"].split()[0])
    assert printed == pytest.approx(compressed / 2**10, abs=0.05)


# ---------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------
def test_torchrun_with_every_knob_saves_a_full_resumable_checkpoint(readme_run):
    """The README's lesson-7 command (torchrun, 2 processes, --zero --sync-bn --comm-hook
    powersgd): its checkpoint holds the whole AdamW state (gathered from the ZeRO shards) and
    each process's PowerSGD state."""
    r = readme_run("ddp_knobs.py --zero")
    assert_ok(r)
    done = fields(r.stdout, "done")
    assert done["world"] == "2" and done["opt_state"].endswith("MiB/rank"), r.stdout
    ckpt = torch.load(r.cwd / "checkpoints" / "lesson7" / "last.pt", weights_only=True)
    assert ckpt["step"] == int(done["steps"]) and len(ckpt["powersgd"]) == 2
    # A state for every parameter, none for the buffers (2 BatchNorm layers, 3 buffers each).
    assert len(ckpt["optimizer"]["state"]) == len(ckpt["model"]) - 2 * 3


@pytest.mark.parametrize("name", ["usage_hook", "usage_warmup", "usage_batch"])
def test_bad_flags_exit_2_with_one_error_line(runs, name):
    _, res = runs
    assert res[0][name]["code"] == 2
    assert len([line for line in res[0][name]["err"].splitlines() if "error:" in line]) == 1


def test_bad_flag_from_the_command_line():
    r = run([sys.executable, ROOT / "ddp_knobs.py", "--comm-hook", "int8"], timeout=60)
    assert len(assert_clean_failure(r, code=2)) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_zero_fused_adamw_resumes(tmp_path):
    """On a GPU: fused AdamW under ZeRO, saved, resumed, stepped (pytorch#124133: crashed before
    the lesson put AdamW's `step` back beside its parameter)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_", "MASTER_"))}
    flags = ["--zero", "--epochs", "1", "--checkpoint-dir", tmp_path]
    assert_ok(run_torchrun("ddp_knobs.py", *flags, "--max-steps", "4", nproc=1, env=env))
    resumed = run_torchrun(
        "ddp_knobs.py", *flags, "--max-steps", "8", "--resume", "auto", nproc=1, env=env
    )
    assert_ok(resumed)
    assert "resumed: " in resumed.stdout and "| steps 8 |" in resumed.stdout
