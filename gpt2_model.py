"""GPT-2 for lesson 5 (gpt2_ddp.py), kept beside it as nanoGPT keeps model.py beside train.py:
the model, its chunked loss, its optimizer, the tokenizer and the token windows, and the Hugging
Face import and export. Nothing in this file is about DDP; docs/gpt2.md explains each part."""

import dataclasses
import json
import math
import os

import tiktoken
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.utils.data import Dataset

from ddp_common import fail

# The released GPT-2s on the Hugging Face Hub, each at openai-community/<name>.
HUB_MODELS = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
# Hugging Face stores these as Conv1D weights, shaped (in, out): the transpose of nn.Linear's.
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Logits per chunk of the loss (see LMHeadLoss): 16 MB of fp32 on a CPU, 1 GiB on a GPU.
LOSS_CHUNK = {"cpu": 2**22, "cuda": 2**28}


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    n_layer: int
    n_head: int
    n_embd: int
    # The context: how many positions the model has embeddings for.
    block_size: int
    vocab_size: int = 50257


# Model sizes for training from scratch (--preset).
PRESETS = {
    "124m": GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024),
    "tiny": GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=256),
}


class Block(nn.Module):
    """A pre-LayerNorm transformer block. The modules are named as in Hugging Face's GPT-2, so its
    weights load by name."""

    def __init__(self, cfg):
        super().__init__()
        width = cfg.n_embd
        self.n_head = cfg.n_head
        self.ln_1 = nn.LayerNorm(width)
        self.ln_2 = nn.LayerNorm(width)
        self.attn = nn.Module()
        # q, k and v in one matmul.
        self.attn.c_attn = nn.Linear(width, 3 * width)
        self.attn.c_proj = nn.Linear(width, width)
        self.mlp = nn.Module()
        self.mlp.c_fc = nn.Linear(width, 4 * width)
        self.mlp.c_proj = nn.Linear(4 * width, width)

    def forward(self, x):
        # B: batch, T: time (tokens), C: channels (n_embd).
        B, T, C = x.shape
        qkv = self.attn.c_attn(self.ln_1(x)).view(B, T, 3, self.n_head, C // self.n_head)
        # Each of q, k, v: (B, heads, T, head size).
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        # is_causal: the mask lives in the kernel. A mask buffer would be broadcast by DDP on
        # every forward.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn.c_proj(y.transpose(1, 2).reshape(B, T, C))
        hidden = F.gelu(self.mlp.c_fc(self.ln_2(x)), approximate="tanh")
        return x + self.mlp.c_proj(hidden)


class LMHeadLoss(torch.autograd.Function):
    """The mean cross-entropy of the logits x @ w.T, and its gradients, computed a chunk of rows
    at a time, so the (tokens x vocabulary) logits never exist at once. A chunk holds
    LOSS_CHUNK logits: on a CPU 16 MB, under glibc's 32 MB mmap threshold, so each chunk reuses
    the last one's memory instead of faulting in fresh pages; on a GPU 1 GiB, for large matmuls."""

    @staticmethod
    def forward(ctx, x, w, targets, vocab_size, needs_grad):
        chunk = LOSS_CHUNK.get(x.device.type, LOSS_CHUNK["cuda"])
        rows = max(1, chunk // len(w))
        ctx.dx = torch.empty_like(x)
        ctx.dw = torch.zeros_like(w)
        device = x.device.type
        fp16 = torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == torch.half
        loss = 0.0
        for xs, ts, dxs in zip(x.split(rows), targets.split(rows), ctx.dx.split(rows), strict=True):
            logits = (xs @ w.t()).float()
            # The padding ids past the vocabulary are not tokens: never predicted.
            logits[:, vocab_size:] = float("-inf")
            lse = logits.logsumexp(1)
            loss += (lse - logits.gather(1, ts[:, None]).squeeze(1)).sum()
            if needs_grad:
                # d(summed loss) / d(logits) = softmax - one-hot, written over the logits.
                probs = logits.sub_(lse[:, None]).exp_()
                probs[torch.arange(len(ts), device=ts.device), ts] -= 1
                dxs.copy_(probs @ w)
                if fp16:  # over a chunk's rows, before any loss scale, fp16 can pass 65504
                    ctx.dw.addmm_(probs.t(), xs.float())  # in place: not autocast, fp32
                else:  # under autocast: bf16 products, summed in fp32
                    ctx.dw += probs.t() @ xs
        return loss / len(x)

    @staticmethod
    def backward(ctx, grad):
        # The chain rule. The mean's 1 / tokens comes here, in fp32: in fp16 it would underflow.
        scale = grad / len(ctx.dx)
        return ctx.dx * scale, ctx.dw * scale, None, None, None


class GPT(nn.Module):
    """GPT-2: a pre-LayerNorm decoder, learned positions, tied input and output embeddings."""

    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        # The embedding rounded up to a multiple of 64 rows (faster matmuls); the extra rows are
        # padding, never a token.
        padded = 64 * math.ceil(cfg.vocab_size / 64)
        self.wte = nn.Embedding(padded, cfg.n_embd)
        # Learned positions.
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, padded, bias=False)
        # Tied: one matrix for both, counted (and all-reduced) once.
        self.lm_head.weight = self.wte.weight
        self.init_weights()

    def init_weights(self):
        """GPT-2's init: normal(0, 0.02), zero biases, the residual projections scaled by depth."""
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif name.endswith("c_proj.weight"):
                nn.init.normal_(p, std=residual_std)
            elif p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx, targets=None):
        """With targets: the mean cross-entropy. Without: the last position's logits."""
        positions = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(positions)
        for block in self.h:
            x = block(x)
        if targets is None:
            # The logits of the last position, over the real tokens only.
            x = self.ln_f(x[:, -1, :])
            return self.lm_head(x)[:, : self.config.vocab_size].float()
        x = self.ln_f(x)
        # The loss, never holding all the logits at once.
        return LMHeadLoss.apply(
            x.flatten(0, 1),
            self.lm_head.weight,
            targets.flatten(),
            self.config.vocab_size,
            torch.is_grad_enabled(),
        )


