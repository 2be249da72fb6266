"""Lesson 7 (ddp_knobs.py, knobs_extras.py): ZeRO-1, SyncBatchNorm, communication hooks, and what
they keep in a checkpoint. Real ranks on gloo/CPU: one mp.spawn of 2 processes runs every training
scenario through the lesson's own train() (a fresh process group per scenario) and counts the
bytes each hook hands to all-reduce; the README's torchrun command is checked end to end (its run is
shared with test_readme.py: conftest.readme_run)."""

import gc
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
    init_spawned,
    run,
    run_torchrun,
    spawn,
)

import ddp_benchmark
import ddp_extras
import ddp_knobs as K
import knobs_extras

BASE = ["--seed", "3", "--log-every", "5", "--samples", "256"]  # 128 samples per rank
ADAMW = ["--optimizer", "adamw", "--lr", "0.003", "--batch-size", "8", "--max-steps", "10"]
SGD = ["--optimizer", "sgd", "--lr", "0.02", "--batch-size", "8", "--max-steps", "10"]
# A small LR for the BatchNorm equivalence: BN over 8 samples makes the net sensitive, and the
# ~1e-7 rounding differences of another summation order grow with the LR.
BN = ["--optimizer", "sgd", "--lr", "0.002", "--max-steps", "10"]
# Resume: 64 samples, 32 per rank, batch 5 -> 6 steps per epoch; 15 straight == 8 + resume + 7
# (the first half stops inside epoch 2, the second crosses into epoch 3).
RESUME = ["--samples", "64", "--batch-size", "5", "--epochs", "3"]
ZRES = RESUME + ["--optimizer", "adamw", "--zero"]
PRES = RESUME + [
    "--comm-hook",
    "powersgd",
    "--powersgd-warmup",
    "3",
    "--powersgd-rank",
    "1",
    "--bucket-cap-mb",
    "0.01",
]  # several buckets: the per-bucket state must land right
HOOK = ["--samples", "1024", "--batch-size", "8", "--max-steps", "60", "--lr", "0.02"]
SCENARIOS = {  # name -> (world size, flags); run in this order
    "adamw": (2, ADAMW),
    "adamw_zero": (2, ADAMW + ["--zero"]),
    "sgd": (2, SGD),
    "sgd_zero": (2, SGD + ["--zero"]),
    "zstraight": (2, ZRES + ["--max-steps", "15"]),
    "zhalf": (2, ZRES + ["--max-steps", "8"]),
    "zplain": (
        2,
        [f for f in ZRES if f != "--zero"]
        + ["--max-steps", "15", "--resume", "{out}/zhalf/last.pt"],
    ),
    "zrest": (2, ZRES + ["--max-steps", "15", "--resume", "auto"]),
    "pstraight": (2, PRES + ["--max-steps", "15"]),
    "phalf": (2, PRES + ["--max-steps", "8"]),
    "prest": (2, PRES + ["--max-steps", "15", "--resume", "auto"]),
    "bn_sync_w2": (2, BN + ["--batch-size", "8", "--sync-bn"]),
    "bn_w1": (1, BN + ["--batch-size", "16"]),
    "bn_plain_w2": (2, BN + ["--batch-size", "8"]),
    "hook_fp16": (2, HOOK + ["--comm-hook", "fp16"]),
    "hook_bf16": (2, HOOK + ["--comm-hook", "bf16"]),
    "hook_powersgd": (
        2,
        HOOK
        + [
            "--comm-hook",
            "powersgd",
            "--powersgd-warmup",
            "5",
            "--powersgd-rank",
            "1",
            "--bucket-cap-mb",
            "0.01",
        ],
    ),
}
DIRS = {"zrest": "zhalf", "prest": "phalf"}  # the resumed halves continue in the first half's dir


class AllReduceCounter:
    """Counts the bytes and calls this rank hands to torch.distributed.all_reduce while active:
    what the hooks put on the wire (a bf16 bucket 2 bytes a gradient, a PowerSGD factor its own
    size). On gloo the lesson finishes each PowerSGD bucket inside the hook, so every chained
    all-reduce of a step happens before the step returns."""

    def __enter__(self):
        import torch.distributed as dist

        self.dist, self.real, self.bytes, self.calls = dist, dist.all_reduce, 0, 0

        def counting(tensor, *args, **kwargs):
            self.bytes, self.calls = self.bytes + tensor.nbytes, self.calls + 1
            return self.real(tensor, *args, **kwargs)

        dist.all_reduce = counting
        return self

    def __exit__(self, *exc):
        self.dist.all_reduce = self.real


