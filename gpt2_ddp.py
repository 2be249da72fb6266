"""Lesson 5: fine-tune GPT-2 on a text, one command. main() prepares once (token windows, weights,
--resume), then mp.spawn starts worker(rank) per GPU: each trains its share of every global batch
and leaves the group; rank 0 then exports for Hugging Face. GPT-2 itself is in gpt2_model.py.

    python gpt2_ddp.py --init-from gpt2 --text FILE --lr 1e-4 --export-hf out/
"""

import contextlib
import logging
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import gpt2_model
from ddp_common import (
    Parser,
    cleanup,
    fail,
    free_port,
    load_checkpoint,
    positive_int,
    print0,
    save_checkpoint,
    setup,
)


def parse_args():
    parser = Parser(description="Lesson 5: GPT-2, data-parallel. docs/gpt2.md")
    parser.add_argument("--nproc", type=positive_int, help="workers (default: 1 per GPU, else 1)")
    parser.add_argument("--init-from", default="scratch", help="scratch, gpt2[-medium...], PATH")
    parser.add_argument("--preset", default="tiny", choices=list(gpt2_model.PRESETS))
    parser.add_argument("--tokenizer", default="gpt2", choices=["gpt2", "bytes"])
    parser.add_argument("--text", required=True, help="a UTF-8 file: its last 10%% validates")
    parser.add_argument("--max-length", type=positive_int, help="tokens per window (the context)")
    parser.add_argument("--epochs", type=positive_int, default=10, help="the lr schedule's span")
    parser.add_argument("--max-steps", type=positive_int, help="stop at step N (of --epochs)")
    parser.add_argument("--batch-size", type=positive_int, default=8, help="per micro-batch")
    parser.add_argument("--global-batch-size", type=positive_int, help="windows per step")
    parser.add_argument("--lr", type=float, default=6e-4, help="peak lr (fine-tuning: 1e-4)")
    parser.add_argument("--amp", default="auto", choices=["auto", "bf16", "fp16", "off"])
    parser.add_argument("--compile", action="store_true", help="torch.compile the DDP model")
    parser.add_argument("--checkpoint-dir", default="./checkpoints/lesson5", help="for last.pt")
    parser.add_argument("--resume", metavar="PATH|auto", help="auto: DIR/last.pt if it exists")
    parser.add_argument("--export-hf", metavar="DIR", help="at the end: a transformers model")
    parser.add_argument("--log-every", type=positive_int, default=10, help="steps per log line")
    return parser.parse_args()