def adamw(model, lr):
    """GPT-2's AdamW: weight decay on the matrices only, betas (0.9, 0.95). fused: one kernel
    for all the parameters, on the CPU too."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=True)


def lr_at(step, peak_lr, total_steps, warmup_steps=10):
    """GPT-2's schedule: linear warm-up to peak_lr, then cosine decay to peak_lr / 10 at the last
    step. Counted in optimizer steps, so it is the same on any number of ranks."""
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return peak_lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def load_tokenizer(name):
    """tiktoken's GPT-2 BPE ("gpt2"), or "bytes": one token per byte, no download."""
    if name == "bytes":
        from tiktoken_ext.openai_public import r50k_pat_str

        # The 256 bytes, <|endoftext|> as token 256, GPT-2's pre-tokenizer, no merges.
        return tiktoken.Encoding(
            name="bytes",
            pat_str=r50k_pat_str,
            special_tokens={"<|endoftext|>": 256},
            mergeable_ranks={bytes([b]): b for b in range(256)},
        )
    try:
        # Two files, downloaded once and cached in TIKTOKEN_CACHE_DIR.
        return tiktoken.get_encoding("gpt2")
    except Exception as e:
        fail(
            f"cannot load tiktoken's gpt2 files ({type(e).__name__}). Offline: set "
            "TIKTOKEN_CACHE_DIR to a filled cache, or use --tokenizer bytes",
            code=1,
        )


def encode_text(path, enc):
    """The tokens of a UTF-8 text file: (training, validation), the validation set its last 10%."""
    if not os.path.isfile(path):
        fail(f"--text {path} is not a file")
    with open(path, encoding="utf-8", errors="replace") as f:
        tokens = torch.tensor(enc.encode_ordinary(f.read()), dtype=torch.long)
    split = len(tokens) - len(tokens) // 10
    return tokens[:split], tokens[split:]


class TokenWindows(Dataset):
    """Window i: max_length tokens from i * stride on (stride: max_length unless given); its
    targets are its inputs shifted left by one token."""

    def __init__(self, tokens, max_length, stride=None):
        self.tokens = tokens
        self.max_length = max_length
        if stride is None:
            stride = max_length
        # Each window needs max_length + 1 tokens: start + max_length < len(tokens).
        self.starts = range(0, len(tokens) - max_length, stride)

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, i):
        start = self.starts[i]
        chunk = self.tokens[start : start + self.max_length + 1]
        return chunk[:-1], chunk[1:]


