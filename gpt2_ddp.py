"""Lesson 5: GPT-2 trained data-parallel, launched with mp.spawn (or torchrun).

    python gpt2_ddp.py --nproc 2                      # mp.spawn: 2 workers (one per GPU, or CPU)
    torchrun --standalone --nproc_per_node=2 gpt2_ddp.py   # the same file under torchrun
    python gpt2_ddp.py --nproc 1 --preset 124m --bench-steps 20 --compile ...   # speed

What this lesson adds to lessons 1-4:
- mp.spawn: one command starts the workers itself. The parent reads and tokenizes the text once,
  picks a free MASTER_PORT, spawns one process per GPU and turns a worker's failure into one
  error line. Under torchrun (RANK is set) there is no parent: rank 0 tokenizes and broadcasts.
- A token dataset sharded across ranks: sliding windows over one long token stream (inputs and
  targets shifted by one token), DistributedSampler + set_epoch for training, and an exact
  validation loss (each window evaluated once, sums all-reduced).
- The speed settings of a good single-file GPT trainer: fused AdamW, attention through
  scaled_dot_product_attention (flash kernels), bf16 autocast, a vocabulary padded to a multiple
  of 64, torch.compile of the DDP model, gradient accumulation without needless all-reduces
  (no_sync), and tokens/s + MFU (model FLOPs utilization) in the log.
- Rank 0 alone generates text at the end, after the process group is gone: no rank waits on it.

The model is GPT-2 in plain PyTorch (presets `124m` and a `tiny` one for CPUs); the tokenizer is
tiktoken's `gpt2` (downloads two BPE files once) or `--tokenizer bytes`, one token per byte,
which needs no download. The DDP-specific lines are marked `# DDP:`.
"""
import argparse
import datetime
import logging
import math
import os
import re
import signal
import sys
import time
import urllib.request
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import tiktoken
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

from ddp_common import cleanup, fail, free_port, print0, save_checkpoint, set_seed, setup

# A short public-domain story (Edith Wharton, "The Verdict", 1908; ~20 kB).
STORY_URL = ("https://raw.githubusercontent.com/rasbt/LLMs-from-scratch/main/"
             "ch02/01_main-chapter-code/the-verdict.txt")
STORY_FILE = "the-verdict.txt"
OFFLINE_HINT = "python gpt2_ddp.py --text FILE --tokenizer bytes"
BENCH_WARMUP = 5  # steps run before --bench-steps timing starts (compilation, allocator warm-up)

# Dense bf16 tensor-core peak per GPU in TFLOP/s (vendor data sheets, without sparsity), for MFU.
# Matched in order against torch.cuda.get_device_name(); unknown GPUs need --peak-tflops.
PEAK_BF16_TFLOPS = [
    (r"H100.*PCIe", 756.0), (r"H100.*NVL", 835.0), (r"H100|H200|GH200", 989.0),
    (r"B200", 2250.0), (r"A100", 312.0), (r"L40S", 362.0), (r"\bL4\b", 121.0),
    (r"\bA10\b", 125.0), (r"RTX 4090", 165.0), (r"RTX 3090", 71.0),
]


@dataclass
class GPTConfig:
    n_layer: int
    n_head: int
    n_embd: int
    block_size: int        # context length: the longest sequence the model can read
    vocab_size: int = 0    # the tokenizer's size padded to a multiple of 64 (set at build time)


