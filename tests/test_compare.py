"""Speed work must not change the maths: lesson 5's chunked loss (gpt2_model.LMHeadLoss) is
F.cross_entropy, value and gradients; bench/compare.py measures what it says (parsers, MFU count,
errors) and runs each comparison end to end where what it needs is there: Lightning for the
CIFAR pair, a nanoGPT checkout and GPT-2's BPE files for the GPT pair (neither is in CI: each
test says so in its skip reason); the world-size-1 check runs in the suite as the README's
command."""

import importlib.util
import os
import re
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT, assert_clean_failure, assert_ok, run_python

sys.path.insert(0, str(ROOT / "bench"))
import compare  # noqa: E402

import gpt2_model  # noqa: E402


def reference_loss(x, w, targets, vocab):
    """What LMHeadLoss replaces: all the logits at once, padding ids masked, F.cross_entropy."""
    logits = (x @ w.t()).float()
    logits[:, vocab:] = float("-inf")
    return F.cross_entropy(logits, targets)


# 300 rows: 4 chunks; 64 rows: 1 chunk; 7 rows of a 64-token vocabulary: chunks of 5 rows, then 2.
@pytest.mark.parametrize("rows,chunk", [(300, 2**22), (64, 2**22), (7, 64 * 5)])
def test_chunked_loss_is_cross_entropy_with_the_same_gradients(rows, chunk, monkeypatch):
    monkeypatch.setitem(gpt2_model.LOSS_CHUNK, "cpu", chunk)
    vocab, padded = 50257, 50304
    if chunk < 2**22:
        # A small vocabulary: 320 logits per chunk = 5 rows.
        vocab, padded = 60, 64
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 32, generator=g, dtype=torch.float64).float().requires_grad_()
    w = (0.3 * torch.randn(padded, 32, generator=g)).requires_grad_()
    t = torch.randint(0, vocab, (rows,), generator=g)
    ref = reference_loss(x, w, t, vocab)
    ours = gpt2_model.LMHeadLoss.apply(x, w, t, vocab, True)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    # The incoming gradient (3) is applied.
    grads = torch.autograd.grad(3 * ours, [x, w])
    ref_grads = torch.autograd.grad(3 * ref, [x, w])
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
    # Evaluation: the loss only.
    with torch.no_grad():
        torch.testing.assert_close(gpt2_model.LMHeadLoss.apply(x, w, t, vocab, False), ref.detach())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_chunked_loss_under_autocast_matches_autograd(dtype, monkeypatch):
    """Under autocast the products are low precision as autograd's; the 1 / tokens comes after
    them, in fp32 (the loss is scaled as a GradScaler would: unscaled fp16 gradients of a mean
    underflow)."""
    # 21 rows of the padded GPT-2 vocabulary per chunk.
    monkeypatch.setitem(gpt2_model.LOSS_CHUNK, "cpu", 2**20)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 64, generator=g).requires_grad_()
    w = (0.02 * torch.randn(50304, 64, generator=g)).requires_grad_()
    t = torch.randint(0, 50257, (256,), generator=g)
    with torch.autocast("cpu", dtype=dtype):
        ref = reference_loss(x, w, t, 50257)
        ours = gpt2_model.LMHeadLoss.apply(x, w, t, 50257, True)
    torch.testing.assert_close(ours, ref, rtol=1e-3, atol=1e-3)
    scale = 2.0**16
    dx, dw = torch.autograd.grad(ours * scale, [x, w])
    rx, rw = torch.autograd.grad(ref * scale, [x, w])
    # others: the rows of tokens that are no target, where the gradient is the softmax alone, small.
    others = torch.ones(50304, dtype=torch.bool).index_fill_(0, t, False)
    for a, b in ((dx, rx), (dw, rw), (dw[others], rw[others])):
        assert ((a - b).norm() / b.norm()).item() < 1e-2


def test_chunked_loss_under_fp16_autocast_does_not_overflow(monkeypatch):
    """The head's weight gradient sums a chunk's rows (5,336 on a GPU) before any loss scale:
    in fp16 that can pass 65504, and no GradScaler scale brings it back (every step skipped).
    Here 4,096 rows of one target with a feature of 20 sum to ~82,000; autograd, at the scale
    a GradScaler backs off to, stays finite, and so must this."""
    monkeypatch.setitem(gpt2_model.LOSS_CHUNK, "cpu", 2**22)  # all 4,096 rows in one chunk
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4096, 64, generator=g)
    x[:, 0] = 20.0
    x.requires_grad_()
    w = (0.02 * torch.randn(320, 64, generator=g)).requires_grad_()
    t = torch.full((4096,), 5)
    with torch.autocast("cpu", dtype=torch.float16):
        ours = gpt2_model.LMHeadLoss.apply(x, w, t, 257, True)
        ref = reference_loss(x, w, t, 257)
    (dw,) = torch.autograd.grad(ours, [w])
    (rw,) = torch.autograd.grad(ref, [w])
    assert rw.isfinite().all() and dw.isfinite().all(), dw[5, 0]
    assert ((dw - rw).norm() / rw.norm()).item() < 1e-2


