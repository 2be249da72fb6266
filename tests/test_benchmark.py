"""Lesson 6 (ddp_benchmark.py, benchmark_extras.py): the formulas against hand-computed values and
the report against a hand-made sweep (efficiency, the breakdown's differences, busbw, the noise
rule, the warnings); the README's run (mp.spawn on gloo, 1 and 2 processes) and two more real
sweeps must write complete, positive, self-consistent records, and the all-reduce sweep must end
at the bytes DDP really sends per step."""

import argparse
import gc
import json
import math
import os
import sys
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import assert_clean_failure, assert_ok, run, run_python
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import benchmark_extras as extras
import ddp_benchmark as bench

TIMEOUT = 240  # a sweep takes ~15-25 s on a quiet 2-core machine, far more on a busy one
CPU = torch.device("cpu")
MNIST_PARAMS = 215_370  # lesson 1's CNN


# ---------------------------------------------------------------- formulas and report, by hand


def test_formulas_against_hand_values():
    assert extras.efficiency(180.0, 100.0, 2) == pytest.approx(0.9)
    assert extras.efficiency(400.0, 100.0, 4) == pytest.approx(1.0)
    assert extras.efficiency(300.0, 100.0, 4) == pytest.approx(0.75)
    assert extras.busbw(10.0, 2) == pytest.approx(10.0)  # 2(n-1)/n = 1 for two ranks
    assert extras.busbw(10.0, 4) == pytest.approx(15.0)  # 2*3/4 = 1.5
    assert extras.busbw(8.0, 8) == pytest.approx(14.0)  # 2*7/8 = 1.75
    assert extras.busbw(10.0, 1) == 0  # one rank moves nothing
    assert [bench.world_sizes(n) for n in (1, 2, 6, 8)] == [[1], [1, 2], [1, 2, 4, 6], [1, 2, 4, 8]]
    s = extras.step_stats([0.4, 0.1, 0.3, 0.2, 0.5], global_batch=8)
    assert s["step_ms_p50"] == pytest.approx(300.0)
    assert s["step_ms_p90"] == pytest.approx(460.0)  # position 3.6: 0.4 + 0.6 * (0.5 - 0.4)
    assert s["samples_per_s"] == pytest.approx(8 * 5 / 1.5)  # 5 steps x 8 samples in 1.5 s
    assert s["rounds_ms"] == pytest.approx([400, 100, 300, 200, 500])  # one step per round
    ten = extras.step_stats([0.1, 0.3] * 5, 1)["rounds_ms"]  # two steps per round: their median
    assert ten == pytest.approx([200] * 5)


def raw_point(times_ms, threads=1, batch=8, allreduce=()):
    """A worker's raw result, made by hand: step times in ms by variant (10 steps each)."""
    times = {name: [t / 1000 for t in steps] for name, steps in times_ms.items()}
    return {
        "times": times,
        "allreduce": list(allreduce),
        "batch_per_rank": batch,
        "threads": threads,
    }


def steps(per_round):
    """10 steps, 2 per round, each round's two steps at its given time (ms)."""
    return [t for t in per_round for _ in range(2)]


ARGS = argparse.Namespace(model="mnist", strong=False, bucket_cap_mb=[25.0], json=None, plot=None)
MACHINE = {"name": "test", "cores": 2, "torch": "x", "backend": "gloo"}