def model_config(init_from, preset, tokenizer):
    """(weights, config, encoding): the pretrained weights' path and shapes, or (None, the
    preset) from scratch, with the tokenizer's vocabulary."""
    if init_from == "scratch":
        enc = load_tokenizer(tokenizer)
        return None, dataclasses.replace(PRESETS[preset], vocab_size=enc.n_vocab), enc
    path, cfg = pretrained(init_from)
    enc = load_tokenizer(tokenizer)
    if cfg.vocab_size != enc.n_vocab:
        # GPT-2's weights read GPT-2's token ids.
        fail(f"--init-from has {cfg.vocab_size} tokens, --tokenizer {tokenizer} {enc.n_vocab}")
    return path, cfg, enc


def pretrained(init_from):
    """The model.safetensors behind --init-from, and its GPTConfig. A Hub name is downloaded
    (once: the Hub caches it in HF_HOME); a directory stands for its model.safetensors."""
    if init_from in HUB_MODELS:
        path = download(init_from)
    elif os.path.isdir(init_from):
        path = os.path.join(init_from, "model.safetensors")
    else:
        path = init_from
    if not os.path.isfile(path):
        fail(f"--init-from {init_from}: want scratch, gpt2 or a model.safetensors (or its dir)")
    # safe_open reads the header only: the tensor shapes give the config.
    try:
        with safe_open(path, "pt") as f:
            shapes = {k.removeprefix("transformer."): f.get_slice(k).get_shape() for k in f.keys()}
    except Exception as e:  # an old pytorch_model.bin, a text file: no safetensors header
        fail(f"--init-from {path}: not a safetensors file ({str(e).splitlines()[0][:100]})")
    if "wte.weight" not in shapes or "wpe.weight" not in shapes:
        fail(f"--init-from {path}: not a GPT-2 model.safetensors (no wte/wpe weights)")
    n_vocab, n_embd = shapes["wte.weight"]
    block_size = shapes["wpe.weight"][0]
    n_layer = sum(k.endswith(".ln_1.weight") for k in shapes)
    # No shape says how many heads: config.json beside the file does, else GPT-2's 64-wide heads.
    config_json = os.path.join(os.path.dirname(path), "config.json")
    if os.path.isfile(config_json):
        try:
            with open(config_json) as f:
                n_head = int(json.load(f)["n_head"])
        except (ValueError, KeyError, TypeError) as e:
            fail(f"{config_json}: no n_head (a GPT-2 config.json has one): {e!r}"[:300])
    else:
        n_head = n_embd // 64
    return path, GPTConfig(n_layer, n_head, n_embd, block_size, n_vocab)


def download(name):
    """openai-community/<name>'s model.safetensors from the Hub (or its cache in HF_HOME)."""
    from huggingface_hub import hf_hub_download

    try:
        return hf_hub_download(f"openai-community/{name}", "model.safetensors")
    except Exception as e:
        # Offline without a cached copy, a proxy, ...
        fail(
            f"cannot get openai-community/{name} ({type(e).__name__}). Run once with network "
            "(then it is cached in HF_HOME), or download it: --init-from PATH",
            code=1,
        )


@torch.no_grad()
def load_hf_weights(model, path):
    """Hugging Face GPT-2 weights into `model`: Conv1D weights transposed, the padding rows of
    the embedding keep their init, the attention masks HF stores are left out."""
    state = {k.removeprefix("transformer."): v for k, v in load_file(path).items()}
    wte = state.pop("wte.weight")
    model.wte.weight[: len(wte)] = wte
    weights = {}
    for name, tensor in state.items():
        if name == "lm_head.weight" or name.endswith((".attn.bias", ".attn.masked_bias")):
            continue
        if name.endswith(CONV1D):
            tensor = tensor.t()
        weights[name] = tensor
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if set(missing) != {"wte.weight", "lm_head.weight"} or unexpected:
        fail(f"{path} does not fit GPT-2: missing {missing[:3]}, unexpected {unexpected[:3]}", 1)


def export_hf(model, out_dir):
    """model.safetensors + config.json, which transformers' GPT2LMHeadModel.from_pretrained reads:
    Conv1D weights transposed back, the padding rows dropped, no lm_head (it is tied)."""
    cfg = model.config
    state = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        if name.endswith(CONV1D):
            tensor = tensor.t()
        state[name] = tensor.contiguous().cpu()
    state["wte.weight"] = state["wte.weight"][: cfg.vocab_size].contiguous()
    os.makedirs(out_dir, exist_ok=True)
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.block_size,
        "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        # <|endoftext|>, the last token.
        "bos_token_id": cfg.vocab_size - 1,
        "eos_token_id": cfg.vocab_size - 1,
    }
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f)
