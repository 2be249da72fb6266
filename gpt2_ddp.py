"""Lesson 5: fine-tune GPT-2 data-parallel (or train it from scratch), with mp.spawn or torchrun.

    python gpt2_ddp.py --nproc 2 --init-from gpt2 --text FILE --export-hf out/

New here: mp.spawn starts the workers; every rank loads the pretrained weights before DDP wraps
the model; a global batch that stays the same whatever the number of ranks, so a checkpoint
resumes on another world size; an exact validation loss; rank 0 exports the model for Hugging
Face transformers after leaving the group. GPT-2 itself is in gpt2_model.py. The DDP lines are
marked `# DDP:`."""

import argparse
import dataclasses
import itertools
import logging
import os
import sys
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

import gpt2_model
from ddp_checkpoint import load_checkpoint, save_checkpoint
from ddp_common import cleanup, fail, print0, set_seed, setup
from ddp_extras import free_port, long_barrier, pick_amp

CHECKPOINT = "gpt2.pt"
AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Lesson 5: GPT-2, data-parallel. docs/gpt2.md")
    parser.add_argument("--nproc", type=int, help="mp.spawn workers (default: 1 per GPU, else 1)")
    parser.add_argument("--init-from", default="scratch", help="scratch, gpt2[-medium|...], PATH")
    parser.add_argument("--preset", default="tiny", choices=list(gpt2_model.PRESETS))
    parser.add_argument("--tokenizer", default="gpt2", choices=["gpt2", "bytes"])
    parser.add_argument("--text", required=True, help="the UTF-8 text file to train on")
    parser.add_argument("--max-length", type=int, default=0, help="tokens per window (0: context)")
    parser.add_argument("--epochs", type=int, default=10, help="the lr schedule spans them")
    parser.add_argument("--max-steps", type=int, default=0, help="stop early (0: no cap)")
    parser.add_argument(
        "--batch-size", type=int, default=8, help="windows per rank, per micro-batch"
    )
    parser.add_argument("--global-batch-size", type=int, default=0, help="windows per step, total")
    parser.add_argument("--accum-steps", type=int, help="default 1, or from --global-batch-size")
    parser.add_argument("--lr", type=float, default=6e-4, help="peak lr (fine-tuning: 1e-4)")
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--clip-grad", type=float, default=1.0, help="gradient-norm clip (0: off)")
    parser.add_argument("--amp", default="auto", choices=["auto", "bf16", "fp16", "off"])
    parser.add_argument("--compile", action="store_true", help="torch.compile the DDP model")
    parser.add_argument("--save-every", type=int, default=0, help="steps (0: once per epoch)")
    parser.add_argument("--checkpoint-dir", default="./checkpoints")
    parser.add_argument("--resume", metavar="PATH|auto", help=f"auto: DIR/{CHECKPOINT} if any")
    parser.add_argument("--export-hf", metavar="DIR", help="a model for Hugging Face at the end")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", default="auto", choices=["auto", "nccl", "gloo"])
    args = parser.parse_args(argv)
    for name in ("nproc", "epochs", "batch_size", "accum_steps", "log_every"):
        value = getattr(args, name)
        if value is not None and value < 1:
            fail(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("max_length", "max_steps", "global_batch_size", "warmup_steps", "save_every"):
        if getattr(args, name) < 0:
            fail(f"--{name.replace('_', '-')} must not be negative")
    if args.clip_grad < 0:
        fail("--clip-grad must not be negative")
    if args.global_batch_size and args.accum_steps is not None:
        fail("--accum-steps follows from --global-batch-size: give one of the two")
    return args


def prepare(args, world_size):
    """Once per job (the mp.spawn parent, or torchrun's rank 0): the model config, the weights,
    the tokens, the batch arithmetic and the checkpoint to resume from. Every rank gets these."""
    if not os.path.isfile(args.text):
        fail(f"--text {args.text} is not a file")
    init, cfg, enc = gpt2_model.model_config(args.init_from, args.preset, args.tokenizer)
    max_length = args.max_length or cfg.block_size
    if max_length > cfg.block_size:
        fail(f"--max-length {max_length} exceeds the model's context ({cfg.block_size})")
    train, val = gpt2_model.encode_text(args.text, enc)
    global_batch, accum_steps = batch_sizes(args, world_size)
    windows = len(gpt2_model.TokenWindows(train, max_length))
    if len(val) <= max_length or windows < global_batch:
        too_few = f"{len(train)} training and {len(val)} validation tokens are too few"
        fail(f"{args.text}: {too_few} for {global_batch} windows of {max_length}: lower the batch")
    return {
        "train": train,
        "val": val,
        "source": os.path.basename(args.text),
        "tokenizer": args.tokenizer,
        "config": dataclasses.asdict(cfg),
        "init": init,
        "max_length": max_length,
        "global_batch": global_batch,
        "accum_steps": accum_steps,
        "resume": checkpoint_to_resume(args, global_batch, max_length),
    }


def batch_sizes(args, world_size):
    """The global batch (windows per optimizer step, over all ranks) and the accumulation steps
    that make it: global = world size x --batch-size x accumulation."""
    per_micro_batch = world_size * args.batch_size
    if args.global_batch_size:
        global_batch = args.global_batch_size
    else:
        global_batch = per_micro_batch * (args.accum_steps or 1)
    if global_batch % per_micro_batch:
        fail(
            f"--global-batch-size {global_batch} is not a multiple of {world_size} ranks x "
            f"--batch-size {args.batch_size}"
        )
    # DDP: the accumulation steps absorb the world size; the global batch stays what it is.
    return global_batch, global_batch // per_micro_batch


def checkpoint_to_resume(args, global_batch, max_length):
    """The checkpoint to resume from, or None. Another world size is fine (the accumulation steps
    absorb it); another global batch or window length would change the run: refused."""
    if args.resume is None:
        return None
    path = args.resume
    if args.resume == "auto":
        path = os.path.join(args.checkpoint_dir, CHECKPOINT)
        if not os.path.isfile(path):
            return None
    saved = load_checkpoint(path)
    if saved.get("global_batch") != global_batch or saved.get("max_length") != max_length:
        fail(
            f"{path} was saved with a global batch of {saved.get('global_batch')} windows of "
            f"{saved.get('max_length')} tokens, this run has {global_batch} of {max_length}: "
            f"resume with --global-batch-size {saved.get('global_batch')} --max-length "
            f"{saved.get('max_length')} (any world size and --batch-size that divide it)"
        )
    return path


def build_loaders(train_set, val_set, rank, world_size, batch_size, seed, pin=False):
    """Training: this rank's shard of a shuffled order. Validation: windows rank, rank + world
    size, ..., each on exactly one rank, so the all-reduced loss is exact."""
    # DDP: every rank sees a different, equally long part of the same shuffled order.
    sampler = DistributedSampler(
        train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=seed
    )
    train = DataLoader(train_set, batch_size, sampler=sampler, drop_last=True, pin_memory=pin)
    val_shard = Subset(val_set, range(rank, len(val_set), world_size))
    return train, sampler, DataLoader(val_shard, batch_size, pin_memory=pin)


def start_position(step, steps_per_epoch, global_batch, world_batch):
    """Where optimizer step `step` begins: (epoch, micro-batches each rank skips in it).
    The position is counted in global samples: the first `sample` windows of the epoch's order
    are done, and one micro-batch of all ranks (world size x batch) covers `world_batch` of them.
    DistributedSampler deals the order out rank by rank, so this holds for any world size."""
    epoch, step_in_epoch = divmod(step, steps_per_epoch)
    sample = step_in_epoch * global_batch
    return epoch, sample // world_batch


def batches(loader, sampler, per_epoch, epoch=0, skip=0):
    """Endless (epoch, inputs, targets): `per_epoch` micro-batches of each epoch, from
    micro-batch `skip` of `epoch` on (a resumed run)."""
    while True:
        # DDP: a new order each epoch, the same on every rank (without it: epoch 0's, always).
        sampler.set_epoch(epoch)
        for x, y in itertools.islice(loader, skip, per_epoch):
            yield epoch, x, y
        epoch += 1
        skip = 0


def build(args, ddp, data):
    """The model (from scratch, pretrained or resumed) in DDP, AdamW, GradScaler, the state."""
    cuda = ddp.device.type == "cuda"
    amp = pick_amp(args.amp, ddp.device)
    fp16_without_cuda = amp == "fp16" and not cuda
    bf16_emulated = (
        amp == "bf16" and cuda and not torch.cuda.is_bf16_supported(including_emulation=False)
    )
    if fp16_without_cuda or bf16_emulated:
        fail(f"--amp {amp} is not for this device: use --amp auto or off", rank0_only=True)
    # The same seed everywhere: the same initial weights (DDP broadcasts rank 0's as well).
    set_seed(args.seed)
    model = gpt2_model.GPT(gpt2_model.GPTConfig(**data["config"]))
    if data["init"] and not data["resume"]:
        # DDP: every rank loads the weights before the wrap. Another node fetches its own copy.
        local = data["init"]
        if not os.path.isfile(local):
            local = gpt2_model.pretrained(args.init_from)[0]
        gpt2_model.load_hf_weights(model, local)
    model.to(ddp.device)
    optimizer = gpt2_model.adamw(model, args.lr)
    scaler = torch.amp.GradScaler(ddp.device.type, enabled=amp == "fp16")
    state = {"step": 0, "val_losses": []}
    if data["resume"]:
        # Every rank, before the DDP wrap; read on the CPU, copied into place.
        state = load_checkpoint(
            data["resume"], "cpu", model=model, optimizer=optimizer, scaler=scaler
        )
        print0(f"resume: {data['resume']} | step {state['step']} | world {state['world_size']}")
    if ddp.world_size > 1:
        device_ids = [ddp.device.index] if cuda else None
        # DDP: all-reduce the gradients in buckets during backward; each .grad is a view into
        # its bucket (gradient_as_bucket_view), not a second copy.
        ddp_model = DDP(model, device_ids=device_ids, gradient_as_bucket_view=True)
    else:
        # One process has nothing to all-reduce: no wrapper, no hooks to pay for.
        ddp_model = model
    if args.compile:
        # DDP: compile the wrapper: Dynamo splits the graph at the buckets, so each all-reduce
        # still overlaps the backward.
        ddp_model = torch.compile(ddp_model)
    return model, ddp_model, optimizer, scaler, amp, state


def train_step(ddp_model, optimizer, scaler, micro_batches, clip_grad, autocast):
    """One optimizer step over the micro-batches; returns their loss (left on the device)."""
    # no_sync exists on the DDP wrapper only: None when one process is not wrapped.
    no_sync = getattr(ddp_model, "no_sync", None)
    total = 0.0
    for i, (x, y) in enumerate(micro_batches):
        sync = nullcontext()
        if no_sync is not None and i < len(micro_batches) - 1:
            # DDP: all-reduce only after the last micro-batch; until then gradients add up here.
            sync = no_sync()
        with sync, autocast:
            loss = ddp_model(x, y) / len(micro_batches)
        scaler.scale(loss).backward()
        total += loss.detach()
    if clip_grad:
        scaler.unscale_(optimizer)
        # The gradients are all-reduced, so every rank clips by the same norm.
        torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), clip_grad)
    scaler.step(optimizer)
    scaler.update()
    # DDP: zero in place, keeping the bucket views (None would make a new .grad, copied into
    # the bucket, every step). One process has no views: None is cheaper there.
    optimizer.zero_grad(set_to_none=no_sync is None)
    return total


