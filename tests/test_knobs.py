"""Issue 9: DDP's advanced knobs in ddp_training.py (--zero, --sync-bn, --comm-hook) and their
sweep in ddp_benchmark.py. Real processes on gloo/CPU: training scenarios run
ddp_training.main() inside mp.spawn workers (as in test_training.py); the byte counts use
ddp_benchmark.CommCounter around real DDP steps; the sweep runs the benchmark script."""
import gc
import json
import math
import os
import sys

import pytest
import torch

from conftest import ROOT, assert_clean_failure, init_spawned, run, run_python, spawn, free_port
from test_benchmark import TIMEOUT, check_report
from test_training import EQ, TINY, _launch_env, _tensors

# name -> (world size, extra flags). TINY: 100 synthetic samples, 80 train (40 per rank).
ADAMW = EQ + ["--optimizer", "adamw", "--lr", "0.003", "--batch-size", "8"]
SGD = EQ + ["--optimizer", "sgd", "--lr", "0.05", "--batch-size", "8"]
# A small LR for the BatchNorm net: BN over 8-sample batches makes it sensitive, and the ~1e-6
# rounding differences of a different summation order grow with the LR (to ~5e-3 of the distance
# trained after 10 steps at lr 0.05, ~6e-6 at 0.002; plain BN differs by ~0.3 at 0.002).
BN = EQ + ["--model", "cnn-bn", "--optimizer", "sgd", "--lr", "0.002"]
RESUME = ["--epochs", "3", "--batch-size", "5", "--accum-steps", "2", "--optimizer", "adamw", "--zero"]
HOOK = ["--subset", "400", "--epochs", "3", "--lr", "0.05", "--batch-size", "8", "--clip-grad", "1",
        "--verify-sync", "10"]
SCENARIOS = {
    # ZeRO-1 against the unsharded optimizer (2 ranks each)
    "adamw": (2, ADAMW),
    "adamw_zero": (2, ADAMW + ["--zero"]),
    "sgd": (2, SGD),
    "sgd_zero": (2, SGD + ["--zero"]),
    # ZeRO resume: 12 steps straight vs 6 (inside epoch 2) + --resume auto
    "zstraight": (2, RESUME),
    "zhalf": (2, RESUME + ["--max-steps", "6"]),
    "zrest": (2, RESUME + ["--resume", "auto"]),
    # BatchNorm: 2 ranks x 8 with SyncBN, 1 x 16, and 2 ranks x 8 with plain BN
    "bn_sync_w2": (2, BN + ["--batch-size", "8", "--sync-bn"]),
    "bn_w1": (1, BN + ["--batch-size", "16"]),
    "bn_plain_w2": (2, BN + ["--batch-size", "8"]),
    # communication hooks on the small task (320 train samples, 60 steps)
    "hook_fp16": (2, HOOK + ["--comm-hook", "fp16"]),
    "hook_bf16": (2, HOOK + ["--comm-hook", "bf16"]),
    "hook_powersgd": (2, HOOK + ["--comm-hook", "powersgd", "--powersgd-warmup", "5",
                                 "--powersgd-rank", "1", "--bucket-cap-mb", "0.02"]),
}
DIRS = {"zhalf": "zresume", "zrest": "zresume"}  # the two halves share one checkpoint dir


def _scenario_worker(rank, world, port, out, ports):
    import ddp_training
    results = {}
    for name, (size, flags) in SCENARIOS.items():
        if rank >= size:
            continue
        _launch_env(rank, size, ports[name])
        argv = TINY + flags + ["--checkpoint-dir", os.path.join(out, DIRS.get(name, name)),
                               "--data-dir", os.path.join(out, "nodata")]
        results[name] = ddp_training.main(argv)
    torch.save(results, os.path.join(out, f"results{rank}.pt"))


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory):
    out = tmp_path_factory.mktemp("knobs")
    spawn(_scenario_worker, 2, str(out), {name: free_port() for name in SCENARIOS})
    results = [torch.load(out / f"results{r}.pt", weights_only=True) for r in range(2)]
    return out, results