def _count_hook_bytes(ddp, steps=5):
    """{hook: [(bytes, calls) per step]} over real DDP steps of the lesson's model and hooks."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    out = {}
    for hook in ("none", "fp16", "bf16", "powersgd"):
        args = K.parse_args(
            [
                "--comm-hook",
                hook,
                "--bucket-cap-mb",
                "0.01",
                "--powersgd-warmup",
                "2",
                "--powersgd-rank",
                "1",
            ]
        )
        ddp_model, state, opt = K.build(args, ddp)
        if hook == "none":  # DDP's built-in all-reduce runs in C++: count its Python twin
            ddp_model.register_comm_hook(None, default_hooks.allreduce_hook)
        g = torch.Generator().manual_seed(ddp.rank)
        counts = []
        for _ in range(steps):
            x, y = torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 10, (4,), generator=g)
            with AllReduceCounter() as c:
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(ddp_model(x), y).backward()
                opt.step()
            counts.append((c.bytes, c.calls))
        n = sum(p.numel() for p in ddp_model.parameters())
        out[hook] = {
            "steps": counts,
            "params": n,
            "lesson": knobs_extras.comm_bytes_per_step(hook, n, state),
        }
        del ddp_model, opt, state
        gc.collect()  # a DDP wrapper alive at destroy_process_group can abort the process
    return out


def _resume_disagreement(ddp, out):
    """--resume auto where only rank 0's (node-local) checkpoint dir holds last.pt."""
    import contextlib
    import io

    fresh = K.resume_path(
        K.parse_args(["--resume", "auto", "--checkpoint-dir", f"{out}/empty"]), ddp
    )
    mine = os.path.join(out, f"node{ddp.rank}")
    os.makedirs(mine, exist_ok=True)
    if ddp.rank == 0:
        shutil.copy(os.path.join(out, "adamw", "last.pt"), mine)
    err, code = io.StringIO(), None
    try:
        with contextlib.redirect_stderr(err):
            K.resume_path(K.parse_args(["--resume", "auto", "--checkpoint-dir", mine]), ddp)
    except SystemExit as e:
        code = e.code
    return {"fresh": fresh, "code": code, "stderr": err.getvalue(), "path": f"{out}/node0/last.pt"}