@torch.no_grad()
def evaluate(model, val_loader, ddp, autocast):
    """The exact loss per token (sums all-reduced), on the bare model: no DDP hooks."""
    model.eval()
    totals = torch.zeros(2, device=ddp.device, dtype=torch.float64)
    for x, y in val_loader:
        with autocast:
            loss = model(x.to(ddp.device), y.to(ddp.device))
        totals[0] += loss.double() * y.numel()
        totals[1] += y.numel()
    # DDP: every rank's sums, added up.
    dist.all_reduce(totals)
    model.train()
    return (totals[0] / totals[1]).item()


def train(args, ddp, data):
    """Train on this rank; returns the bare model and the results."""
    model, ddp_model, optimizer, scaler, amp, state = build(args, ddp, data)
    dtype = AMP_DTYPES.get(amp)
    autocast = torch.autocast(ddp.device.type, dtype=dtype, enabled=dtype is not None)
    max_length = data["max_length"]
    accum_steps = data["accum_steps"]
    global_batch = data["global_batch"]
    train_set = gpt2_model.TokenWindows(data["train"], max_length)
    train_loader, sampler, val_loader = build_loaders(
        train_set,
        gpt2_model.TokenWindows(data["val"], max_length),
        ddp.rank,
        ddp.world_size,
        args.batch_size,
        args.seed,
        pin=ddp.device.type == "cuda",
    )
    # Steps per epoch follow from the global batch alone, never from the world size; so do the
    # lr schedule (in optimizer steps) and the data position.
    steps_per_epoch = len(train_set) // global_batch
    schedule = args.epochs * steps_per_epoch
    total = schedule
    if args.max_steps:
        total = min(schedule, args.max_steps)
    step = state["step"]
    val_losses = state["val_losses"]
    world_batch = ddp.world_size * args.batch_size
    epoch, skip = start_position(step, steps_per_epoch, global_batch, world_batch)
    stream = batches(train_loader, sampler, steps_per_epoch * accum_steps, epoch, skip)
    tokens_per_step = global_batch * max_length
    params = sum(p.numel() for p in model.parameters())
    print0(
        f"start: text {data['source']} | init {args.init_from} | vocab {model.config.vocab_size} "
        f"| model {params / 1e6:.1f}M params | world {ddp.world_size} | backend {ddp.backend} "
        f"| device {ddp.device.type} | amp {amp} | compile {args.compile} | batch "
        f"{args.batch_size}/rank x {accum_steps} accum x world {ddp.world_size} = {global_batch} "
        f"windows of {max_length} = {tokens_per_step} tokens/step | steps {total}"
    )
    if step == 0:
        val_losses.append([0, evaluate(model, val_loader, ddp, autocast)])
        print0(f"step 0/{total} | val_loss {val_losses[-1][1]:.4f}")
    t_start = time.perf_counter()
    t_log = t_start
    start = step
    logged = step
    loss_sum = torch.zeros((), device=ddp.device)
    rate = 0.0
    while step < total:
        lr = gpt2_model.lr_at(step, args.lr, args.warmup_steps, schedule)
        for group in optimizer.param_groups:
            group["lr"] = lr
        micro_batches = []
        for _ in range(accum_steps):
            epoch, x, y = next(stream)
            x = x.to(ddp.device, non_blocking=True)
            y = y.to(ddp.device, non_blocking=True)
            micro_batches.append((x, y))
        loss_sum += train_step(
            ddp_model, optimizer, scaler, micro_batches, args.clip_grad, autocast
        )
        step += 1
        if step % args.log_every == 0 or step == total:
            now = time.perf_counter()
            # DDP: the loss of all ranks, for the log line only (gloo has no AVG: sum, divide).
            dist.all_reduce(loss_sum)
            loss = loss_sum.item() / (step - logged) / ddp.world_size
            rate = (step - logged) * tokens_per_step / (now - t_log)
            eta = (total - step) * (now - t_start) / (step - start)
            line = f"epoch {epoch + 1} | step {step}/{total} | loss {loss:.4f} | lr {lr:.2e}"
            line += f" | {rate:.0f} tokens/s"
            if ddp.device.type == "cuda":
                line += f" | mem {torch.cuda.max_memory_allocated() / 2**30:.1f}GiB"
            print0(f"{line} | eta {eta:.0f}s")
            t_log = now
            logged = step
            loss_sum = torch.zeros((), device=ddp.device)
        if step % (args.save_every or steps_per_epoch) == 0 or step == total:
            t_pause = time.perf_counter()
            val_losses.append([step, evaluate(model, val_loader, ddp, autocast)])
            print0(f"epoch {epoch + 1} | step {step}/{total} | val_loss {val_losses[-1][1]:.4f}")
            checkpoint = {
                # DDP: the bare model's weights, without the wrapper's 'module.' prefix.
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scaler": scaler.state_dict(),
                "step": step,
                "val_losses": val_losses,
                "config": data["config"],
                "tokenizer": data["tokenizer"],
                # What a resumed run must match (global batch, max length) or may change.
                "global_batch": global_batch,
                "max_length": max_length,
                "world_size": ddp.world_size,
                "batch_size": args.batch_size,
                "accum_steps": accum_steps,
            }
            # DDP: every rank calls (it ends in a barrier); rank 0 writes.
            save_checkpoint(checkpoint, os.path.join(args.checkpoint_dir, CHECKPOINT))
            # tokens/s counts training time only.
            t_log += time.perf_counter() - t_pause
    results = {
        "steps": step,
        "tokens_per_s": rate,
        "val_losses": val_losses,
        "time": time.perf_counter() - t_start,
    }
    return model, results