PRESETS = {
    "124m": GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024),  # GPT-2 small
    "tiny": GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=256),     # seconds on a CPU
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Lesson 5: train GPT-2 data-parallel. Launch with "
                                "python gpt2_ddp.py --nproc N (mp.spawn), or under torchrun.")
    p.add_argument("--nproc", type=int, default=None,
                   help="processes to start with mp.spawn (default: one per visible GPU, or 1 "
                        "on CPU). Not used under torchrun, which sets --nproc_per_node itself")
    p.add_argument("--preset", default="tiny", choices=list(PRESETS),
                   help="model size: 124m = GPT-2 small, tiny = 4 layers x 128 wide (default tiny)")
    p.add_argument("--tokenizer", default="gpt2", choices=["gpt2", "bytes"],
                   help="gpt2: tiktoken's GPT-2 BPE (downloads 2 files once, or reads "
                        "TIKTOKEN_CACHE_DIR); bytes: one token per byte, no download (default gpt2)")
    p.add_argument("--text", default=None,
                   help=f"UTF-8 text file to train on (default: {STORY_FILE} in --data-dir, "
                        "downloaded when missing)")
    p.add_argument("--data-dir", default="./data", help="where the default text lives (default ./data)")
    p.add_argument("--max-length", type=int, default=0,
                   help="tokens per training window (default: the preset's context length)")
    p.add_argument("--stride", type=int, default=0,
                   help="tokens between the starts of two training windows; < max-length overlaps "
                        "them (default: max-length)")
    p.add_argument("--val-fraction", type=float, default=0.1,
                   help="the text's last fraction held out for validation (default 0.1)")
    p.add_argument("--epochs", type=int, default=10, help="passes over the training windows (default 10)")
    p.add_argument("--max-steps", type=int, default=0,
                   help="stop after this many optimizer steps in all (0 = no cap)")
    p.add_argument("--batch-size", type=int, default=8,
                   help="windows per micro-batch PER RANK (default 8)")
    p.add_argument("--grad-accum", type=int, default=1,
                   help="micro-batches per optimizer step; global batch = batch-size x grad-accum "
                        "x world size windows (default 1)")
    p.add_argument("--lr", type=float, default=6e-4, help="peak AdamW learning rate (default 6e-4)")
    p.add_argument("--min-lr-ratio", type=float, default=0.1,
                   help="the cosine schedule ends at lr x this (default 0.1)")
    p.add_argument("--warmup-steps", type=int, default=10,
                   help="steps of linear lr warm-up (default 10)")
    p.add_argument("--weight-decay", type=float, default=0.1,
                   help="AdamW weight decay on matrices and embeddings (default 0.1)")
    p.add_argument("--grad-clip", type=float, default=1.0,
                   help="clip the global gradient norm to this (0 = off; default 1.0)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"],
                   help="auto: bf16 autocast on GPUs that support it, fp32 otherwise (default auto)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                   help="torch.compile the DDP model: faster steps after a slow first one (default off)")
    p.add_argument("--eval-every", type=int, default=0,
                   help="steps between validation + checkpoint (default 0 = after every epoch)")
    p.add_argument("--log-every", type=int, default=10, help="steps between log lines (default 10)")
    p.add_argument("--checkpoint-dir", default="./checkpoints",
                   help="rank 0 saves gpt2.pt here at every validation (default ./checkpoints)")
    p.add_argument("--bench-steps", type=int, default=0,
                   help=f"benchmark: after {BENCH_WARMUP} warm-up steps time this many steps, print "
                        "tokens/s and MFU, and stop (no validation, checkpoint or sample)")
    p.add_argument("--peak-tflops", type=float, default=0.0,
                   help="peak FLOP/s per device in TFLOP/s for MFU (default: looked up for known GPUs)")
    p.add_argument("--generate-tokens", type=int, default=100,
                   help="tokens rank 0 generates at the end (0 = none; default 100)")
    p.add_argument("--prompt", default="I had always thought", help="start of the generated sample")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (0 = greedy)")
    p.add_argument("--top-k", type=int, default=50, help="sample from the k likeliest tokens (0 = all)")
    p.add_argument("--seed", type=int, default=0, help="seed for init, data order and sampling")
    p.add_argument("--backend", default="auto", choices=["auto", "nccl", "gloo"],
                   help="auto: NCCL on CUDA GPUs, gloo on CPU (default auto)")
    args = p.parse_args(argv)

    block = PRESETS[args.preset].block_size
    args.max_length = args.max_length or block
    args.stride = args.stride or args.max_length
    for name in ("epochs", "batch_size", "grad_accum", "log_every", "max_length", "stride"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("max_steps", "warmup_steps", "eval_every", "bench_steps", "generate_tokens",
                 "top_k", "grad_clip", "weight_decay", "peak_tflops", "temperature"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0")
    if args.max_length > block:
        p.error(f"--max-length {args.max_length} is longer than the {args.preset} context ({block})")
    if not 0 < args.val_fraction < 1 or args.lr <= 0 or not 0 <= args.min_lr_ratio <= 1:
        p.error("need 0 < --val-fraction < 1, --lr > 0 and 0 <= --min-lr-ratio <= 1")
    if not args.prompt:
        p.error("--prompt must not be empty")
    if args.nproc is not None:
        if "RANK" in os.environ:
            p.error("--nproc starts workers with mp.spawn; under torchrun set --nproc_per_node instead")
        if args.nproc < 1:
            p.error("--nproc must be at least 1")
        if torch.cuda.is_available() and args.nproc > torch.cuda.device_count():
            p.error(f"--nproc {args.nproc} but only {torch.cuda.device_count()} GPUs are visible")
    return args


# ----------------------------------------------------------------------------- model (GPT-2)

class CausalSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)  # q, k, v in one matmul
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        # is_causal=True builds the mask inside the (flash) kernel. A registered mask buffer would
        # cost memory and, under DDP, be broadcast from rank 0 before every forward.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))  # GPT-2's GELU


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(cfg.n_embd), CausalSelfAttention(cfg)
        self.ln_2, self.mlp = nn.LayerNorm(cfg.n_embd), MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2 (pre-LayerNorm decoder, learned positions, tied input/output embeddings)."""

    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying: one matrix, counted (and synced) once
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2: scale the residual projections by depth
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx, targets=None):
        """With targets: the mean cross-entropy over all positions. Without: the logits of the
        last position only (all that generation needs)."""
        T = idx.size(1)
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, -1, :])
        logits = self.lm_head(x)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    def num_params(self, non_embedding=True):
        """Parameters (tied weights once); minus the position table, as nanoGPT counts for MFU."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.wpe.weight.numel() if non_embedding else n


def flops_per_token(cfg, n_params, seq_len):
    """Training FLOPs per token (forward + backward), as nanoGPT's estimate_mfu (PaLM appendix B):
    6 per parameter (2 forward, 4 backward) plus the attention scores and their weighted sum."""
    head_dim = cfg.n_embd // cfg.n_head
    return 6 * n_params + 12 * cfg.n_layer * cfg.n_head * head_dim * seq_len


def peak_tflops(device, use_bf16, override):
    """Peak TFLOP/s of one device for MFU: --peak-tflops, else the bf16 table for known GPUs."""
    if override:
        return override
    if device.type == "cuda" and use_bf16:
        name = torch.cuda.get_device_name(device)
        for pattern, tflops in PEAK_BF16_TFLOPS:
            if re.search(pattern, name):
                return tflops
    return None  # unknown: the log says "mfu n/a"


# ----------------------------------------------------------------------------- tokens and data

class DataError(Exception):
    """A problem with the text or tokenizer: one error line, exit `code`."""

    def __init__(self, message, code=2):
        super().__init__(message)
        self.code = code


def bytes_encoding():
    """A tiktoken Encoding with one token per byte value (0-255) plus <|endoftext|> (256),
    splitting text with GPT-2's pre-tokenizer pattern. No merges, so no download."""
    try:
        from tiktoken_ext.openai_public import r50k_pat_str as pat_str  # GPT-2's pattern
    except ImportError:
        pat_str = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    return tiktoken.Encoding(name="bytes", pat_str=pat_str,
                             mergeable_ranks={bytes([b]): b for b in range(256)},
                             special_tokens={"<|endoftext|>": 256})


def load_tokenizer(name):
    if name == "bytes":
        return bytes_encoding()
    try:
        return tiktoken.get_encoding("gpt2")  # vocab.bpe + encoder.json, cached after one download
    except Exception as e:  # offline, proxy, bad cache ...
        reason = " ".join(str(e).split())[:150] or type(e).__name__
        raise DataError(f"cannot load tiktoken's gpt2 BPE files ({type(e).__name__}: {reason}). "
                        "Offline: copy a filled cache and export TIKTOKEN_CACHE_DIR (see "
                        f"tests/gpt2_bpe_cache.sh), or use no BPE: {OFFLINE_HINT}", code=1) from None


def text_path(args):
    """--text, or the default story in --data-dir (downloaded once, atomically)."""
    if args.text:
        if not os.path.isfile(args.text):
            raise DataError(f"--text {args.text} is not a file")
        return args.text
    path = os.path.join(args.data_dir, STORY_FILE)
    if not os.path.isfile(path):
        try:
            os.makedirs(args.data_dir, exist_ok=True)
            with urllib.request.urlopen(STORY_URL, timeout=30) as r:
                data = r.read()
            with open(f"{path}.tmp{os.getpid()}", "wb") as f:
                f.write(data)
            os.replace(f"{path}.tmp{os.getpid()}", path)
        except Exception as e:  # offline, proxy, read-only disk ...
            reason = " ".join(str(e).split())[:150] or type(e).__name__
            raise DataError(f"cannot download the default text {STORY_URL} into {args.data_dir} "
                            f"({reason}). Offline, train on any text file: {OFFLINE_HINT}",
                            code=1) from None
    return path


def prepare(args, world_size):
    """Read and tokenize the text once; split it; check there is at least a batch per rank.
    Returns plain tensors and numbers (they travel to the workers through mp.spawn or a
    broadcast). Raises DataError."""
    path = text_path(args)
    enc = load_tokenizer(args.tokenizer)
    with open(path, encoding="utf-8", errors="replace") as f:
        tokens = torch.tensor(enc.encode_ordinary(f.read()), dtype=torch.long)
    n_val = int(len(tokens) * args.val_fraction)
    train, val = tokens[:len(tokens) - n_val], tokens[len(tokens) - n_val:]
    need = args.max_length + 1  # a window plus the one-token shift
    if len(val) < need or len(train) < need:
        raise DataError(f"{path} has {len(tokens)} tokens: too few for windows of --max-length "
                        f"{args.max_length} in both the training part ({len(train)}) and the "
                        f"validation part ({len(val)}). Use a longer text, a smaller --max-length "
                        "or a larger --val-fraction")
    n_windows = len(TokenWindows(train, args.max_length, args.stride))
    per_rank = math.ceil(n_windows / world_size)  # what DistributedSampler gives each rank
    if per_rank < args.batch_size:
        raise DataError(f"{n_windows} training windows over {world_size} ranks is {per_rank} per "
                        f"rank, less than one batch of --batch-size {args.batch_size}. Use a "
                        "smaller --batch-size, --stride or --max-length, or a longer text")
    return {"train": train, "val": val, "n_vocab": enc.n_vocab, "tokenizer": args.tokenizer,
            "source": os.path.basename(path)}


class TokenWindows(Dataset):
    """Sliding windows over one token stream: window i starts at i * stride; its targets are its
    inputs shifted left by one token. A window ends before the stream does (no padding)."""

    def __init__(self, tokens, max_length, stride):
        self.tokens, self.max_length = tokens, max_length
        self.starts = range(0, len(tokens) - max_length, stride)  # start + max_length < len

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, i):
        s = self.starts[i]
        chunk = self.tokens[s:s + self.max_length + 1]
        return chunk[:-1], chunk[1:]


