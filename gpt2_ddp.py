"""Lesson 5: fine-tune GPT-2 data-parallel (or train it from scratch), with mp.spawn or torchrun.
    python gpt2_ddp.py --nproc 2 --init-from gpt2 --text FILE --export-hf out/   # 124M in, HF out
New here: mp.spawn; every rank loads the pretrained weights before DDP wraps the model; token
windows sharded by DistributedSampler; an exact validation loss; rank 0 exports the model for
Hugging Face transformers (generate text there) after leaving the group. The DDP lines are marked `# DDP:`."""

import argparse
import collections
import itertools
import json
import logging
import math
import os
import sys
import time
from contextlib import nullcontext

import tiktoken
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

from ddp_common import (
    cleanup,
    fail,
    free_port,
    load_checkpoint,
    print0,
    save_checkpoint,
    set_seed,
    setup,
)

HUB_MODELS = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")  # openai-community/<name>
# Hugging Face stores these as Conv1D weights, (in, out): the transpose of nn.Linear's.
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")

GPTConfig = collections.namedtuple(
    "GPTConfig", "n_layer n_head n_embd block_size vocab_size", defaults=[50257]
)
PRESETS = {
    "124m": GPTConfig(12, 12, 768, 1024),
    "tiny": GPTConfig(4, 4, 128, 256),
}  # block_size: the context
LOSS_CHUNK = {"cpu": 2**22, "cuda": 2**28}  # logits per chunk of the loss: see LMHeadLoss


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Lesson 5: GPT-2, data-parallel")
    a = p.add_argument
    a("--nproc", type=int, help="mp.spawn workers (default: 1 per GPU, else 1); not with torchrun")
    a(
        "--init-from",
        default="scratch",
        metavar="scratch|gpt2|PATH",
        help="random (--preset); gpt2[-medium|-large|-xl] from the Hub; a model.safetensors",
    )
    a("--preset", default="tiny", choices=list(PRESETS), help="model size from scratch")
    a("--tokenizer", default="gpt2", choices=["gpt2", "bytes"], help="bytes: no download")
    a("--text", required=True, help="the UTF-8 text file to train on")
    a("--max-length", type=int, default=0, help="tokens per window (default: the model's context)")
    a("--epochs", type=int, default=10, help="passes over the windows; the lr schedule spans them")
    a("--max-steps", type=int, default=0, help="stop after this many optimizer steps (0 = no cap)")
    a("--batch-size", type=int, default=8, help="windows per micro-batch PER RANK")
    a("--accum-steps", type=int, default=1, help="micro-batches per optimizer step")
    a("--lr", type=float, default=6e-4, help="peak AdamW lr (fine-tuning wants less, e.g. 1e-4)")
    a("--warmup-steps", type=int, default=10, help="linear warm-up, then cosine decay to lr/10")
    a("--clip-grad", type=float, default=1.0, help="global gradient-norm clip (0 = off)")
    a(
        "--amp",
        default="auto",
        choices=["auto", "bf16", "fp16", "off"],
        help="auto: bf16 on GPUs with real bf16, else fp16 + GradScaler on CUDA; off on CPU",
    )
    a("--compile", action="store_true", help="torch.compile the DDP model (slow first steps)")
    a("--save-every", type=int, default=0, help="steps between val + checkpoint (0 = each epoch)")
    a("--checkpoint-dir", default="./checkpoints", help="where gpt2.pt goes")
    a("--resume", metavar="PATH|auto", help="continue from a checkpoint; auto = DIR/gpt2.pt if any")
    a("--export-hf", metavar="DIR", help="write model.safetensors + config.json for transformers")
    a("--log-every", type=int, default=10)
    a("--seed", type=int, default=0)
    a("--backend", default="auto", choices=["auto", "nccl", "gloo"])
    args = p.parse_args(argv)
    for k, low in dict(
        epochs=1,
        batch_size=1,
        accum_steps=1,
        log_every=1,
        max_length=0,
        nproc=1,
        max_steps=0,
        warmup_steps=0,
        save_every=0,
        clip_grad=0,
    ).items():
        if getattr(args, k) is not None and getattr(args, k) < low:
            p.error(f"--{k.replace('_', '-')} must be at least {low}")
    return args


