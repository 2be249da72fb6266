"""The GPU paths the CPU suite cannot reach (fused optimizers, bf16, fp16 + GradScaler, ZeRO save
and resume with fused AdamW, torch.compile, SyncBatchNorm, comm hooks, NCCL): tests/gpu_check.sh
runs every lesson a few steps on CUDA. Here it runs when a GPU is visible and skips otherwise."""

import subprocess

import pytest
import torch
from conftest import ROOT


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_every_lesson_runs_its_gpu_paths():
    result = subprocess.run(
        ["bash", ROOT / "tests" / "gpu_check.sh"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=3000,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "FAIL" not in result.stdout and "gpu_check: 0 failed" in result.stdout