def build_loaders(train_set, val_set, rank, world_size, batch_size, seed, pin_memory=False):
    """DDP: training windows through a DistributedSampler (a fresh shuffle every epoch via
    set_epoch, equal shard sizes so every rank takes the same number of steps; when the count
    does not divide, it repeats a few windows). Validation windows: rank r takes r, r+W, ... -
    disjoint, complete, no repeats, so the all-reduced loss is exact."""
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=seed)
    # drop_last: every step sees a full batch, so compiled graphs keep one shape.
    train_loader = DataLoader(train_set, batch_size=batch_size, sampler=sampler, drop_last=True,
                              pin_memory=pin_memory)
    val_shard = Subset(val_set, range(rank, len(val_set), world_size))
    val_loader = DataLoader(val_shard, batch_size=batch_size, pin_memory=pin_memory)
    return train_loader, sampler, val_loader


def batches(loader, sampler, epoch=0):
    """Endless stream of (epoch, inputs, targets); an optimizer step may span two epochs."""
    while True:
        sampler.set_epoch(epoch)  # DDP: without this every epoch repeats epoch 0's order
        for x, y in loader:
            yield epoch, x, y
        epoch += 1


# ----------------------------------------------------------------------------- training

def lr_at(step, args, total_steps):
    """Linear warm-up to --lr, then cosine decay to lr x --min-lr-ratio at the last step."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / max(1, total_steps - args.warmup_steps)
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model, args, on_gpu):
    """AdamW with weight decay on matrices and embeddings only (not biases, LayerNorm gains)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    # fused: one CUDA kernel for the whole update instead of several per parameter.
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=on_gpu)