def test_report_computes_efficiency_the_breakdown_and_the_noise_rule(capsys):
    """A hand-made sweep: every figure the report prints follows from the step times by the
    formulas the docs give; a difference whose rounds disagree on the sign says (noise)."""
    one = raw_point(
        {
            "unwrapped": steps([100, 100, 100, 100, 100]),
            # Every round 5 ms slower: a real cost.
            "ddp_no_sync": steps([105, 105, 105, 105, 105]),
            # Against ddp_no_sync the rounds disagree (+1, -1, ...): noise, though the medians
            # differ by 1 ms (106 - 105); against unwrapped they agree (+6, +4, ...): real.
            "ddp 25": steps([106, 104, 106, 106, 104]),
            # Faster than ddp_no_sync in every round: a real difference, though a negative one.
            "ddp 0": steps([103, 103, 103, 103, 103]),
        }
    )
    two = raw_point(
        {
            "unwrapped": steps([100, 100, 100, 100, 100]),
            "ddp_no_sync": steps([101, 99, 100, 101, 99]),
            "ddp 25": steps([125, 125, 125, 125, 125]),
            "ddp 0": steps([130, 130, 130, 130, 130]),
        },
        threads=2,
        allreduce=[(4096, 0.001), (861480, 0.002)],
    )
    args = argparse.Namespace(**{**vars(ARGS), "bucket_cap_mb": [25.0, 0.0]})
    scaling = extras.report(args, MACHINE, {1: one, 2: two})
    out = capsys.readouterr().out
    s1, s2 = scaling
    # samples/s: all the samples over all the time: 10 steps x 8 samples in 1.052 s.
    assert s1["samples_per_s"] == pytest.approx(80 / 1.052)
    assert s2["samples_per_s"] == pytest.approx(160 / 1.25)  # 2 ranks x 8, 10 steps, 1.25 s
    assert s2["speedup"] == pytest.approx((160 / 1.25) / (80 / 1.052))
    assert s2["efficiency"] == pytest.approx((160 / 1.25) / (2 * 80 / 1.052))  # 84.2%
    assert "world_size 2 | threads_per_rank 2 | oversubscribed True" in out  # 2 x 2 > 2 cores
    lines = [line for line in out.splitlines() if line.startswith("world_size")]
    assert (
        "world_size 1 | variant ddp_no_sync | step_ms_p50 105 | step_ms_p90 105 | wrapper_ms 5"
        in lines
    )
    assert (
        "world_size 1 | variant ddp | bucket_cap_mb 25 | step_ms_p50 106 | step_ms_p90 106 | "
        "exposed_comm_ms 1 (noise) | overhead_pct 6" in lines
    )
    assert (
        "world_size 1 | variant ddp | bucket_cap_mb 0 | step_ms_p50 103 | step_ms_p90 103 | "
        "exposed_comm_ms -2 | overhead_pct 3" in lines
    )
    assert (
        "world_size 2 | variant ddp_no_sync | step_ms_p50 100 | step_ms_p90 101 | "
        "wrapper_ms 0 (noise)" in lines
    )
    assert (
        "world_size 2 | variant ddp | bucket_cap_mb 25 | step_ms_p50 125 | step_ms_p90 125 | "
        "exposed_comm_ms 25 | overhead_pct 25" in lines
    )
    # The scaling lines are the first bucket size's (25), not the last one's.
    assert [r["bucket_cap_mb"] for r in scaling] == [25.0, 25.0]
    # busbw = algbw x 2(n-1)/n: equal at two ranks; algbw = bytes / time.
    assert (
        "world_size 2 | bytes 861480 | time_us 2000 | algbw_gbps 0.4307 | busbw_gbps 0.4307"
        in lines
    )
    assert "warning:" not in out


def test_the_report_warns_when_more_processes_came_out_more_than_linear(capsys):
    """World sizes run one after another: 2 processes at 3x the rate of one means the machine got
    quieter (or busier while world size 1 ran), not that DDP works miracles."""
    flat = {name: steps([100] * 5) for name in ("unwrapped", "ddp_no_sync", "ddp 25")}
    fast = {name: steps([60] * 5) for name in flat}
    extras.report(ARGS, MACHINE, {1: raw_point(flat), 2: raw_point(fast)})
    warnings = [line for line in capsys.readouterr().out.splitlines() if "warning:" in line]
    assert len(warnings) == 1 and "world size [2]" in warnings[0], warnings


# ---------------------------------------------------------------- real sweeps


def numbers(record):
    return {
        k: v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
    }


DIFFERENCES = {"wrapper_ms", "exposed_comm_ms", "overhead_pct"}  # measured differences: any sign