def _worker(rank, world, port, out, ports):
    import torch.distributed as dist

    results, placed = {}, []
    place = K.place_state_on_param_device
    K.place_state_on_param_device = lambda opt: (placed.append(1), place(opt))  # count the calls
    for name, (size, flags) in SCENARIOS.items():
        if rank < size:
            ddp = init_spawned(rank, size, ports[name])
            argv = BASE + [f.format(out=out) for f in flags]
            argv += ["--checkpoint-dir", os.path.join(out, DIRS.get(name, name))]
            results[name] = K.train(K.parse_args(argv), ddp)
            results[name]["placements"] = len(placed)
            dist.destroy_process_group()
    ddp = init_spawned(rank, world, ports["bytes"])
    results["bytes"] = _count_hook_bytes(ddp)
    results["resume"] = _resume_disagreement(ddp, out)
    dist.destroy_process_group()
    torch.save(results, os.path.join(out, f"results{rank}.pt"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("knobs")
    spawn(_worker, 2, str(out), {name: free_port() for name in [*SCENARIOS, "bytes"]})
    results = [torch.load(out / f"results{r}.pt", weights_only=True) for r in range(2)]
    return out, results


def _ckpt(out, name):
    return torch.load(out / DIRS.get(name, name) / "last.pt", weights_only=True)


def _init():
    torch.manual_seed(3)  # --seed 3: the initial weights of every run
    return K.Net().state_dict()


def _relative_gaps(a, b):
    """{name: |a - b| / how far b moved from its initial value} over the trained parameters."""
    init, gaps = _init(), {}
    for name, pb in b.items():
        if pb.is_floating_point() and not name.endswith(("running_mean", "running_var")):
            moved = float((pb - init[name]).norm())
            assert moved > 1e-4, f"{name} did not train"
            gaps[name] = float((a[name] - pb).norm()) / moved
    return gaps


def _assert_equal(a, b):
    a, b = flat_tensors(a), flat_tensors(b)
    assert a.keys() == b.keys() and a
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, bad


# ---------------------------------------------------------------------------------------------
# --zero
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("optim", ["adamw", "sgd"])
def test_zero_holds_about_half_the_optimizer_state_per_rank(runs, optim):
    """AdamW keeps two moments per parameter, SGD one momentum buffer: with ZeRO-1 on 2 ranks each
    rank holds its shard's share, together exactly the unsharded state, neither much over half."""
    _, res = runs
    full = [res[r][optim]["opt_state_bytes"] for r in range(2)]
    shard = [res[r][f"{optim}_zero"]["opt_state_bytes"] for r in range(2)]
    n_params = sum(p.numel() for p in K.Net().parameters())
    assert full[0] == full[1] >= (2 if optim == "adamw" else 1) * 4 * n_params  # (+ Adam's steps)
    assert shard[0] + shard[1] == full[0]
    assert max(shard) <= 0.6 * full[0] and min(shard) > 0, (shard, full)


@pytest.mark.parametrize("optim", ["adamw", "sgd"])
def test_zero_matches_the_unsharded_optimizer(runs, optim):
    """Same 10 steps with and without ZeRO: the same weights, and the same (consolidated) optimizer
    state in the same format in the checkpoint."""
    out, _ = runs
    plain, zero = _ckpt(out, optim), _ckpt(out, f"{optim}_zero")
    assert plain["step"] == zero["step"] == 10
    gaps = _relative_gaps(zero["model"], plain["model"])
    assert max(gaps.values()) < 1e-6, gaps
    a, b = flat_tensors(plain["optimizer"]), flat_tensors(zero["optimizer"])
    assert a.keys() == b.keys() and len(a) >= 8  # the consolidated dict has every parameter's state
    for key in a:
        assert torch.allclose(a[key].double(), b[key].double(), rtol=1e-6, atol=1e-9), key
    assert plain["optimizer"]["param_groups"] == zero["optimizer"]["param_groups"]


def test_zero_resume_continues_bitwise_and_its_checkpoint_resumes_without_zero(runs):
    """--zero: 15 steps straight == 8 (inside epoch 2) + --resume auto: rank 0 saved the full
    state after consolidate_state_dict on every rank; each rank loads it and keeps its shard. The
    same checkpoint resumed WITHOUT --zero continues to the same weights (float rounding)."""
    out, res = runs
    straight, resumed, plain = _ckpt(out, "zstraight"), _ckpt(out, "zrest"), _ckpt(out, "zplain")
    assert (
        res[0]["zhalf"]["step"] == 8 and straight["step"] == resumed["step"] == plain["step"] == 15
    )
    _assert_equal(straight["model"], resumed["model"])
    _assert_equal(straight["optimizer"], resumed["optimizer"])
    assert max(_relative_gaps(plain["model"], straight["model"]).values()) < 1e-6
    # restore() put the loaded state where the fused kernels want it (once per rank, ZeRO run only)
    assert res[0]["zrest"]["placements"] - res[0]["zplain"]["placements"] == 1


def test_resume_puts_fused_optimizer_state_back_on_the_parameter_device():
    """ZeroRedundancyOptimizer.load_state_dict moves Adam's 0-dim `step` to the CPU; fused AdamW on
    a GPU then fails at its next step (pytorch/pytorch#124133). A CPU has one device, so the
    parameter lives on `meta` here: the fix must move a fused group's state to it and leave a
    plain group's CPU `step` (what non-fused Adam wants) alone."""
    fused, plain = (
        torch.nn.Parameter(torch.zeros(3, device="meta")),
        torch.nn.Parameter(torch.zeros(3)),
    )
    opt = torch.optim.AdamW([{"params": [fused]}, {"params": [plain]}])
    opt.param_groups[0]["fused"] = True
    opt.state[fused] = {"step": torch.tensor(3.0), "exp_avg": torch.zeros(3, device="meta")}
    opt.state[plain] = {"step": torch.tensor(3.0), "exp_avg": torch.zeros(3)}
    # ZeRO's local optimizer is its .optim
    knobs_extras.place_state_on_param_device(type("Zero", (), {"optim": opt})())
    assert opt.state[fused]["step"].device.type == "meta"
    assert opt.state[plain]["step"].device.type == "cpu"


# ---------------------------------------------------------------------------------------------
# --comm-hook powersgd: its state is in the checkpoint
# ---------------------------------------------------------------------------------------------
def test_powersgd_resume_continues_bitwise(runs):
    """PowerSGD keeps per-rank error feedback and warm-start factors per bucket: 15 steps
    straight == 8 + --resume auto + 7, bitwise, with several buckets (the resumed run rebuilds
    them first)."""
    out, res = runs
    straight, resumed = _ckpt(out, "pstraight"), _ckpt(out, "prest")
    assert straight["step"] == resumed["step"] == 15
    ps = straight["powersgd"]
    assert len(ps) == 2 and len(ps[0]["error"]) >= 2 and ps[0]["iter"] == 15
    assert not all(
        torch.equal(ps[0]["error"][k], ps[1]["error"][k]) for k in ps[0]["error"]
    )  # per rank
    _assert_equal(straight["model"], resumed["model"])
    _assert_equal(straight["optimizer"], resumed["optimizer"])
    _assert_equal(straight["powersgd"], resumed["powersgd"])


# ---------------------------------------------------------------------------------------------
# --sync-bn, and BatchNorm statistics before evaluating and saving
# ---------------------------------------------------------------------------------------------
BOUND = 1e-4


def test_sync_bn_two_ranks_equal_one_process_with_the_global_batch(runs):
    """SyncBN normalises with the statistics of the GLOBAL batch: 2 ranks x 8 take the same steps
    as 1 process x 16, weights and running statistics alike."""
    out, _ = runs
    two, one = _ckpt(out, "bn_sync_w2"), _ckpt(out, "bn_w1")
    assert two["step"] == one["step"] == 10 and two["model"].keys() == one["model"].keys()
    gaps = _relative_gaps(two["model"], one["model"])
    assert max(gaps.values()) < BOUND, gaps
    for name, b in one["model"].items():
        if name.endswith(("running_mean", "running_var")):
            assert torch.allclose(two["model"][name], b, rtol=1e-4, atol=1e-6), name
        elif name.endswith("num_batches_tracked"):
            assert int(two["model"][name]) == int(b) == 10


def test_plain_bn_breaks_the_equivalence(runs):
    """Without SyncBN each rank normalises with its own 8 samples' statistics: the same global
    batch gives other gradients, and the runs drift far beyond the bound."""
    out, _ = runs
    gaps = _relative_gaps(_ckpt(out, "bn_plain_w2")["model"], _ckpt(out, "bn_w1")["model"])
    assert max(gaps.values()) > 100 * BOUND, gaps


def test_every_rank_evaluates_with_the_statistics_the_checkpoint_holds(runs):
    """Plain BN: each rank's forward updates its own running statistics. Before evaluating and
    saving, rank 0's go to every rank: both ranks end with the checkpoint's buffers, and the
    checkpoint, evaluated alone, gives the validation loss the run reported."""
    out, res = runs
    ckpt = _ckpt(out, "bn_plain_w2")
    _assert_equal(res[0]["bn_plain_w2"]["model"], ckpt["model"])
    _assert_equal(res[1]["bn_plain_w2"]["model"], ckpt["model"])
    model = K.Net()
    model.load_state_dict(ckpt["model"])
    _, (xv, yv) = K.make_data(3, 256)
    with torch.no_grad():
        loss = F.cross_entropy(model.eval()(xv), yv).item()
    assert loss == pytest.approx(res[0]["bn_plain_w2"]["val_loss"], rel=1e-6)


# ---------------------------------------------------------------------------------------------
# --comm-hook
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("hook", ["fp16", "bf16", "powersgd"])
def test_training_with_a_comm_hook_still_learns_with_identical_ranks(runs, hook):
    _, res = runs
    a, b = res[0][f"hook_{hook}"], res[1][f"hook_{hook}"]
    assert a["step"] == 60
    assert a["loss"] < 0.6 * math.log(10), a["loss"]  # from ~ln(10) = 2.30 at the start
    assert a["val_acc"] > 0.5, a["val_acc"]
    _assert_equal(a["model"], b["model"])  # every rank applied the same (decompressed) gradients


def test_fp16_and_bf16_hooks_carry_half_the_bytes(runs):
    """Counted on every all-reduce: without a hook one step all-reduces each fp32 gradient once
    (4 bytes per parameter, in several buckets at --bucket-cap-mb 0.01); fp16 and bf16 send the
    same buckets at 2 bytes per parameter. The lesson's own grad_comm figure says the same."""
    for res in (runs[1][0]["bytes"], runs[1][1]["bytes"]):
        n, none = res["none"]["params"], res["none"]["steps"]
        assert all(b == 4 * n for b, _ in none) and none[-1][1] >= 2, none  # several buckets
        assert res["none"]["lesson"] == 4 * n
        for hook in ("fp16", "bf16"):
            assert [b for b, _ in res[hook]["steps"]] == [2 * n] * 5, (hook, res[hook])
            assert [c for _, c in res[hook]["steps"]][1:] == [c for _, c in none][
                1:
            ]  # same buckets
            assert res[hook]["lesson"] == 2 * n


def test_powersgd_sends_plain_gradients_during_warm_up_then_under_a_tenth(runs):
    for res in (runs[1][0]["bytes"], runs[1][1]["bytes"]):
        n, steps = res["powersgd"]["params"], res["powersgd"]["steps"]
        assert [b for b, _ in steps[:2]] == [4 * n] * 2, steps  # --powersgd-warmup 2
        assert all(0 < b < 0.1 * 4 * n for b, _ in steps[2:]), steps  # rank-1 factors
        assert res["powersgd"]["lesson"] == steps[-1][0]


# ---------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------
def test_torchrun_with_every_knob_saves_a_full_resumable_checkpoint(readme_run):
    """The README's lesson-7 command (torchrun, 2 ranks, --zero --sync-bn --comm-hook powersgd):
    its checkpoint holds the whole optimizer state (gathered from the ZeRO shards) and each
    rank's PowerSGD state."""
    r = readme_run("ddp_knobs.py --zero")
    assert_ok(r)
    done = [line for line in r.stdout.splitlines() if line.startswith("done:")]
    assert len(done) == 1 and "| world 2 |" in done[0] and " MiB/rank |" in done[0], r.stdout
    steps = int(re.search(r"\| steps (\d+) \|", done[0]).group(1))
    ckpt = torch.load(r.cwd / "checkpoints" / "last.pt", weights_only=True)
    assert ckpt["step"] == steps and len(ckpt["powersgd"]) == 2
    # A state for every parameter, none for the buffers (2 BatchNorm layers, 3 buffers each).
    assert len(ckpt["optimizer"]["state"]) == len(ckpt["model"]) - 2 * 3


def test_resume_stops_with_one_line_when_only_some_ranks_see_the_checkpoint(runs):
    """Node-local checkpoint dirs where only rank 0's holds last.pt: every rank must resume from
    the same state, so all stop (exit 2, one line from rank 0) instead of rank 1 starting fresh
    (replicas that differ, then a hang). Where no rank sees the file, all start fresh."""
    for rank in (0, 1):
        res = runs[1][rank]["resume"]
        assert res["fresh"] is None and res["code"] == 2, res
        errs = [line for line in res["stderr"].splitlines() if line.startswith("error:")]
        assert errs == (
            [
                "error: checkpoint %s is missing on 1 of 2 ranks: every rank must read it "
                "(use a shared --checkpoint-dir or copy it)" % res["path"]
            ]
            if rank == 0
            else []
        )


@pytest.mark.parametrize(
    "flags",
    [
        ["--comm-hook", "int8"],
        ["--powersgd-warmup", "1"],
        ["--powersgd-rank", "0"],
        ["--bucket-cap-mb", "0"],
        ["--optimizer", "lamb"],
        ["--batch-size", "0"],
        ["--lr", "0"],
        ["--max-steps", "-1"],
    ],
)
def test_bad_flags_exit_2_with_one_error_line(flags, capsys):
    with pytest.raises(SystemExit) as e:
        K.parse_args(flags)
    assert e.value.code == 2
    assert len([line for line in capsys.readouterr().err.splitlines() if "error:" in line]) == 1


def test_one_powersgd_hook_rule_in_both_lessons():
    """The gloo-safe PowerSGD hook is written once, in ddp_extras, and both lessons use it."""
    assert ddp_benchmark.powersgd_hook is K.powersgd_hook is ddp_extras.powersgd_hook


def test_bad_flag_from_the_command_line():
    r = run([sys.executable, ROOT / "ddp_knobs.py", "--comm-hook", "int8"], timeout=60)
    assert len(assert_clean_failure(r, code=2)) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_zero_fused_adamw_resumes(tmp_path):
    """On a GPU: fused AdamW under ZeRO, saved, resumed, stepped (crashed before the fix)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_", "MASTER_"))}
    flags = ["--zero", "--optimizer", "adamw", "--epochs", "1", "--checkpoint-dir", tmp_path]
    assert_ok(run_torchrun("ddp_knobs.py", *flags, "--max-steps", "4", nproc=1, env=env))
    assert_ok(
        run_torchrun(
            "ddp_knobs.py", *flags, "--max-steps", "8", "--resume", "auto", nproc=1, env=env
        )
    )