@torch.no_grad()
def evaluate(model, val_loader, ddp, autocast):
    """Exact validation loss per token over all ranks: each rank sums its windows' losses, the
    sums and counts are all-reduced. `model` is the bare model: no DDP hooks, so ranks with
    different numbers of batches cannot deadlock."""
    model.eval()
    loss_sum, count = torch.zeros((), device=ddp.device, dtype=torch.float64), 0
    for x, y in val_loader:
        x, y = x.to(ddp.device, non_blocking=True), y.to(ddp.device, non_blocking=True)
        with autocast:
            loss = model(x, y)  # mean over the batch's tokens
        loss_sum += loss.double() * y.numel()
        count += y.numel()
    totals = torch.stack([loss_sum, torch.tensor(float(count), device=ddp.device, dtype=torch.float64)])
    dist.all_reduce(totals)  # DDP: sum every rank's loss sum and token count
    model.train()
    return (totals[0] / totals[1]).item()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mean_over_ranks(t, world_size):
    """The global mean of a per-rank scalar (for the log line; all ranks must call it)."""
    dist.all_reduce(t)  # DDP: SUM; gloo has no AVG
    return t.item() / world_size


def train(args, ddp, data):
    """Train on this rank. Returns the bare model and a dict of results."""
    on_gpu = ddp.device.type == "cuda"
    use_bf16 = args.dtype == "bf16" or (args.dtype == "auto" and on_gpu and torch.cuda.is_bf16_supported())
    autocast = torch.autocast(ddp.device.type, dtype=torch.bfloat16, enabled=use_bf16)
    torch.set_float32_matmul_precision("high")  # GPUs: fp32 matmuls (outside autocast) use TF32
    set_seed(args.seed)  # same seed everywhere -> same initial weights (DDP also broadcasts them)

    cfg = PRESETS[args.preset]
    cfg = GPTConfig(cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.block_size,
                    vocab_size=64 * math.ceil(data["n_vocab"] / 64))  # 50257 -> 50304: faster matmuls
    model = GPT(cfg).to(ddp.device)
    # DDP: wrap the model; gradients are all-reduced (averaged) in buckets during backward.
    # gradient_as_bucket_view: the .grad tensors live inside the buckets (no second copy).
    ddp_model = DDP(model, device_ids=[ddp.device.index] if on_gpu else None,
                    gradient_as_bucket_view=True)
    # DDP first, then compile: Dynamo splits the graph at bucket boundaries so the all-reduce
    # still overlaps with the backward. With one process there is nothing to overlap, and one
    # graph launches faster (H100, 124m, batch 8: 25.6 instead of 34.8 ms/step).
    if args.compile and ddp.world_size == 1:
        torch._dynamo.config.optimize_ddp = False
    step_model = torch.compile(ddp_model) if args.compile else ddp_model
    optimizer = make_optimizer(model, args, on_gpu)

    train_set = TokenWindows(data["train"], args.max_length, args.stride)
    val_set = TokenWindows(data["val"], args.max_length, args.max_length)  # each token once
    train_loader, sampler, val_loader = build_loaders(
        train_set, val_set, ddp.rank, ddp.world_size, args.batch_size, args.seed, pin_memory=on_gpu)
    stream = batches(train_loader, sampler)

    steps_per_epoch = max(1, len(train_loader) // args.grad_accum)
    total_steps = args.epochs * steps_per_epoch
    if args.max_steps:
        total_steps = min(total_steps, args.max_steps)
    if args.bench_steps:
        total_steps = BENCH_WARMUP + args.bench_steps
    eval_every = args.eval_every or steps_per_epoch
    tokens_per_step = args.batch_size * args.max_length * args.grad_accum * ddp.world_size
    n_params = model.num_params()
    fpt = flops_per_token(cfg, n_params, args.max_length)
    peak = peak_tflops(ddp.device, use_bf16, args.peak_tflops)

    def mfu(tokens_per_s):  # tokens/s is global; MFU is per device
        return f"{100 * fpt * tokens_per_s / ddp.world_size / (peak * 1e12):.1f}%" if peak else "n/a"

    print0(f"start: text {data['source']} | tokenizer {data['tokenizer']} ({data['n_vocab']} "
           f"tokens, padded {cfg.vocab_size}) | tokens {len(data['train'])} train, {len(data['val'])} "
           f"val | windows {len(train_set)} train, {len(val_set)} val | model {args.preset} "
           f"{model.num_params(False) / 1e6:.1f}M params | world {ddp.world_size} | backend "
           f"{ddp.backend} | device {ddp.device.type} | dtype {'bf16' if use_bf16 else 'fp32'} | "
           f"batch {args.batch_size}x{args.max_length} tokens/rank x {args.grad_accum} accum = "
           f"{tokens_per_step} tokens/step | steps {total_steps}")

    val_losses = []
    if not args.bench_steps:
        val_losses.append([0, evaluate(model, val_loader, ddp, autocast)])
        print0(f"step 0/{total_steps} | val_loss {val_losses[-1][1]:.4f}")

    step, epoch, t_start = 0, 0, time.perf_counter()
    t_log, loss_sum, rate = t_start, torch.zeros((), device=ddp.device), 0.0
    t_bench = None
    while step < total_steps:
        lr = lr_at(step, args, total_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        for micro in range(args.grad_accum):
            epoch, x, y = next(stream)
            x, y = x.to(ddp.device, non_blocking=True), y.to(ddp.device, non_blocking=True)
            # DDP: all-reduce only on the last micro-batch; before it, gradients just accumulate
            # locally (no_sync), so accumulation costs one all-reduce per step, not per micro-batch.
            last = micro == args.grad_accum - 1
            with (nullcontext() if last else ddp_model.no_sync()), autocast:
                loss = step_model(x, y) / args.grad_accum
            loss.backward()
            loss_sum += loss.detach()  # stays on the device: no host sync per step
        if args.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)  # same grads on all ranks
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1

        if args.bench_steps and step == BENCH_WARMUP:
            sync(ddp.device)  # the GPU runs behind the host: wait for it before starting the clock
            t_bench = time.perf_counter()
        if step % args.log_every == 0 or step == total_steps:
            n = (step - 1) % args.log_every + 1
            train_loss = mean_over_ranks(loss_sum, ddp.world_size) / n  # waits for the device
            now = time.perf_counter()
            rate = n * tokens_per_step / (now - t_log)
            eta = (total_steps - step) * (now - t_start) / step
            mem = f" | mem {torch.cuda.max_memory_allocated(ddp.device) / 2**30:.1f}GiB" if on_gpu else ""
            print0(f"epoch {epoch + 1} | step {step}/{total_steps} | loss {train_loss:.4f} | lr {lr:.2e} | "
                   f"{rate:.0f} tokens/s | mfu {mfu(rate)}{mem} | eta {datetime.timedelta(seconds=round(eta))}")
            t_log, loss_sum = now, torch.zeros((), device=ddp.device)
        if not args.bench_steps and (step % eval_every == 0 or step == total_steps):
            t_eval = time.perf_counter()
            val_losses.append([step, evaluate(model, val_loader, ddp, autocast)])
            print0(f"epoch {epoch + 1} | step {step}/{total_steps} | val_loss {val_losses[-1][1]:.4f}")
            # DDP: save the bare model (no 'module.' prefix); every rank calls, rank 0 writes.
            save_checkpoint({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                             "config": asdict(cfg), "n_vocab": data["n_vocab"],
                             "tokenizer": data["tokenizer"], "step": step,
                             "val_losses": val_losses, "args": vars(args)},
                            os.path.join(args.checkpoint_dir, "gpt2.pt"))
            t_log += time.perf_counter() - t_eval  # tokens/s counts training time only

    results = {"steps": step, "tokens_per_s": rate, "mfu": mfu(rate), "val_losses": val_losses,
               "time": time.perf_counter() - t_start, "use_bf16": use_bf16}
    if args.bench_steps:
        sync(ddp.device)
        dt = time.perf_counter() - t_bench
        results["tokens_per_s"] = args.bench_steps * tokens_per_step / dt
        results["mfu"] = mfu(results["tokens_per_s"])
        mem = f" | mem {torch.cuda.max_memory_allocated(ddp.device) / 2**30:.1f}GiB" if on_gpu else ""
        print0(f"bench: steps {args.bench_steps} after {BENCH_WARMUP} warm-up | "
               f"{1000 * dt / args.bench_steps:.1f} ms/step | {results['tokens_per_s']:.0f} tokens/s | "
               f"mfu {results['mfu']}{mem} | compile {args.compile} | "
               f"flops/token {fpt / 1e9:.3f}G | peak {peak or 'n/a'} TFLOP/s")
    return model, results


@torch.no_grad()
def generate(model, prompt_ids, n_tokens, n_vocab, args, device, autocast):
    """Sample n_tokens after the prompt from the bare model (no DDP: nothing collective)."""
    model.eval()
    g = torch.Generator(device=device).manual_seed(args.seed)
    idx = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    for _ in range(n_tokens):
        with autocast:
            logits = model(idx[:, -model.config.block_size:]).float()
        logits[:, n_vocab:] = -float("inf")  # the padding ids are not tokens
        if args.temperature == 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            logits = logits / args.temperature
            if args.top_k:
                kth = torch.topk(logits, min(args.top_k, n_vocab)).values[:, [-1]]
                logits[logits < kth] = -float("inf")
            nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=g)
        idx = torch.cat([idx, nxt], dim=1)
    return idx[0].tolist()