def check_report(report, threads, grad_bytes=4 * MNIST_PARAMS):
    """What every sweep's JSON must satisfy: positive, finite records; speed-up, efficiency and
    the breakdown follow from the measured times; the noise marks from the rounds; the all-reduce
    sweep runs from 4 KiB up to one step's gradients."""
    machine, config = report["machine"], report["config"]
    assert machine["backend"] == "gloo" and machine["cores"] >= 1
    assert machine["torch"] == torch.__version__ and machine["name"]
    scaling, breakdown, allreduce = report["scaling"], report["breakdown"], report["allreduce"]
    sizes = sorted(threads)
    assert [r["world_size"] for r in scaling] == sizes
    for rec in scaling + breakdown:
        n = rec["world_size"]
        assert rec["threads_per_rank"] == threads[n]
        assert rec["oversubscribed"] == (n * threads[n] > machine["cores"])
        assert rec["global_batch"] == rec["batch_per_rank"] * n
        assert len(rec["rounds_ms"]) == 5
    for rec in scaling + breakdown + allreduce:
        for key, value in numbers(rec).items():
            assert math.isfinite(value), (key, rec)
            assert value > 0 or key in DIFFERENCES or (key, value) == ("bucket_cap_mb", 0), rec
    one = scaling[0]
    assert one["speedup"] == pytest.approx(1.0) and one["efficiency"] == pytest.approx(1.0)
    for r in scaling:
        n = r["world_size"]
        assert r["speedup"] == pytest.approx(r["samples_per_s"] / one["samples_per_s"])
        assert r["efficiency"] == pytest.approx(r["samples_per_s"] / (n * one["samples_per_s"]))
        assert r["step_ms_p90"] >= r["step_ms_p50"]
    caps = config["bucket_cap_mb"]
    for n in sizes:
        rows = {
            (r["variant"], r.get("bucket_cap_mb")): r for r in breakdown if r["world_size"] == n
        }
        assert sorted(rows, key=str) == sorted(
            [("unwrapped", None), ("ddp_no_sync", None)] + [("ddp", c) for c in caps], key=str
        )
        compute, no_sync = rows[("unwrapped", None)], rows[("ddp_no_sync", None)]
        assert no_sync["wrapper_ms"] == pytest.approx(
            no_sync["step_ms_p50"] - compute["step_ms_p50"]
        )
        check_noise(no_sync, compute, "wrapper_ms")
        for c in caps:
            d = rows[("ddp", c)]
            assert d["exposed_comm_ms"] == pytest.approx(d["step_ms_p50"] - no_sync["step_ms_p50"])
            overhead = 100 * (d["step_ms_p50"] - compute["step_ms_p50"]) / compute["step_ms_p50"]
            assert d["overhead_pct"] == pytest.approx(overhead)
            check_noise(d, no_sync, "exposed_comm_ms")
            check_noise(d, compute, "overhead_pct")
        # the scaling row is the DDP row with the first bucket size
        assert scaling[sizes.index(n)]["step_ms_p50"] == rows[("ddp", caps[0])]["step_ms_p50"]
    expected = [b for b in (4096, 16384, 65536, 262144, 1048576) if b < grad_bytes] + [grad_bytes]
    for n in sizes[1:]:  # all-reduce bandwidth: from world size 2 on
        rows = [r for r in allreduce if r["world_size"] == n]
        assert [r["bytes"] for r in rows] == expected
        for r in rows:
            assert r["algbw_gbps"] == pytest.approx(r["bytes"] / (r["time_us"] * 1e-6) / 1e9)
            assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * 2 * (n - 1) / n)
    assert not [r for r in allreduce if r["world_size"] == 1]


def check_noise(slower, faster, key):
    per_round = [a - b for a, b in zip(slower["rounds_ms"], faster["rounds_ms"], strict=True)]
    agree = all(d > 0 for d in per_round) or all(d < 0 for d in per_round)
    assert (key in slower["noise"]) == (not agree), (key, per_round, slower["noise"])