def my_share(mine, step, global_batch, rank, world_size):
    """DDP: rank r's part of step s: positions sG .. (s+1)G - 1 of the epoch's shuffle, where
    mine[j] is position r + jW, so j runs ceil((sG - r) / W) .. ceil(((s+1)G - r) / W) - 1
    (-(-a // b) is ceil(a / b)). The same windows on any W (G 16, W 3: 6, 5 and 5 at step 0)."""
    begin = -(-(step * global_batch - rank) // world_size)
    end = -(-((step + 1) * global_batch - rank) // world_size)
    return mine[begin:end]


def pick_amp(choice, device):
    """--amp auto: bf16 where the GPU has it, else fp16 (with a GradScaler); off on CPUs."""
    if choice != "auto":
        return choice
    if device.type != "cuda":
        return "off"
    # A T4 or a V100 only emulates bf16, slowly: is_bf16_supported() alone says yes there.
    return "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp16"


def prepare(args, world_size):
    """Before any process joins the group, so no collective waits on a download: the windows, the
    weights, and args resolved (length, checkpoint, global batch). A mistake: one line here."""
    weights_path, cfg, enc = gpt2_model.model_config(args.init_from, args.preset, args.tokenizer)
    args.max_length = args.max_length or cfg.block_size
    if args.max_length > cfg.block_size:
        fail(f"--max-length {args.max_length} exceeds the model's context ({cfg.block_size})")
    tokens = gpt2_model.encode_text(args.text, enc)
    train, val = (gpt2_model.TokenWindows(t, args.max_length) for t in tokens)
    if args.resume == "auto":
        args.resume = os.path.join(args.checkpoint_dir, "last.pt")
        if not os.path.isfile(args.resume):
            print0(f"resume: no {args.resume} yet; starting at step 0")
            args.resume = None
    saved = load_checkpoint(args.resume) if args.resume else {}
    # G, windows per step over all ranks: the flag, the checkpoint's, or batch x world size.
    G = args.global_batch_size or saved.get("global_batch") or args.batch_size * world_size
    if saved and (saved.get("global_batch"), saved.get("max_length")) != (G, args.max_length):
        was = f"{saved.get('global_batch')} --max-length {saved.get('max_length')}"
        fail(f"{args.resume} was saved by another run: resume with --global-batch-size {was}")
    # Every rank needs a window of each step (or it would not join the step's all-reduce).
    if len(train) < G or len(val) == 0 or world_size > G:
        why = f"{len(train)} training and {len(val)} validation windows of {args.max_length} tokens"
        fail(f"{args.text}: {why}, a global batch of {G} over {world_size} ranks: too few")
    args.global_batch_size = G
    return dict(train=train, val=val, config=cfg, weights_path=weights_path)


class Trainer:
    def __init__(self, args, ddp, data):
        self.args = args
        self.ddp = ddp
        self.device = ddp.device
        self.train_set, self.val_set = data["train"], data["val"]
        self.amp = pick_amp(args.amp, ddp.device)
        self.amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "off": None}[self.amp]
        self.global_batch = args.global_batch_size
        # An epoch is every whole global batch of windows, on any world size.
        self.steps_per_epoch = len(self.train_set) // self.global_batch
        self.total_steps = args.epochs * self.steps_per_epoch
        self.last_step = min(self.total_steps, args.max_steps or self.total_steps)
        # DDP copies rank 0's initial weights to all anyway; the seed makes them the same on any W.
        torch.manual_seed(0)
        model = gpt2_model.GPT(data["config"])
        if data["weights_path"] and not args.resume:
            # DDP: every rank loads them, before the wrap (which copies rank 0's to all anyway).
            gpt2_model.load_hf_weights(model, data["weights_path"])
        self.bare = model.to(self.device)
        self.optimizer = gpt2_model.adamw(model, args.lr)
        # fp16's small gradients underflow unless the loss is scaled up; bf16's do not.
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.amp == "fp16")
        self.step = self._resume(model)
        # DDP: wrap the model; its backward all-reduces the gradients in buckets, and after it
        # each .grad is a view into its bucket (not a second copy). One process has nothing to
        # all-reduce.
        self.model = DDP(model, gradient_as_bucket_view=True) if ddp.world_size > 1 else model
        # DDP first, then compile: the compiler sees DDP's buckets and overlaps their all-reduce.
        self.forward = torch.compile(self.model) if args.compile else self.model
        # DDP: rank r draws positions r, r+W, r+2W, ... of the epoch's shuffle (see my_share).
        self.sampler = DistributedSampler(self.train_set, ddp.world_size, ddp.rank)

    def _resume(self, model):
        """Every rank loads the checkpoint (to the CPU, before the DDP wrap). Returns its step."""
        path = self.args.resume
        ckpt = load_checkpoint(path, model=model, optimizer=self.optimizer) if path else {}
        found = [None] * self.ddp.world_size
        # DDP: every rank must start from the same step, or they take different steps and hang.
        # With node-local disks some ranks may not see the file: compare what each found.
        dist.all_gather_object(found, ckpt.get("step"))
        if len(set(found)) > 1:
            why = f"ranks found different checkpoints (step by rank: {found})"
            fail(f"{why}: give every rank the same one, or remove them all", 1, rank0_only=True)
        if not ckpt:
            return 0
        # Saved without fp16 (an H100 run, requeued on a V100): no loss scale to take over.
        if ckpt["scaler"]:
            self.scaler.load_state_dict(ckpt["scaler"])
        was = ckpt["world_size"]
        print0(f"resumed: {path} | step {ckpt['step']} | world {was} -> {self.ddp.world_size}")
        return ckpt["step"]

    def _run_batch(self, x, y):
        """One optimizer step on this rank's share of the global batch, in micro-batches."""
        for group in self.optimizer.param_groups:
            group["lr"] = gpt2_model.lr_at(self.step, self.args.lr, self.total_steps)
        # Micro-batches of --batch-size bound the activations' memory; the step trains them all.
        inputs = x.to(self.device, non_blocking=True).split(self.args.batch_size)
        targets = y.to(self.device, non_blocking=True).split(self.args.batch_size)
        loss_sum = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(zip(inputs, targets, strict=True)):
            # DDP: only the step's last micro-batch all-reduces (no_sync; one process: not wrapped).
            last = i == len(inputs) - 1 or self.ddp.world_size == 1
            with contextlib.nullcontext() if last else self.model.no_sync():
                with torch.autocast(self.device.type, self.amp_dtype, self.amp != "off"):
                    # DDP: each window's mean loss, summed, x W/G: DDP averages the W ranks'
                    # gradients, so the step's is the mean over its G windows, however split.
                    loss = self.forward(x, y) * (len(x) * self.ddp.world_size / self.global_batch)
                self.scaler.scale(loss).backward()
            loss_sum += loss.detach()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum

    def _run_epoch(self, epoch):
        # DDP: a new shuffle every epoch, the same in every process (without it: epoch 0's order).
        self.sampler.set_epoch(epoch)
        mine = list(self.sampler)
        first = epoch * self.steps_per_epoch
        steps = range(self.step, min(first + self.steps_per_epoch, self.last_step))
        rank, world_size = self.ddp.rank, self.ddp.world_size
        shares = [my_share(mine, s - first, self.global_batch, rank, world_size) for s in steps]
        # The sampler only orders: the loader reads each step's share.
        pin = self.device.type == "cuda"
        batches = DataLoader(self.train_set, batch_sampler=shares, pin_memory=pin)
        # The loss summed on the device between log lines: no wait for the GPU per step.
        loss_sum = torch.zeros((), device=self.device)
        logged = self.step
        start = time.perf_counter()
        for x, y in batches:
            loss_sum += self._run_batch(x, y)
            self.step += 1
            if self.step % self.args.log_every == 0 or self.step == steps.stop:
                tokens = (self.step - logged) * self.global_batch * self.args.max_length
                # DDP: add up every rank's loss (each x W/G): W times the mean over the windows.
                dist.all_reduce(loss_sum)
                # .item() waits for the device: once per log line.
                print0(
                    f"epoch {epoch + 1}/{self.args.epochs} | step {self.step}/{self.last_step} "
                    f"| loss {loss_sum.item() / world_size / (self.step - logged):.4f} | "
                    f"{tokens / (time.perf_counter() - start):.0f} tokens/s"
                )
                loss_sum.zero_()
                logged = self.step
                start = time.perf_counter()

    @torch.no_grad()
    def evaluate(self):
        # DDP: rank r scores windows r, r+W, r+2W, ...; a DistributedSampler would pad the
        # shards with repeated windows to make them equal.
        shard = range(self.ddp.rank, len(self.val_set), self.ddp.world_size)
        total = torch.zeros((), device=self.device, dtype=torch.float64)
        for x, y in DataLoader(self.val_set, self.args.batch_size, sampler=shard):
            # DDP: the bare model: a forward through the wrapper may start a collective.
            loss = self.bare(x.to(self.device), y.to(self.device))
            total += loss.double() * len(y)
        # DDP: add up every process's sums: each window counted once.
        dist.all_reduce(total)
        return total.item() / len(self.val_set)

    def _save_checkpoint(self):
        state = {
            # DDP: the bare model's weights, without the wrapper's "module." prefix.
            "model": self.bare.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "step": self.step,
            "epoch": self.step // self.steps_per_epoch,
            "global_batch": self.global_batch,
            "world_size": self.ddp.world_size,
            # A resume must cut the same windows; the config lets any script rebuild the model.
            "max_length": self.args.max_length,
            "config": vars(self.bare.config),
        }
        # DDP: every process holds the same weights: rank 0 writes, the others wait.
        save_checkpoint(state, os.path.join(self.args.checkpoint_dir, "last.pt"))

    def train(self):
        """Validate, then per epoch: train, validate, save. Returns the last validation loss."""
        while True:
            loss = self.evaluate()
            print0(f"step {self.step}/{self.last_step} | val_loss {loss:.4f}")
            if self.step >= self.last_step:
                return loss
            self._run_epoch(self.step // self.steps_per_epoch)
            self._save_checkpoint()


def worker(rank, world_size, args, data):
    """One process: mp.spawn passes its rank and the world size (torchrun: None, see main)."""
    # DDP: join the process group (torchrun: its environment says which process this is).
    ddp = setup(rank=rank, world_size=world_size)
    trainer = Trainer(args, ddp, data)
    print0(
        f"start: init {args.init_from} | world {ddp.world_size} | device {ddp.device.type} | amp "
        f"{trainer.amp} | batch {args.batch_size}/micro-batch, {trainer.global_batch} global x "
        f"{args.max_length} tokens | steps {trainer.step}->{trainer.last_step}"
    )
    start = time.perf_counter()
    loss = trainer.train()
    # DDP: delete the wrapper first (alive when the group is gone, it can abort gloo at exit), then
    # every rank leaves the group. Nothing after is collective: rank 0 alone exports and prints.
    del trainer.model, trainer.forward
    cleanup()
    if ddp.rank == 0:
        if args.export_hf:
            gpt2_model.export_hf(trainer.bare, args.export_hf)
        seconds = time.perf_counter() - start
        print(f"done: steps {trainer.step} | val_loss {loss:.4f} | time {seconds:.1f}s")


def main():
    args = parse_args()
    if "RANK" in os.environ:
        # Started by torchrun: this process is one of its workers; it prepares its own data.
        return worker(None, None, args, prepare(args, int(os.environ["WORLD_SIZE"])))
    nproc = args.nproc or torch.cuda.device_count() or 1
    data = prepare(args, nproc)
    # DDP: the workers meet here: mp.spawn starts them on this machine (whatever a shell exported).
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    # A failing worker is reported in one line below, not in torch's 40.
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    try:
        # DDP: nproc processes run worker(rank, nproc, args, data); one failing stops the rest.
        mp.spawn(worker, args=(nproc, args, data), nprocs=nproc)
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        if getattr(e, "exit_code", None) in (1, 2):
            # It left through fail(): its line is printed already.
            raise SystemExit(e.exit_code) from None
        # A Python exception (its last line) or a signal, in one line.
        fail(f"rank {e.error_index} failed: {str(e).strip().splitlines()[-1][:300]}", code=1)


if __name__ == "__main__":
    main()