def worker(rank, world_size, args, data):
    """One process. mp.spawn passes rank, world size and data; under torchrun (all None) the
    environment says who this is, and rank 0 prepares the data."""
    # DDP: join the process group.
    ddp = setup(args.backend, rank=rank, world_size=world_size)
    if data is None:
        # torchrun: rank 0 prepares (or fails, and torchrun stops the others).
        box = [None]
        if ddp.is_main:
            box = [prepare(args, ddp.world_size)]
        # DDP: the others wait while rank 0 tokenizes, longer than a collective may.
        long_barrier()
        # DDP: every rank gets rank 0's tokens and decisions.
        dist.broadcast_object_list(box, src=0)
        data = box[0]
    model, results = train(args, ddp, data)
    # DDP: every rank leaves the group here, together. Nothing after this is collective, so
    # rank 0 can export while the others exit (print0 no longer knows the rank: test is_main).
    cleanup()
    if not ddp.is_main:
        return
    if args.export_hf:
        gpt2_model.export_hf(model, args.export_hf)
    print(
        f"done: text {data['source']} | tokenizer {data['tokenizer']} | world {ddp.world_size} "
        f"| backend {ddp.backend} | device {ddp.device.type} | steps {results['steps']} "
        f"| val_loss {results['val_losses'][-1][1]:.4f} | {results['tokens_per_s']:.0f} tokens/s "
        f"| time {results['time']:.1f}s",
        flush=True,
    )