def _ckpt(out, name):
    return torch.load(os.path.join(out, DIRS.get(name, name), "last.pt"), weights_only=True)


def _init(model="cnn"):
    import ddp_training
    torch.manual_seed(3)  # --seed 3 (TINY): the initial weights of every run
    return ddp_training.build_model(model).state_dict()


def _relative_gaps(a, b, init):
    """{name: |a - b| / how far b moved from init} over the trained parameters."""
    gaps = {}
    for name, pb in b.items():
        if not pb.is_floating_point() or name.endswith(("running_mean", "running_var")):
            continue
        moved = float((pb - init[name]).norm())
        assert moved > 1e-3, f"{name} did not train"
        gaps[name] = float((a[name] - pb).norm()) / moved
    return gaps


# ---------------------------------------------------------------------------------------------
# --zero
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("optim", ["adamw", "sgd"])
def test_zero_holds_about_half_the_optimizer_state_per_rank(scenarios, optim):
    """AdamW keeps two moments per parameter, SGD one momentum buffer: with ZeRO-1 on 2 ranks each
    rank holds its shard's share, together exactly the unsharded state, neither much over half."""
    _, results = scenarios
    full = [results[r][optim]["opt_state_bytes"] for r in range(2)]
    shard = [results[r][f"{optim}_zero"]["opt_state_bytes"] for r in range(2)]
    n_params = sum(p.numel() for p in _init().values())
    per_param = 2 if optim == "adamw" else 1  # float32 tensors per parameter
    assert full[0] == full[1] >= per_param * 4 * n_params  # (+ AdamW's step counters)
    assert shard[0] + shard[1] == full[0]
    assert max(shard) <= 0.6 * full[0] and min(shard) > 0, (shard, full)


@pytest.mark.parametrize("optim", ["adamw", "sgd"])
def test_zero_matches_the_unsharded_optimizer(scenarios, optim):
    """Same 10 steps with and without ZeRO: the same weights and the same (consolidated) optimizer
    state in the checkpoint. Each parameter is updated by the same optimizer arithmetic, only on
    one rank, and broadcast: the results agree to float rounding (in practice bitwise)."""
    out, _ = scenarios
    plain, zero = _ckpt(out, optim), _ckpt(out, f"{optim}_zero")
    assert plain["step"] == zero["step"] == 10
    gaps = _relative_gaps(zero["model"], plain["model"], _init())
    assert max(gaps.values()) < 1e-6, gaps
    a, b = _tensors(plain["optimizer"]["state"]), _tensors(zero["optimizer"]["state"])
    assert a.keys() == b.keys() and a  # the consolidated dict has every parameter's state
    for key in a:
        assert torch.allclose(a[key].double(), b[key].double(), rtol=1e-6, atol=1e-9), key
    assert plain["optimizer"]["param_groups"][0]["lr"] == zero["optimizer"]["param_groups"][0]["lr"]


def test_zero_resume_continues_bitwise(scenarios):
    """--zero: 12 steps straight == 6 steps + --resume auto. The checkpoint holds the full
    consolidated state (rank 0 saved it after consolidate_state_dict on every rank); each rank
    loads it and keeps its shard."""
    out, results = scenarios
    assert results[0]["zhalf"]["step"] == 6 and results[0]["zhalf"]["epoch_step"] == 2
    straight, resumed = _ckpt(out, "zstraight"), _ckpt(out, "zrest")
    assert straight["step"] == resumed["step"] == 12
    for name, p in straight["model"].items():
        assert torch.equal(p, resumed["model"][name]), name
    a, b = _tensors(straight["optimizer"]), _tensors(resumed["optimizer"])
    assert a.keys() == b.keys() and len(a) >= 2 * 8  # two moments (+ step) for 8 tensors
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert straight["scheduler"] == resumed["scheduler"]