def test_the_readme_sweep_writes_consistent_records_and_a_plot(readme_run):
    """The README's command: weak scaling, 1 thread per rank, JSON and plot; what it measured,
    never a verdict: no pass/fail line."""
    result = readme_run("python ddp_benchmark.py")
    assert_ok(result)
    report = json.loads((result.cwd / "bench.json").read_text())
    check_report(report, threads={1: 1, 2: 1})
    assert [x["batch_per_rank"] for x in report["scaling"]] == [32, 32]  # weak: per rank fixed
    assert [x["global_batch"] for x in report["scaling"]] == [32, 64]
    out = result.stdout.splitlines()
    assert not [line for line in out if "PASS" in line or "MISS" in line]
    for section in ("start:", "scaling |", "breakdown |", "all-reduce |", "done:"):
        assert [line for line in out if line.startswith(section)], (section, result.stdout)
    assert (result.cwd / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_strong_sweep_default_threads_two_bucket_sizes_without_sched_getaffinity(tmp_path):
    """Strong scaling, the default threads, bucket sizes 25 and 0 (one bucket per tensor); run
    with os.sched_getaffinity removed, as on macOS: the cores come from os.cpu_count()."""
    out = tmp_path / "bench.json"
    code = (
        "import os, runpy; del os.sched_getaffinity; "
        "runpy.run_path('ddp_benchmark.py', run_name='__main__')"
    )
    flags = ["--max-procs", "2", "--strong", "--batch-size", "8", "--bucket-cap-mb", "25", "0"]
    flags += ["--steps", "5", "--warmup", "1", "--json", out]
    result = run([sys.executable, "-c", code, *flags], timeout=TIMEOUT)
    assert_ok(result)
    report = json.loads(out.read_text())
    cores = os.cpu_count()
    assert report["machine"]["cores"] == cores
    check_report(report, threads={1: max(1, cores), 2: max(1, cores // 2)})
    assert [x["batch_per_rank"] for x in report["scaling"]] == [8, 4]  # strong: global fixed
    assert [x["global_batch"] for x in report["scaling"]] == [8, 8]


def test_the_resnets_are_torchvisions_with_imagenet_sized_batches():
    """--model resnet18/resnet50: torchvision's, random weights (no download), 224 px images; the
    rest of the sweep is the same code as for the CNN."""
    for name, params in (("resnet18", 11_689_512), ("resnet50", 25_557_032)):
        model, (x, y) = extras.model_and_batch(name, 2, CPU, rank=1)
        assert sum(p.numel() for p in model.parameters()) == params
        assert x.shape == (2, 3, 224, 224) and y.shape == (2,)


@pytest.fixture
def one_rank_group():
    """A one-process gloo group in the test process (an in-memory store: no port)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    gc.collect()  # DDP wrappers sit in reference cycles: free them before the group
    dist.destroy_process_group()


def test_the_largest_all_reduce_is_what_ddp_sends_per_step(one_rank_group):
    """The all-reduce sweep ends at 4 bytes a parameter: counted here, it is what DDP hands to
    dist.all_reduce in one step (its buckets, fp32), whatever the bucket size."""
    model, (x, y) = extras.model_and_batch("mnist", 4, CPU, rank=0)
    assert sum(p.numel() for p in model.parameters()) == MNIST_PARAMS
    for cap in (25, 0.1, 0):
        # The lesson's own wrap (cap 0: a bucket per tensor).
        ddp = bench.wrap(model, CPU, cap)
        # DDP's own all-reduce runs in C++; allreduce_hook is its Python twin (same buckets).
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        for _ in range(2):  # DDP rebuilds its buckets after the first step
            F.cross_entropy(ddp(x), y).backward()
        with mock.patch.object(dist, "all_reduce", wraps=dist.all_reduce) as spy:
            F.cross_entropy(ddp(x), y).backward()
        assert sum(call.args[0].nbytes for call in spy.call_args_list) == 4 * MNIST_PARAMS


# ---------------------------------------------------------------- mistakes


@pytest.mark.parametrize(
    "args,env",
    [
        (["--no-such-flag"], {}),
        (["--bucket-cap-mb", "25", "abc"], {}),
        (["--bucket-cap-mb", "25", "-1"], {}),
        (["--steps", "4"], {}),  # fewer than the 5 rounds
        (["--threads", "0"], {}),
        (["--model", "resnet7"], {}),
        (["--plot", "scaling.txt"], {}),
        (["--strong", "--batch-size", "3", "--max-procs", "2"], {}),  # 3 does not split over 2
        ([], {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}),  # launched by torchrun
        pytest.param(
            ["--backend", "nccl"],
            {},
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="GPU"),
        ),
    ],
)
def test_bad_flags_give_one_error_line(args, env, capsys, monkeypatch):
    """Refused before any worker starts: one `error:` line, exit 2."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "argv", ["ddp_benchmark.py", *args])
    with pytest.raises(SystemExit) as exit_:
        bench.main()
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), err


def test_a_mistake_on_the_command_line_is_one_line_and_no_traceback():
    r = run_python("ddp_benchmark.py", "--bucket-cap-mb", "big", timeout=TIMEOUT)
    assert len(assert_clean_failure(r, code=2)) == 1 and len(r.stderr.strip().splitlines()) == 1, (
        r.stderr
    )