class Block(nn.Module):
    """Pre-LayerNorm block; modules named as Hugging Face's, so its weights load by name."""

    def __init__(self, cfg):
        super().__init__()
        C, self.n_head = cfg.n_embd, cfg.n_head
        self.ln_1, self.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.attn, self.mlp = nn.Module(), nn.Module()
        self.attn.c_attn, self.attn.c_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)  # q, k, v at once
        self.mlp.c_fc, self.mlp.c_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

    def forward(self, x):
        B, T, C = x.shape
        qkv = self.attn.c_attn(self.ln_1(x)).view(B, T, 3, self.n_head, C // self.n_head)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (B, heads, T, head size)
        # is_causal: the mask lives in the kernel; a mask buffer would be broadcast by DDP every forward
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn.c_proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp.c_proj(F.gelu(self.mlp.c_fc(self.ln_2(x)), approximate="tanh"))


class LMHeadLoss(torch.autograd.Function):
    """Mean cross-entropy of the logits x @ w.T and its gradients, a chunk of rows at a time: the (tokens x vocab)
    logits never exist at once. Chunks: CPU 16 MB, under glibc's 32 MB mmap ceiling, so each reuses the last one's
    memory instead of faulting in fresh pages; GPU 1 GiB, big full-speed matmuls."""

    @staticmethod
    def forward(ctx, x, w, targets, vocab, grad):
        rows, loss = max(1, LOSS_CHUNK.get(x.device.type, LOSS_CHUNK["cuda"]) // len(w)), 0.0
        ctx.dx, ctx.dw = torch.empty_like(x), torch.zeros_like(w)
        for xs, t, dx in zip(x.split(rows), targets.split(rows), ctx.dx.split(rows)):
            logits = (xs @ w.t()).float()
            logits[:, vocab:] = float("-inf")  # padding ids are not tokens
            lse = logits.logsumexp(1)
            loss += (lse - logits.gather(1, t[:, None]).squeeze(1)).sum()
            if grad:  # d loss_sum / d logits = softmax - one-hot, in place of the logits
                p = logits.sub_(lse[:, None]).exp_()
                p[torch.arange(len(t), device=t.device), t] -= 1
                dx.copy_(p @ w)
                ctx.dw += p.t() @ xs  # (under autocast: bf16 products, summed in fp32)
        return loss / len(x)

    @staticmethod
    def backward(
        ctx, g
    ):  # the chain rule; the mean's 1 / tokens here, in fp32 (in fp16 it would underflow)
        return ctx.dx * (g / len(ctx.dx)), ctx.dw * (g / len(ctx.dx)), None, None, None


class GPT(nn.Module):
    """GPT-2: pre-LayerNorm decoder, learned positions, tied input and output embeddings."""

    def __init__(self, cfg):
        super().__init__()
        self.config, padded = cfg, 64 * math.ceil(cfg.vocab_size / 64)  # faster matmuls
        self.wte = nn.Embedding(padded, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)  # learned positions
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, padded, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one matrix, counted (and all-reduced) once
        for name, p in self.named_parameters():  # GPT-2's init; residual layers scaled by depth
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() == 2:  # the residual projections (c_proj) scaled down by depth
                nn.init.normal_(
                    p,
                    std=0.02 / math.sqrt(2 * cfg.n_layer)
                    if name.endswith("c_proj.weight")
                    else 0.02,
                )

    def forward(self, idx, targets=None):
        """With targets: the mean cross-entropy. Without: the last position's logits."""
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.h:
            x = block(x)
        x = self.ln_f(x if targets is not None else x[:, -1, :])  # no targets: the last position
        if targets is None:  # its logits over the real tokens (the padding ids are not tokens)
            return self.lm_head(x)[:, : self.config.vocab_size].float()
        return LMHeadLoss.apply(
            x.flatten(0, 1),
            self.lm_head.weight,
            targets.flatten(),
            self.config.vocab_size,
            torch.is_grad_enabled(),
        )  # the loss, never holding all the logits at once


def pretrained(init_from):
    """The model.safetensors behind --init-from (the Hub caches it in HF_HOME), its config."""
    path = os.path.join(init_from, "model.safetensors") if os.path.isdir(init_from) else init_from
    if init_from in HUB_MODELS:
        from huggingface_hub import hf_hub_download

        try:
            path = hf_hub_download(f"openai-community/{init_from}", "model.safetensors")
        except Exception as e:  # offline without a cached copy, proxy, ...
            fail(
                f"cannot get openai-community/{init_from} ({type(e).__name__}). Run once with "
                "network (then it is cached in HF_HOME), or download it: --init-from PATH",
                1,
            )
    if not os.path.isfile(path):
        fail(f"--init-from {init_from}: want scratch, gpt2 or a model.safetensors (or its dir)")
    with safe_open(path, "pt") as f:  # reads the header only
        shape = {k.removeprefix("transformer."): f.get_slice(k).get_shape() for k in f.keys()}
    (n_vocab, n_embd), n_layer = shape["wte.weight"], sum(k.endswith(".ln_1.weight") for k in shape)
    config_json = os.path.join(
        os.path.dirname(path), "config.json"
    )  # no shape says n_head: read it,
    n_head = (
        json.load(open(config_json))["n_head"] if os.path.isfile(config_json) else n_embd // 64
    )  # or 64 wide
    return path, GPTConfig(n_layer, n_head, n_embd, shape["wpe.weight"][0], n_vocab)


@torch.no_grad()
def load_hf_weights(model, path):
    """Hugging Face GPT-2 weights in: Conv1D transposed, padding rows keep their init, no masks."""
    state = {k.removeprefix("transformer."): v for k, v in load_file(path).items()}
    wte = state.pop("wte.weight")
    model.wte.weight[: len(wte)] = wte
    state = {
        k: v.t() if k.endswith(CONV1D) else v
        for k, v in state.items()
        if k != "lm_head.weight" and not k.endswith((".attn.bias", ".attn.masked_bias"))
    }
    missing, unexpected = model.load_state_dict(state, strict=False)
    if set(missing) != {"wte.weight", "lm_head.weight"} or unexpected:
        fail(f"{path} does not fit GPT-2: missing {missing[:3]}, unexpected {unexpected[:3]}", 1)


def export_hf(model, out_dir):
    """model.safetensors + config.json that transformers.GPT2LMHeadModel.from_pretrained reads."""
    c = model.config
    state = {
        k: (v.t() if k.endswith(CONV1D) else v).contiguous().cpu()
        for k, v in model.state_dict().items()
        if k != "lm_head.weight"
    }
    state["wte.weight"] = state["wte.weight"][: c.vocab_size].contiguous()
    os.makedirs(out_dir, exist_ok=True)
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(
            {
                "architectures": ["GPT2LMHeadModel"],
                "model_type": "gpt2",
                "vocab_size": c.vocab_size,
                "n_positions": c.block_size,
                "n_embd": c.n_embd,
                "n_layer": c.n_layer,
                "n_head": c.n_head,
                "bos_token_id": c.vocab_size - 1,
                "eos_token_id": c.vocab_size - 1,
            },
            f,
        )  # <|endoftext|>


def load_tokenizer(name):
    if name == "bytes":  # 256 byte tokens + <|endoftext|>, GPT-2's pre-tokenizer, no merges
        from tiktoken_ext.openai_public import r50k_pat_str

        return tiktoken.Encoding(
            name="bytes",
            pat_str=r50k_pat_str,
            special_tokens={"<|endoftext|>": 256},
            mergeable_ranks={bytes([b]): b for b in range(256)},
        )
    try:
        return tiktoken.get_encoding("gpt2")  # 2 files, cached in TIKTOKEN_CACHE_DIR once fetched
    except Exception as e:
        fail(
            f"cannot load tiktoken's gpt2 files ({type(e).__name__}). Offline: set "
            "TIKTOKEN_CACHE_DIR to a filled cache, or use --tokenizer bytes",
            code=1,
        )


def prepare(args, world_size):
    """Once per job (spawn parent, or torchrun's rank 0): config, weights, resume, tokens."""
    init, cfg = (
        pretrained(args.init_from) if args.init_from != "scratch" else (None, PRESETS[args.preset])
    )
    if not os.path.isfile(args.text):
        fail(f"--text {args.text} is not a file")
    enc, source = load_tokenizer(args.tokenizer), os.path.basename(args.text)
    if init and cfg.vocab_size != enc.n_vocab:  # GPT-2's weights read GPT-2's token ids
        fail(f"--init-from has {cfg.vocab_size} tokens, --tokenizer {args.tokenizer} {enc.n_vocab}")
    cfg = cfg._replace(vocab_size=enc.n_vocab)
    args.max_length = args.max_length or cfg.block_size
    if args.max_length > cfg.block_size:
        fail(f"--max-length {args.max_length} exceeds the model's context ({cfg.block_size})")
    resume = os.path.join(args.checkpoint_dir, "gpt2.pt") if args.resume == "auto" else args.resume
    with open(args.text, encoding="utf-8", errors="replace") as f:
        tokens = torch.tensor(enc.encode_ordinary(f.read()), dtype=torch.long)
    train, val = (
        tokens[: len(tokens) - len(tokens) // 10],
        tokens[len(tokens) - len(tokens) // 10 :],
    )  # last 10%
    per_rank = math.ceil(len(TokenWindows(train, args.max_length, args.max_length)) / world_size)
    if min(len(train), len(val)) <= args.max_length or per_rank < args.batch_size:
        fail(
            f"{source}: {len(train)} training and {len(val)} validation tokens are too few for {world_size} "
            f"ranks x {args.batch_size} windows of {args.max_length}: lower --max-length or --batch-size"
        )
    resume = None if args.resume == "auto" and not os.path.isfile(resume) else resume
    return {
        "train": train,
        "val": val,
        "tokenizer": args.tokenizer,
        "source": source,
        "resume": resume,
        "config": cfg._asdict(),
        "init": init,
        "max_length": args.max_length,
    }


class TokenWindows(Dataset):
    """Window i starts at i * stride; its targets are its inputs shifted left by one token."""

    def __init__(self, tokens, max_length, stride):
        self.tokens, self.max_length = tokens, max_length
        self.starts = range(0, len(tokens) - max_length, stride)  # start + max_length < len

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, i):
        chunk = self.tokens[self.starts[i] : self.starts[i] + self.max_length + 1]
        return chunk[:-1], chunk[1:]


def build_loaders(train_set, val_set, rank, world, batch_size, seed, pin=False):
    # DDP: the sampler gives every rank as many windows; validation: windows r, r+W, ... (exact)
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=seed)
    train = DataLoader(train_set, batch_size, sampler=sampler, drop_last=True, pin_memory=pin)
    val_shard = Subset(val_set, range(rank, len(val_set), world))
    return train, sampler, DataLoader(val_shard, batch_size, pin_memory=pin)


def batches(loader, sampler, epoch=0, skip=0):
    """Endless (epoch, inputs, targets), from batch `skip` of `epoch` on (a resumed run)."""
    while True:
        sampler.set_epoch(epoch)  # DDP: without it every epoch repeats epoch 0's order
        yield from (
            (epoch, x, y) for x, y in itertools.islice(loader, skip, None)
        )  # a resumed epoch: from skip
        epoch, skip = epoch + 1, 0


def lr_at(step, args, total_steps):
    """Linear warm-up to --lr, then cosine decay to lr / 10 at the last step."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / max(1, total_steps - args.warmup_steps)
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def build(args, ddp, data):
    """Model (scratch, pretrained or resumed) in DDP, AdamW, AMP, GradScaler (fp16), state."""
    cuda = ddp.device.type == "cuda"
    real_bf16 = cuda and torch.cuda.is_bf16_supported(including_emulation=False)  # T4: emulated
    amp = {"auto": "bf16" if real_bf16 else "fp16" if cuda else "off"}.get(args.amp, args.amp)
    if (amp == "fp16" and not cuda) or (amp == "bf16" and cuda and not real_bf16):
        fail(f"--amp {amp} is not for this device: use --amp auto or off", rank0_only=True)
    set_seed(args.seed)  # same seed everywhere -> same initial weights (DDP broadcasts them too)
    model = GPT(GPTConfig(**data["config"]))
    if data["init"] and not data["resume"]:  # every rank loads; another node fetches its own copy
        local = data["init"] if os.path.isfile(data["init"]) else pretrained(args.init_from)[0]
        load_hf_weights(model, local)
    model.to(ddp.device)
    decay = [
        {"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(
        decay, lr=args.lr, betas=(0.9, 0.95), fused=True
    )  # one kernel, CPU too
    scaler = torch.amp.GradScaler(ddp.device.type, enabled=amp == "fp16")
    state = {"step": 0, "val_losses": []}
    if data["resume"]:  # every rank, before the DDP wrap; read on the CPU, copied into place
        state = load_checkpoint(
            data["resume"], "cpu", model=model, optimizer=optimizer, scaler=scaler
        )
        print0(f"resume: {data['resume']} at step {state['step']}")
    # DDP: all-reduce gradient buckets during backward (.grads are views into them); 1 process: nothing to reduce
    ddp_model = (
        DDP(model, device_ids=[ddp.device.index] if cuda else None, gradient_as_bucket_view=True)
        if ddp.world_size > 1
        else model
    )
    if args.compile:
        # DDP: compile the wrapper: Dynamo splits the graph at the buckets, so all-reduce still overlaps backward
        ddp_model = torch.compile(ddp_model)
    return model, ddp_model, optimizer, scaler, amp, state


def train_step(ddp_model, optimizer, scaler, micro_batches, clip_grad, autocast):
    """One optimizer step over the micro-batches; returns their loss (left on the device)."""
    total, no_sync = 0.0, getattr(ddp_model, "no_sync", None)  # None: one process, not wrapped
    for i, (x, y) in enumerate(micro_batches):
        # DDP: all-reduce only after the last micro-batch; before it, gradients accumulate locally.
        with no_sync() if no_sync and i < len(micro_batches) - 1 else nullcontext(), autocast:
            loss = ddp_model(x, y) / len(micro_batches)
        scaler.scale(loss).backward()
        total += loss.detach()
    if clip_grad:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), clip_grad)  # same on every rank
    scaler.step(optimizer)
    scaler.update()
    # DDP: zero in place; None would drop the bucket views (a new .grad, copied into the bucket, every step)
    optimizer.zero_grad(set_to_none=no_sync is None)
    return total


@torch.no_grad()
def evaluate(model, val_loader, ddp, autocast):
    """Exact loss per token (sums all-reduced), on the bare model: no DDP hooks, no deadlock."""
    model.eval()
    totals = torch.zeros(2, device=ddp.device, dtype=torch.float64)
    for x, y in val_loader:
        with autocast:
            totals[0] += model(x.to(ddp.device), y.to(ddp.device)).double() * y.numel()
        totals[1] += y.numel()
    dist.all_reduce(totals)  # DDP: every rank's sums
    model.train()
    return (totals[0] / totals[1]).item()


def train(args, ddp, data):
    """Train on this rank; returns the bare model and the results."""
    model, ddp_model, optimizer, scaler, amp, state = build(args, ddp, data)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(amp)
    autocast = torch.autocast(ddp.device.type, dtype=dtype, enabled=dtype is not None)
    L, cuda = data["max_length"], ddp.device.type == "cuda"
    train_set = TokenWindows(data["train"], L, L)
    train_loader, sampler, val_loader = build_loaders(
        train_set,
        TokenWindows(data["val"], L, L),
        ddp.rank,
        ddp.world_size,
        args.batch_size,
        args.seed,
        cuda,
    )
    per_epoch = len(train_loader) // args.accum_steps
    schedule = args.epochs * per_epoch  # the lr schedule's length; --max-steps only stops early
    total, step, val_losses = (
        min(schedule, args.max_steps or schedule),
        state["step"],
        state["val_losses"],
    )
    stream = batches(train_loader, sampler, *divmod(step * args.accum_steps, len(train_loader)))
    tokens_per_step = args.batch_size * L * args.accum_steps * ddp.world_size
    print0(
        f"start: text {data['source']} | init {args.init_from} | vocab {model.config.vocab_size} | model "
        f"{sum(map(torch.numel, model.parameters())) / 1e6:.1f}M params | world {ddp.world_size} | backend "
        f"{ddp.backend} | device {ddp.device.type} | amp {amp} | compile {args.compile} | batch {args.batch_size}x"
        f"{L} tokens/rank x {args.accum_steps} accum = {tokens_per_step} tokens/step | steps {total}"
    )
    if step == 0:
        val_losses.append([0, evaluate(model, val_loader, ddp, autocast)])
        print0(f"step 0/{total} | val_loss {val_losses[-1][1]:.4f}")
    t_start = t_log = time.perf_counter()
    start = logged = step  # logged: the step of the last log line
    loss_sum, rate = torch.zeros((), device=ddp.device), 0.0
    while step < total:
        for group in optimizer.param_groups:
            group["lr"] = lr = lr_at(step, args, schedule)
        micro = [next(stream) for _ in range(args.accum_steps)]
        epoch, micro = (
            micro[0][0],
            [
                (x.to(ddp.device, non_blocking=True), y.to(ddp.device, non_blocking=True))
                for _, x, y in micro
            ],
        )
        loss_sum += train_step(ddp_model, optimizer, scaler, micro, args.clip_grad, autocast)
        step += 1
        if step % args.log_every == 0 or step == total:
            n, now = step - logged, time.perf_counter()
            dist.all_reduce(loss_sum)  # DDP: for the log line only (gloo has no AVG: sum, divide)
            rate = n * tokens_per_step / (now - t_log)
            mem = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0
            print0(
                f"epoch {epoch + 1} | step {step}/{total} | loss {loss_sum.item() / n / ddp.world_size:.4f} "
                f"| lr {lr:.2e} | {rate:.0f} tokens/s{f' | mem {mem:.1f}GiB' if mem else ''}"
                f" | eta {(total - step) * (now - t_start) / (step - start):.0f}s"
            )
            t_log, logged, loss_sum = now, step, torch.zeros((), device=ddp.device)
        if step % (args.save_every or per_epoch) == 0 or step == total:
            t_pause = time.perf_counter()
            val_losses.append([step, evaluate(model, val_loader, ddp, autocast)])
            print0(f"epoch {epoch + 1} | step {step}/{total} | val_loss {val_losses[-1][1]:.4f}")
            # DDP: save the bare model (no 'module.' prefix); every rank calls, rank 0 writes.
            save_checkpoint(
                {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "step": step,
                    "scaler": scaler.state_dict(),
                    "val_losses": val_losses,
                    "config": data["config"],
                    "tokenizer": data["tokenizer"],
                },
                os.path.join(args.checkpoint_dir, "gpt2.pt"),
            )
            t_log += time.perf_counter() - t_pause  # tokens/s counts training time only
    return model, {
        "steps": step,
        "tokens_per_s": rate,
        "val_losses": val_losses,
        "time": time.perf_counter() - t_start,
    }


def worker(rank, world_size, args, data):
    """One process. mp.spawn passes rank, world size, data; under torchrun rank 0 prepares them."""
    ddp = setup(args.backend, rank=rank, world_size=world_size)  # DDP: join the process group
    if data is None:  # torchrun: rank 0 prepares (or fails: torchrun stops the rest)
        box = [prepare(args, ddp.world_size) if ddp.is_main else None]
        dist.broadcast_object_list(box, src=0)  # DDP: every rank gets rank 0's tokens and decisions
        data = box[0]
    model, res = train(args, ddp, data)
    # DDP: every rank leaves the group here, together. Nothing after this is collective, so rank 0
    # can export while the others exit (print0 no longer knows the rank: test is_main).
    cleanup()
    if not ddp.is_main:
        return
    if args.export_hf:
        export_hf(model, args.export_hf)
    print(
        f"done: text {data['source']} | tokenizer {data['tokenizer']} | world {ddp.world_size} | backend "
        f"{ddp.backend} | device {ddp.device.type} | steps {res['steps']} | val_loss {res['val_losses'][-1][1]:.4f}"
        f" | {res['tokens_per_s']:.0f} tokens/s | time {res['time']:.1f}s",
        flush=True,
    )


def spawn_workers(args):
    """mp.spawn launch: prepare once here, pick the rendezvous port, start one worker per rank."""
    nproc = args.nproc or torch.cuda.device_count() or 1  # more than the GPUs: setup() says so
    data = prepare(args, nproc)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # DDP: the workers find rank 0 here: mp.spawn
    os.environ.setdefault("MASTER_PORT", str(free_port()))  # starts local processes (one node)
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)  # our line says it
    try:  # DDP: nproc processes run worker(rank, nproc, args, data); one failing stops the rest
        mp.spawn(worker, args=(nproc, args, data), nprocs=nproc, join=True)
    except mp.ProcessRaisedException as e:  # a Python exception: its last line, not 40 lines
        fail(f"rank {e.error_index} failed: {str(e).strip().splitlines()[-1][:300]}", code=1)
    except mp.ProcessExitedException as e:  # exit 1 or 2: it left through fail(), line printed
        sys.exit(e.exit_code) if e.exit_code in (1, 2) else fail(
            f"rank {e.error_index} died ({e.signal_name})", 1
        )


if __name__ == "__main__":
    args = parse_args()
    worker(None, None, args, None) if "RANK" in os.environ else spawn_workers(
        args
    )  # torchrun or not
