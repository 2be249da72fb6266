"""Lesson 0, ddp_minimal.py: the lesson's own worker, spawned as 2 processes and as 1, learns, and
its replicas end identical and equal to one process training on the global batch."""

import argparse
import os
import sys

import pytest
import torch
from conftest import free_port, spawn

import ddp_minimal


def _run(rank, world_size, port, out_dir=None, batch_size=16):
    """Run ddp_minimal.worker as main() would (MASTER_ADDR/PORT set), keep what it returns."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), CUDA_VISIBLE_DEVICES="")
    args = argparse.Namespace(epochs=3, batch_size=batch_size, lr=0.1, seed=0)
    model, losses = ddp_minimal.worker(rank, world_size, args)
    result = {
        "params": torch.cat([p.detach().flatten() for p in model.parameters()]),
        "losses": losses,
    }
    if out_dir:
        torch.save(result, os.path.join(out_dir, f"w{world_size}_r{rank}.pt"))
    return result


def test_two_processes_equal_one_process_on_the_global_batch_and_learn(tmp_path, monkeypatch):
    spawn(_run, 2, str(tmp_path), 16)  # 2 processes x 16 samples a step
    for k in ("MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.setenv(k, "")  # _run sets them: undone after this test
    one = _run(0, 1, free_port(), batch_size=32)  # 1 process x 32 (in this one): the same samples
    r0, r1 = (torch.load(tmp_path / f) for f in ("w2_r0.pt", "w2_r1.pt"))
    assert torch.equal(r0["params"], r1["params"])  # the replicas never drift apart
    # ...and they hold the weights one process reaches with the global batch
    torch.testing.assert_close(r0["params"], one["params"], rtol=1e-4, atol=1e-5)
    assert not torch.allclose(r0["params"], one["params"] + 1e-3)  # the comparison can fail
    torch.testing.assert_close(r0["losses"], one["losses"], rtol=1e-4, atol=1e-5)
    assert r0["losses"][-1] < 0.8 * r0["losses"][0], r0["losses"]  # it learns


def test_main_spawns_and_prints_once(readme_run):
    """The README's lesson-0 command (`python ddp_minimal.py --nproc 2`, its run shared with
    test_readme.py): main() spawns 2 processes on gloo, and rank 0 alone prints."""
    result = readme_run("python ddp_minimal.py")
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("start: world 2")
    assert lines[-1].startswith("done: world 2 | backend gloo")
    # One line per epoch: printed by rank 0, not once per process.
    epochs = int(lines[0].rsplit("| epochs ", 1)[1])
    assert len([line for line in lines if line.startswith("epoch ")]) == epochs


@pytest.mark.parametrize("flag", [["--nproc", "0"], ["--epochs", "x"]])
def test_bad_flags_are_usage_errors(flag, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["ddp_minimal.py", *flag])
    with pytest.raises(SystemExit) as e:
        ddp_minimal.main()
    assert e.value.code == 2 and "error: " in capsys.readouterr().err