# ----------------------------------------------------------------------------- launch

def share_data(args, ddp):
    """Under torchrun: rank 0 reads and tokenizes, then broadcasts the tokens (or its error)."""
    box = [None]
    if ddp.is_main:
        try:
            box = [prepare(args, ddp.world_size)]
        except DataError as e:
            box = [("error", str(e), e.code)]
    dist.broadcast_object_list(box, src=0)  # DDP: every rank gets rank 0's tokens
    if isinstance(box[0], tuple):
        cleanup()
        if ddp.is_main:
            fail(box[0][1], box[0][2])
        sys.exit(box[0][2])  # the other ranks leave quietly: rank 0 printed the error
    return box[0]


def worker(rank, world_size, args, data):
    """One training process. mp.spawn passes rank, world size and the tokens; under torchrun
    rank and world_size are None (read from the environment) and data comes from rank 0."""
    ddp = setup(args.backend, rank=rank, world_size=world_size)  # DDP: join the process group
    if data is None:
        data = share_data(args, ddp)
    model, res = train(args, ddp, data)
    # DDP: every rank leaves the group here, together. Nothing after this line is collective, so
    # rank 0 can take its time generating while the others have already exited.
    cleanup()
    if not ddp.is_main:  # print0 would not work any more: no group, every rank looks like 0
        return
    sample = ""
    if args.generate_tokens and not args.bench_steps:
        enc = load_tokenizer(data["tokenizer"])
        autocast = torch.autocast(ddp.device.type, dtype=torch.bfloat16, enabled=res["use_bf16"])
        ids = generate(model, enc.encode_ordinary(args.prompt), args.generate_tokens,
                       data["n_vocab"], args, ddp.device, autocast)
        print(f"sample:\n{enc.decode(ids)}\n", flush=True)
        sample = f" | sample {len(ids) - len(enc.encode_ordinary(args.prompt))} tokens"
    val = f" | val_loss {res['val_losses'][-1][1]:.4f}" if res["val_losses"] else ""
    print(f"done: text {data['source']} | tokenizer {data['tokenizer']} | world {ddp.world_size} "
          f"| backend {ddp.backend} | device {ddp.device.type} | steps {res['steps']}{val} | "
          f"{res['tokens_per_s']:.0f} tokens/s | mfu {res['mfu']}{sample} | time {res['time']:.1f}s",
          flush=True)