# ---------------------------------------------------------------------------------------------
# --sync-bn
# ---------------------------------------------------------------------------------------------
BOUND = 1e-4  # as test_training's SGD equivalence: float sums in another order leave ~1e-6


def test_sync_bn_two_ranks_equal_one_process_with_the_global_batch(scenarios):
    """SyncBN normalises with the statistics of the GLOBAL batch, so 2 ranks x 8 take the same
    steps as 1 process x 16: weights, and the BN running statistics too."""
    out, _ = scenarios
    two, one = _ckpt(out, "bn_sync_w2"), _ckpt(out, "bn_w1")
    assert two["step"] == one["step"] == 10
    assert two["model"].keys() == one["model"].keys()  # SyncBN keeps BatchNorm's keys
    gaps = _relative_gaps(two["model"], one["model"], _init("cnn-bn"))
    assert max(gaps.values()) < BOUND, gaps
    for name, b in one["model"].items():
        if name.endswith(("running_mean", "running_var")):
            assert torch.allclose(two["model"][name], b, rtol=1e-4, atol=1e-6), name
        elif name.endswith("num_batches_tracked"):
            assert int(two["model"][name]) == int(b) == 10


def test_plain_bn_breaks_the_equivalence(scenarios):
    """Without SyncBN each rank normalises with its own 8 samples' statistics: the same global
    batch gives different gradients, and the runs drift apart far beyond the tolerance."""
    out, _ = scenarios
    two, one = _ckpt(out, "bn_plain_w2"), _ckpt(out, "bn_w1")
    gaps = _relative_gaps(two["model"], one["model"], _init("cnn-bn"))
    assert max(gaps.values()) > 100 * BOUND, gaps


# ---------------------------------------------------------------------------------------------
# --comm-hook
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("hook", ["fp16", "bf16", "powersgd"])
def test_training_with_a_comm_hook_still_learns(scenarios, hook):
    out, results = scenarios
    res = results[0][f"hook_{hook}"]
    assert res["step"] == 60
    assert res["loss"] < 0.6 * math.log(10), res  # from ~ln(10) = 2.30 at the start
    assert res["val_acc"] > 0.5, res
    # (--verify-sync 10 checked every 10 steps that all ranks still hold identical weights)