def test_model_loss_and_every_gradient_match_full_logits():
    """Through the whole GPT: the loss and the gradient of every parameter (the tied embedding gets
    both its uses) as with the full (batch, time, vocab) logits."""
    cfg = gpt2_model.GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=100)
    torch.manual_seed(0)
    model = gpt2_model.GPT(cfg)
    idx, targets = torch.randint(0, 100, (3, 16)), torch.randint(0, 100, (3, 16))
    x = model.wte(idx) + model.wpe(torch.arange(16))
    for block in model.h:
        x = block(x)
    ref = reference_loss(model.ln_f(x).flatten(0, 1), model.lm_head.weight, targets.flatten(), 100)
    params = list(model.parameters())
    ref_grads = torch.autograd.grad(ref, params)
    loss = model(idx, targets)
    torch.testing.assert_close(loss, ref)
    for a, b in zip(torch.autograd.grad(loss, params), ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_last_position_logits_cover_the_real_tokens_only():
    # 100 tokens: the embedding is padded to 128 rows.
    cfg = gpt2_model.GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=100)
    model = gpt2_model.GPT(cfg)
    with torch.no_grad():
        # Padding rows would win if they were logits.
        model.wte.weight[100:] = 100.0
        logits = model(torch.randint(0, 100, (2, 8)))
    assert logits.shape == (2, 100)


def test_flops_per_token_is_nanogpts_count():
    # 12 blocks, the tied wte (padded), ln_f; no wpe.
    n = 12 * (12 * 768**2 + 13 * 768) + 50304 * 768 + 2 * 768
    assert compare.flops_per_token("124m") == 6 * n + 12 * 12 * 768 * 1024


def test_interval_rate_is_the_harmonic_mean_after_warmup():
    out = "\n".join(
        [
            "step 0/20 | val_loss 9.0",
            "epoch 1 | step 5/20 | loss 9 | lr 1e-4 | 100 tokens/s | eta 3s",  # warm-up: left out
            "epoch 1 | step 10/20 | loss 8 | lr 1e-4 | 1000 tokens/s | eta 2s",
            "epoch 1 | step 15/20 | loss 7 | lr 1e-4 | 3000 tokens/s | eta 1s",
            "epoch 1 | step 15/20 | val_loss 7.5",
        ]
    )
    # 2 / (1/1000 + 1/3000)
    assert compare.interval_rate(out, "tokens/s", warmup=5) == pytest.approx(1500)


def test_bad_nanogpt_dir_is_one_error_line(tmp_path):
    errs = assert_clean_failure(
        run_python("bench/compare.py", "--only", "gpt", "--nanogpt", tmp_path), code=2
    )
    assert "no train.py" in errs[0]


NANOGPT = os.environ.get("NANOGPT_DIR", "")
HAS_NANOGPT = os.path.isfile(os.path.join(NANOGPT, "train.py"))
NO_NANOGPT = (
    "the GPT-2 comparison needs a nanoGPT checkout at 3adf61e in NANOGPT_DIR and GPT-2's BPE "
    "files in TIKTOKEN_CACHE_DIR (tests/gpt2_bpe_cache.sh): this suite runs without network "
    "access, so compare.py can neither git clone nanoGPT nor download the BPE files"
)
NO_LIGHTNING = (
    "the CIFAR comparison needs Lightning, which requirements.txt leaves out: "
    f"pip install {compare.LIGHTNING} (compare.py would install it into this Python itself)"
)


def rows_of(result, job):
    """The table rows for `job` and their ours/theirs ratio: each must be a positive number."""
    rows = [line for line in result.stdout.splitlines() if line.startswith(job)]
    assert rows, result.stdout
    for row in rows:
        # ... ours theirs unit ours/theirs (e.g. 1.03x) per-pair ratios... vs
        ratio = next(word for word in row.split() if re.fullmatch(r"\d+\.\d+x", word))
        assert float(ratio[:-1]) > 0, row
    return rows


@pytest.mark.skipif(not (HAS_NANOGPT and os.environ.get("TIKTOKEN_CACHE_DIR")), reason=NO_NANOGPT)
def test_lesson_5_against_nanogpt_end_to_end(tmp_path):
    """gpt2_ddp.py and nanoGPT's train.py on the same GPT-2, 2 processes, one pair."""
    flags = ["--only", "gpt", "--pairs", "1", "--procs", "2", "--gpt-steps", "12"]
    flags += ["--warmup", "6", "--nanogpt", NANOGPT, "--work", tmp_path]
    result = run_python("bench/compare.py", *flags, timeout=600)
    assert_ok(result)
    assert len(rows_of(result, "GPT-2 tiny, 2 proc")) == 1


@pytest.mark.skipif(not importlib.util.find_spec("lightning"), reason=NO_LIGHTNING)
def test_lesson_2_against_lightning_end_to_end(tmp_path):
    """ddp_training.py and the same job in Lightning, 2 processes x 32, one pair."""
    flags = ["--only", "cifar", "--pairs", "1", "--cifar-steps", "12", "--warmup", "6"]
    result = run_python("bench/compare.py", *flags, "--work", tmp_path, timeout=600)
    assert_ok(result)
    assert len(rows_of(result, "ResNet-18 CIFAR, 2 x 32")) == 1