def spawn_workers(args):
    """mp.spawn launch: tokenize once here, pick the rendezvous port, start the workers, and
    turn a worker's failure into one error line and a non-zero exit."""
    nproc = args.nproc or torch.cuda.device_count() or 1
    try:
        data = prepare(args, nproc)
    except DataError as e:
        fail(str(e), e.code)
    # DDP: the workers find rank 0 here. One node only: mp.spawn starts local processes.
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_port())
    # The error line below says what went wrong; torch's "Terminating process ..." warning about
    # stopping the other workers would only bury it.
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    try:
        # DDP: start nproc processes running worker(rank, nproc, args, data); join=True waits and
        # kills the rest as soon as one fails.
        mp.spawn(worker, args=(nproc, args, data), nprocs=nproc, join=True)
    except mp.ProcessRaisedException as e:  # a Python exception in a worker (traceback in e.msg)
        lines = [line for line in str(e).splitlines() if line.strip()]
        fail(f"rank {e.error_index} failed: {lines[-1].strip()[:300]} (run it under torchrun "
             "--standalone --nproc_per_node=N gpt2_ddp.py to see the traceback)", code=1)
    except mp.ProcessExitedException as e:
        if e.exit_code in (1, 2):  # the worker exited through fail(): its error line is printed
            sys.exit(e.exit_code)
        how = f"was killed by {e.signal_name}" if e.signal_name else f"exited with code {e.exit_code}"
        fail(f"rank {e.error_index} {how} (SIGKILL usually means out of memory)", code=1)
    except KeyboardInterrupt:
        sys.exit(128 + signal.SIGINT)


def main(argv=None):
    args = parse_args(argv)
    if "RANK" in os.environ:  # started by torchrun (or srun + torchrun): we are one worker
        worker(None, None, args, None)
    else:
        spawn_workers(args)


if __name__ == "__main__":
    main()