def spawn_workers(args):
    """The mp.spawn launch: prepare once here, pick the port, start one worker per rank."""
    # More processes than GPUs: setup() says so and runs them on the CPU.
    nproc = args.nproc or torch.cuda.device_count() or 1
    data = prepare(args, nproc)
    # DDP: the workers meet at this address; mp.spawn starts processes on this machine only.
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    # A failing worker is reported in one line below, not in torch's 40.
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    try:
        # DDP: nproc processes run worker(rank, nproc, args, data); one failing stops the rest.
        mp.spawn(worker, args=(nproc, args, data), nprocs=nproc, join=True)
    except mp.ProcessRaisedException as e:
        # A Python exception in a worker: its last line.
        last_line = str(e).strip().splitlines()[-1]
        fail(f"rank {e.error_index} failed: {last_line[:300]}", code=1)
    except mp.ProcessExitedException as e:
        if e.exit_code in (1, 2):
            # It left through fail(): its line is printed already.
            sys.exit(e.exit_code)
        fail(f"rank {e.error_index} died ({e.signal_name})", code=1)


if __name__ == "__main__":
    args = parse_args()
    if "RANK" in os.environ:
        # Started by torchrun: this process is one of its workers.
        if args.nproc:
            fail("--nproc is for mp.spawn: under torchrun, --nproc_per_node decides")
        worker(None, None, args, None)
    else:
        spawn_workers(args)
