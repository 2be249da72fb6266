"""Lesson 6 (ddp_benchmark.py): the formulas against hand-computed values, and real quick sweeps
(mp.spawn on gloo, 1 and 2 processes) that must write complete, positive, self-consistent JSON."""
import json
import math
import os

import pytest

import ddp_benchmark as bench
from conftest import assert_clean_failure, assert_ok, cpu_env, run_python

TIMEOUT = 240  # quick sweeps take ~40 s on a busy 2-core machine; generous headroom


# ---------------------------------------------------------------- formulas, by hand

def test_percentile_interpolates_like_numpy():
    assert bench.percentile([1, 2, 3, 4], 50) == pytest.approx(2.5)
    assert bench.percentile([4, 1, 3, 2], 90) == pytest.approx(3.7)  # pos 2.7: 3 + 0.7 * (4 - 3)
    assert bench.percentile([3, 1, 2], 50) == 2
    assert bench.percentile([7.0], 90) == 7.0
    assert bench.percentile([10, 20], 0) == 10 and bench.percentile([10, 20], 100) == 20


def test_bandwidth_formulas():
    assert bench.algbw(1e9, 0.5) == pytest.approx(2e9)          # 1 GB in 0.5 s
    assert bench.busbw(10.0, 2) == pytest.approx(10.0)          # 2(n-1)/n = 1 for two ranks
    assert bench.busbw(10.0, 4) == pytest.approx(15.0)          # 2*3/4 = 1.5
    assert bench.busbw(8.0, 8) == pytest.approx(14.0)           # 2*7/8 = 1.75
    assert bench.busbw(10.0, 1) == 0                             # one rank moves nothing


def test_speedup_and_efficiency():
    assert bench.speedup(180.0, 100.0) == pytest.approx(1.8)
    assert bench.efficiency(180.0, 100.0, 2) == pytest.approx(0.9)
    assert bench.efficiency(400.0, 100.0, 4) == pytest.approx(1.0)
    assert bench.efficiency(300.0, 100.0, 4) == pytest.approx(0.75)


def test_step_stats():
    s = bench.step_stats([0.1, 0.2, 0.3, 0.4], global_batch=8)
    assert s["step_ms_p50"] == pytest.approx(250.0)
    assert s["step_ms_p90"] == pytest.approx(370.0)
    assert s["samples_per_s"] == pytest.approx(32.0)  # 4 steps x 8 samples in 1.0 s


def test_sweep_shapes():
    assert bench.world_sizes(1) == [1]
    assert bench.world_sizes(2) == [1, 2]
    assert bench.world_sizes(6) == [1, 2, 4, 6]
    assert bench.world_sizes(8) == [1, 2, 4, 8]
    assert bench.message_sizes(64 * 1024) == [4096, 16384, 65536]
    assert bench.message_sizes(1000) == [1000]
    assert bench.split_steps(10, 3) == [4, 3, 3]
    assert bench.split_steps(2, 5) == [1, 1]
    assert bench.threads_per_rank(2, 1) == 2 and bench.threads_per_rank(2, 2) == 1
    assert bench.threads_per_rank(2, 4) == 1          # oversubscribed, never 0
    assert bench.threads_per_rank(16, 4, requested=3) == 3
    assert not bench.oversubscribed(2, 1, cores=2) and bench.oversubscribed(2, 2, cores=2)


# ---------------------------------------------------------------- real sweeps

def run_bench(tmp_path, *args):
    out = tmp_path / "bench.json"
    r = run_python("ddp_benchmark.py", "--quick", "--max-procs", "2", "--json", out, *args,
                   timeout=TIMEOUT)
    assert_ok(r)
    assert [l for l in r.stdout.splitlines() if l.startswith("done:")], r.stdout
    return json.loads(out.read_text()), r