def _bytes_worker(rank, world, port, out):
    ddp = init_spawned(rank, world, port)
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    import ddp_benchmark
    import ddp_training as T
    results = {}
    for hook in ("none", "fp16", "bf16", "powersgd"):
        args = T.parse_args(["--model", "cnn", "--comm-hook", hook, "--bucket-cap-mb", "0.02",
                             "--powersgd-warmup", "2", "--powersgd-rank", "1"])
        torch.manual_seed(0)
        model = T.build_model("cnn")
        ddp_model = T.wrap_model(model, args, ddp)
        if hook == "none":  # the built-in all-reduce runs in C++: count its Python twin
            ddp_model.register_comm_hook(None, default_hooks.allreduce_hook)
        opt = T.build_optimizer(ddp_model, args, 0.01, ddp.device)
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        g = torch.Generator().manual_seed(rank)
        counts = []
        for _ in range(5):
            micro = [(torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 10, (4,), generator=g))]
            with ddp_benchmark.CommCounter() as counter:
                T.train_step(ddp_model, ddp_model, opt, scaler, micro, None, 0.0)
            counts.append((counter.bytes, counter.calls))
        results[hook] = counts
        results["params"] = sum(p.numel() for p in model.parameters())
        del ddp_model, opt
        gc.collect()
    torch.save(results, os.path.join(out, f"bytes{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def comm_bytes(tmp_path_factory):
    out = tmp_path_factory.mktemp("bytes")
    spawn(_bytes_worker, 2, str(out))
    return [torch.load(out / f"bytes{r}.pt", weights_only=False) for r in range(2)]


def test_fp16_and_bf16_hooks_halve_the_bytes_each_all_reduce_carries(comm_bytes):
    """Counted on every all-reduce the hooks issue: without compression one step all-reduces each
    fp32 gradient once (4 bytes per parameter, in several buckets at --bucket-cap-mb 0.02); fp16
    and bf16 send the same buckets at 2 bytes per parameter."""
    for res in comm_bytes:
        n = res["params"]
        none = res["none"]
        assert all(b == 4 * n for b, _ in none), none
        assert none[-1][1] >= 2  # several buckets, one all-reduce each
        for hook in ("fp16", "bf16"):
            assert [b for b, _ in res[hook]] == [2 * n] * 5, (hook, res[hook])
            assert [c for _, c in res[hook]][1:] == [c for _, c in none][1:]  # same buckets


def test_powersgd_sends_plain_gradients_during_warm_up_then_far_fewer_bytes(comm_bytes):
    for res in comm_bytes:
        n, steps = res["params"], res["powersgd"]
        assert [b for b, _ in steps[:2]] == [4 * n] * 2, steps  # --powersgd-warmup 2
        assert all(0 < b < 0.1 * 4 * n for b, _ in steps[2:]), steps  # rank-1 factors


# ---------------------------------------------------------------------------------------------
# The benchmark sweep: hook x bucket size
# ---------------------------------------------------------------------------------------------
def test_benchmark_sweeps_hooks_and_bucket_sizes(tmp_path):
    out = tmp_path / "bench.json"
    r = run_python("ddp_benchmark.py", "--quick", "--max-procs", "2", "--threads", "1", "--json", out,
                   "--comm-hook", "none,bf16,powersgd", "--bucket-cap-mb", "25,0.1", timeout=TIMEOUT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [l for l in r.stdout.splitlines() if l.startswith("done:")]
    report = json.loads(out.read_text())
    assert report["config"]["comm_hook"] == ["none", "bf16", "powersgd"]
    # The no-hook rows are the benchmark's usual report, with all its consistency checks.
    plain = [x for x in report["breakdown"] if x.get("comm_hook", "none") == "none"]
    check_report({**report, "breakdown": plain}, threads={1: 1, 2: 1})
    assert all(x["comm_hook"] == "none" for x in report["scaling"])
    n_params = report["scaling"][0]["params"]
    for n in (1, 2):
        rows = {(x["comm_hook"], x["bucket_cap_mb"]): x for x in report["breakdown"]
                if x["world_size"] == n and x["variant"] == "ddp"}
        assert sorted(rows) == sorted((h, c) for h in ("none", "bf16", "powersgd") for c in (25, 0.1))
        for (hook, cap), x in rows.items():
            expected = {"none": 4 * n_params, "bf16": 2 * n_params}.get(hook)
            if expected:
                assert x["comm_bytes_per_step"] == expected, (hook, cap, x)
            else:
                assert 0 < x["comm_bytes_per_step"] < 0.25 * 4 * n_params, x
            assert x["peak_mem_mib"] > 0 and x["peak_mem_kind"].startswith("process peak RSS")
            assert x["step_ms_p50"] > 0 and math.isfinite(x["exposed_comm_ms"])


# ---------------------------------------------------------------------------------------------
# Mistakes
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flags", [["--model", "cnn", "--sync-bn"], ["--powersgd-warmup", "1"],
                                   ["--comm-hook", "int8"], ["--powersgd-rank", "0"]])
def test_training_bad_knob_flags_exit_2_with_one_error_line(flags):
    r = run([sys.executable, ROOT / "ddp_training.py", *flags], timeout=TIMEOUT)
    assert r.returncode == 2
    assert len([l for l in r.stderr.splitlines() if "error:" in l]) == 1 and "Traceback" not in r.stderr


@pytest.mark.parametrize("flags", [["--comm-hook", "none,fp8"], ["--powersgd-warmup", "1"]])
def test_benchmark_bad_knob_flags_exit_2_with_one_error_line(flags):
    r = run_python("ddp_benchmark.py", *flags, timeout=TIMEOUT)
    assert len(assert_clean_failure(r, code=2)) == 1, r.stderr