def numbers(record):
    return {k: v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


DIFFERENCES = {"wrapper_ms", "exposed_comm_ms", "overhead_pct"}  # measured differences: any sign


def check_report(report, threads):
    machine = report["machine"]
    assert machine["backend"] == "gloo" and machine["device"] == "cpu" and machine["cores"] >= 1
    assert machine["torch"] and machine["cpu"]
    scaling, breakdown, allreduce = report["scaling"], report["breakdown"], report["allreduce"]
    assert [r["world_size"] for r in scaling] == [1, 2]
    for rec in scaling + breakdown + allreduce:
        # every record names the machine, torch, backend and threads per rank
        assert rec["machine"] == machine["name"] and rec["torch"] == machine["torch"]
        assert rec["backend"] == "gloo"
        assert rec["threads_per_rank"] == threads[rec["world_size"]]
        assert rec["oversubscribed"] == (rec["world_size"] * rec["threads_per_rank"] > machine["cores"])
        for key, value in numbers(rec).items():
            assert math.isfinite(value), (key, rec)
            if key not in DIFFERENCES:
                assert value > 0, (key, rec)
    # speed-up and efficiency are computed from the measured throughputs
    one, two = scaling
    assert one["speedup"] == pytest.approx(1.0) and one["efficiency"] == pytest.approx(1.0)
    assert two["speedup"] == pytest.approx(two["samples_per_s"] / one["samples_per_s"])
    assert two["efficiency"] == pytest.approx(two["samples_per_s"] / (2 * one["samples_per_s"]))
    for r in scaling:
        assert r["samples_per_s_per_rank"] == pytest.approx(r["samples_per_s"] / r["world_size"])
        assert r["step_ms_p90"] >= r["step_ms_p50"]
        assert r["params"] == 215370  # lesson 1's CNN
    # the breakdown: unwrapped, no_sync and one DDP row per bucket size, at each world size
    for n in (1, 2):
        rows = {(r["variant"], r.get("bucket_cap_mb")): r for r in breakdown if r["world_size"] == n}
        compute = rows[("unwrapped", None)]["step_ms_p50"]
        no_sync = rows[("ddp_no_sync", None)]
        assert no_sync["wrapper_ms"] == pytest.approx(no_sync["step_ms_p50"] - compute)
        for cap in report["config"]["bucket_cap_mb"]:
            d = rows[("ddp", cap)]
            assert d["exposed_comm_ms"] == pytest.approx(d["step_ms_p50"] - no_sync["step_ms_p50"])
            assert d["overhead_pct"] == pytest.approx(100 * (d["step_ms_p50"] - compute) / compute)
        # the scaling row is the DDP row with the first bucket size
        first = rows[("ddp", report["config"]["bucket_cap_mb"][0])]
        assert scaling[n - 1]["step_ms_p50"] == pytest.approx(first["step_ms_p50"])
    # all-reduce bandwidth: measured at world size 2 only, 4 KiB .. 64 KiB in quick mode
    assert [r["bytes"] for r in allreduce] == [4096, 16384, 65536]
    for r in allreduce:
        assert r["world_size"] == 2
        assert r["algbw_gbps"] == pytest.approx(r["bytes"] / (r["time_us"] * 1e-6) / 1e9)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"])  # 2(n-1)/n = 1 at n = 2


def test_quick_weak_sweep_one_thread(tmp_path):
    report, r = run_bench(tmp_path, "--threads", "1")
    check_report(report, threads={1: 1, 2: 1})
    assert [x["batch_per_rank"] for x in report["scaling"]] == [8, 8]   # weak: per-rank fixed
    assert [x["global_batch"] for x in report["scaling"]] == [8, 16]
    status = {t["target"].split()[0]: t["status"] for t in report["targets"]}
    assert status["DDP"] in ("PASS", "MISS")
    assert status["weak-scaling"] in ("PASS", "MISS")  # 1 thread each, MNIST, CPU: it applies


@pytest.mark.slow
def test_quick_strong_sweep_default_threads_and_buckets(tmp_path):
    report, r = run_bench(tmp_path, "--strong", "--batch-size", "8", "--bucket-cap-mb", "25,1",
                          "--grad-as-bucket-view")
    assert report["config"]["grad_as_bucket_view"] is True
    cores = len(os.sched_getaffinity(0))
    check_report(report, threads={1: max(1, cores), 2: max(1, cores // 2)})
    assert [x["batch_per_rank"] for x in report["scaling"]] == [8, 4]   # strong: global fixed
    assert [x["global_batch"] for x in report["scaling"]] == [8, 8]
    assert sorted(x["bucket_cap_mb"] for x in report["breakdown"] if x["variant"] == "ddp") == [1, 1, 25, 25]
    status = {t["target"].split()[0]: t["status"] for t in report["targets"]}
    assert status["weak-scaling"] == "NOT MEASURED"


@pytest.mark.slow
@pytest.mark.parametrize("model,params", [("resnet18", 11_689_512)])
def test_quick_other_models_one_process(tmp_path, model, params):
    out = tmp_path / "bench.json"
    r = run_python("ddp_benchmark.py", "--quick", "--max-procs", "1", "--model", model,
                   "--batch-size", "2", "--threads", "1", "--json", out, timeout=TIMEOUT)
    assert_ok(r)
    report = json.loads(out.read_text())
    assert report["scaling"][0]["params"] == params and report["scaling"][0]["samples_per_s"] > 0
    assert report["allreduce"] == []  # no bandwidth at world size 1


# ---------------------------------------------------------------- mistakes

@pytest.mark.parametrize("args", [
    ["--no-such-flag"],
    ["--bucket-cap-mb", "25,abc"],
    ["--steps", "0"],
    ["--strong", "--batch-size", "3", "--max-procs", "2"],   # 3 does not split over 2 ranks
    ["--backend", "nccl"],                                    # no GPU here
])
def test_bad_flags_give_one_error_line(args):
    r = run_python("ddp_benchmark.py", *args, timeout=TIMEOUT)
    assert len(assert_clean_failure(r, code=2)) == 1, r.stderr
    assert "Traceback" not in r.stderr


def test_refuses_to_run_under_torchrun():
    r = run_python("ddp_benchmark.py", "--quick", timeout=TIMEOUT,
                   env=cpu_env(RANK=0, WORLD_SIZE=1, LOCAL_RANK=0))
    assert len(assert_clean_failure(r, code=2)) == 1, r.stderr
