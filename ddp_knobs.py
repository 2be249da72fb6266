"""Lesson 7: three knobs plain DDP leaves off, one flag and one function each.

    torchrun --standalone --nproc_per_node=4 ddp_knobs.py --zero --sync-bn --comm-hook bf16

--zero (ZeRO-1) shards AdamW's state over the processes; --sync-bn normalises BatchNorm with the
global batch's statistics; --comm-hook sends the gradients in 16 bits or as PowerSGD's low-rank
factors. Around them: lesson 1's loop, a small BatchNorm CNN, synthetic images, and a checkpoint
that keeps what two knobs change: ZeRO's sharded optimizer state and PowerSGD's error feedback.
"""

import itertools
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import knobs_extras
from ddp_common import (
    Parser,
    cleanup,
    fail,
    load_checkpoint,
    positive_int,
    print0,
    save_checkpoint,
    setup,
)


def parse_args():
    parser = Parser(description="Lesson 7: ZeRO-1, SyncBatchNorm and communication hooks.")
    parser.add_argument("--zero", action="store_true", help="shard AdamW's state (ZeRO-1)")
    parser.add_argument("--sync-bn", action="store_true", help="BatchNorm over the global batch")
    parser.add_argument("--comm-hook", default="none", choices=["none", "fp16", "bf16", "powersgd"])
    parser.add_argument("--powersgd-rank", type=positive_int, default=2, help="rank of the factors")
    parser.add_argument("--powersgd-warmup", type=positive_int, default=100, help="plain steps")
    parser.add_argument("--epochs", type=positive_int, default=3)
    parser.add_argument("--max-steps", type=positive_int, help="stop after N steps (a quick run)")
    parser.add_argument("--batch-size", type=positive_int, default=32, help="per process")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW's learning rate")
    parser.add_argument("--checkpoint-dir", default="./checkpoints/lesson7", help="for last.pt")
    parser.add_argument("--resume", metavar="PATH|auto", help="a checkpoint; auto: DIR/last.pt")
    parser.add_argument("--log-every", type=positive_int, default=50, help="steps per log line")
    args = parser.parse_args()
    if args.powersgd_warmup < 2:
        # PowerSGD keeps its state per gradient bucket; DDP regroups the buckets after step 1.
        parser.error("--powersgd-warmup must be at least 2")
    return args


def build_optimizer(model, args):
    """Knob 1, --zero: AdamW, its state sharded over the processes (ZeRO-1)."""
    # fused on GPUs and CPUs: a checkpoint keeps the flag, so a CPU one resumes fused on a GPU.
    if args.zero:
        # DDP: each process keeps AdamW's two moments for its 1/world_size of the parameters,
        # updates that shard in step() and broadcasts it. Gradients are still all-reduced whole.
        return ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.AdamW, lr=args.lr, fused=True
        )
    return torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True)


def convert_sync_bn(model, device):
    """Knob 2, --sync-bn: every BatchNorm normalises with the statistics of the global batch."""
    if device.type == "cuda":
        # DDP: BatchNorm -> SyncBatchNorm BEFORE the DDP wrap, so that DDP wraps the new layers.
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    # nn.SyncBatchNorm refuses CPU tensors: a stand-in computes the same (knobs_extras.py).
    return knobs_extras.cpu_sync_batchnorm(model)


def register_comm_hook(model, args):
    """Knob 3, --comm-hook: how each gradient bucket travels, instead of DDP's fp32 all-reduce.
    Returns PowerSGD's state (the checkpoint needs it), or None."""
    if args.comm_hook in ("fp16", "bf16"):
        # DDP: cast each bucket to 16 bits, all-reduce it, cast it back: half the bytes.
        model.register_comm_hook(None, getattr(default_hooks, f"{args.comm_hook}_compress_hook"))
    if args.comm_hook != "powersgd":
        return None
    # DDP: each gradient matrix (n x m) travels as two rank-r factors (n x r, m x r); what they
    # miss stays on this process (error feedback) and joins its next gradient. The first
    # --powersgd-warmup steps travel whole: early training is sensitive to gradient error.
    state = powerSGD_hook.PowerSGDState(
        process_group=None,
        matrix_approximation_rank=args.powersgd_rank,
        start_powerSGD_iter=args.powersgd_warmup,
    )
    model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return state


class Trainer:
    def __init__(self, args, ddp, train_set, test_set):
        self.args = args
        self.ddp = ddp
        self.device = ddp.device
        self.test_set = test_set
        # The same initial weights in every process (DDP also copies rank 0's to all).
        torch.manual_seed(0)
        model = knobs_extras.Net().to(self.device)
        # The order matters: SyncBatchNorm, then DDP, then the hook (before any backward).
        if args.sync_bn:
            model = convert_sync_bn(model, self.device)
        on_gpu = self.device.type == "cuda"
        # DDP: wrap the model; its backward averages the gradients, through the hook if any.
        self.model = DDP(model, device_ids=[ddp.device.index] if on_gpu else None)
        self.powersgd = register_comm_hook(self.model, args)
        self.optimizer = build_optimizer(self.model, args)
        # DDP: each process draws a different 1/world_size of the shuffled samples.
        self.sampler = DistributedSampler(train_set, ddp.world_size, ddp.rank, shuffle=True)
        self.loader = DataLoader(
            train_set, args.batch_size, sampler=self.sampler, pin_memory=on_gpu
        )
        total_steps = args.epochs * len(self.loader)
        self.last_step = min(total_steps, args.max_steps or total_steps)
        self.step = 0
        if args.resume:
            self._resume()

    def _run_batch(self, x, y):
        x = x.to(self.device, non_blocking=True)
        y = y.to(self.device, non_blocking=True)
        loss = F.cross_entropy(self.model(x), y)
        self.optimizer.zero_grad(set_to_none=True)
        # DDP: the gradients are all-reduced here, bucket by bucket (through the hook, if any).
        loss.backward()
        # ZeRO: each process updates its shard, then broadcasts it.
        self.optimizer.step()
        return loss.detach()

    def _run_epoch(self, epoch):
        # DDP: a new shuffle every epoch, the same in every process.
        self.sampler.set_epoch(epoch)
        # A resumed run skips the batches of this epoch that it trained before it stopped.
        batches = itertools.islice(self.loader, self.step - epoch * len(self.loader), None)
        loss_sum = torch.zeros((), device=self.device)
        logged, start = self.step, time.perf_counter()
        for x, y in batches:
            # >=: a run resumed past a smaller --max-steps trains nothing more.
            if self.step >= self.last_step:
                break
            loss_sum += self._run_batch(x, y)
            self.step += 1
            if self.step % self.args.log_every == 0 or self.step == self.last_step:
                steps, logged = self.step - logged, self.step
                # DDP: every process trained a batch: samples/s of the whole job.
                samples = steps * self.args.batch_size * self.ddp.world_size
                # .item() waits for the device: once per log line. (Rank 0's own loss.)
                print0(
                    f"epoch {epoch + 1}/{self.args.epochs} | step {self.step}/{self.last_step}"
                    f" | loss {loss_sum.item() / steps:.4f}"
                    f" | {samples / (time.perf_counter() - start):.0f} samples/s"
                )
                loss_sum.zero_()
                start = time.perf_counter()

    @torch.no_grad()
    def evaluate(self):
        """Every rank scores the whole small test set in one batch (lesson 1 shows sharding)."""
        # DDP: the bare model: in eval mode BatchNorm uses its running statistics, no collective.
        model = self.model.module.eval()
        x, y = (t.to(self.device) for t in self.test_set.tensors)
        logits = model(x)
        model.train()
        accuracy = (logits.argmax(1) == y).float().mean().item()
        return F.cross_entropy(logits, y).item(), f"{100 * accuracy:.2f}%"

    def _save_checkpoint(self):
        if self.args.zero:
            # DDP: ZeRO's state is spread over the processes: each sends its shard to rank 0,
            # which then holds the unsharded optimizer's state_dict. A collective: all call it.
            self.optimizer.consolidate_state_dict(to=0)
        state = {
            # DDP: the bare model's weights, without the wrapper's "module." prefix.
            "model": self.model.module.state_dict(),
            # Rank 0 writes; with --zero only rank 0 holds the whole state.
            "optimizer": self.optimizer.state_dict() if self.ddp.rank == 0 else None,
            "step": self.step,
            "epoch": self.step // len(self.loader),
            "world_size": self.ddp.world_size,
            "global_batch": self.args.batch_size * self.ddp.world_size,
        }
        if self.powersgd is not None:
            state["powersgd"] = [None] * self.ddp.world_size
            # DDP: PowerSGD's error feedback differs on every process: a list of all of them.
            dist.all_gather_object(state["powersgd"], knobs_extras.powersgd_state(self.powersgd))
        save_checkpoint(state, os.path.join(self.args.checkpoint_dir, "last.pt"))

    def _resume(self):
        path = self.args.resume
        if path == "auto":
            path = os.path.join(self.args.checkpoint_dir, "last.pt")
        ckpt = None
        if self.args.resume != "auto" or os.path.exists(path):
            ckpt = load_checkpoint(path, model=self.model.module, optimizer=self.optimizer)
        found = [None] * self.ddp.world_size
        # DDP: every rank must start from the same step, or they take different steps and hang.
        # With node-local disks some ranks may not see the file: compare what each found.
        dist.all_gather_object(found, None if ckpt is None else ckpt["step"])
        if len(set(found)) > 1:
            why = f"ranks found different checkpoints (step by rank: {found})"
            fail(f"{why}: give every rank the same one, or remove them all", 1, rank0_only=True)
        if ckpt is None:
            print0(f"resume: no {path} yet; starting from scratch")
            return
        saved = (ckpt["world_size"], ckpt.get("global_batch", 0))
        if saved != (self.ddp.world_size, self.args.batch_size * self.ddp.world_size):
            # A step is B x W samples here (lesson 1's loader): with another B or W, other samples.
            why = f"{path} was saved by {saved[0]} processes x --batch-size {saved[1] // saved[0]}"
            fail(f"{why}: resume it so (lesson 2 resumes on any world size)", 2, rank0_only=True)
        self.step = ckpt["step"]
        if self.args.zero:
            # ZeRO's load_state_dict leaves AdamW's `step` on the CPU, where fused AdamW on a GPU
            # refuses it (pytorch#124133): put it beside its parameter.
            for param, param_state in self.optimizer.optim.state.items():
                param_state["step"] = param_state["step"].to(param.device)
        if self.powersgd is not None:
            self._restore_powersgd(ckpt.get("powersgd"))
        print0(f"resumed: {path} | step {self.step} | world {saved[0]} -> {self.ddp.world_size}")

    def _restore_powersgd(self, saved):
        if saved is None:
            print0("warning: the checkpoint holds no PowerSGD state: it restarts")
            return
        sample = self.test_set.tensors[0][:2].to(self.device)
        knobs_extras.load_powersgd_state(self.model, self.powersgd, saved[self.ddp.rank], sample)

    def train(self):
        # A run resumed at its end trains nothing, and reports the last epoch again.
        first_epoch = min(self.step // len(self.loader), self.args.epochs - 1)
        for epoch in range(first_epoch, self.args.epochs):
            self._run_epoch(epoch)
            loss, accuracy = self.evaluate()
            print0(
                f"epoch {epoch + 1}/{self.args.epochs} | val_loss {loss:.4f} | val_acc {accuracy}"
            )
            self._save_checkpoint()
            if self.step >= self.last_step:
                break
        return loss, accuracy


@record
def main():
    args = parse_args()
    # DDP: join the process group; torchrun says which process this is (rank, local rank).
    ddp = setup()
    train_set, test_set = knobs_extras.synthetic_images()
    trainer = Trainer(args, ddp, train_set, test_set)
    print0(
        f"start: world {ddp.world_size} | backend {ddp.backend} | device {ddp.device.type} | "
        f"batch {args.batch_size}/process, {args.batch_size * ddp.world_size} global | zero "
        f"{args.zero} | sync_bn {args.sync_bn} | comm_hook {args.comm_hook} | steps "
        f"{trainer.step}->{trainer.last_step}"
    )
    start = time.perf_counter()
    loss, accuracy = trainer.train()
    n_params = sum(p.numel() for p in trainer.model.parameters())
    # What the knobs change: the optimizer state rank 0 holds, the gradient bytes it hands to
    # all-reduce (ZeRO's broadcast of the updated shards not counted).
    held = knobs_extras.optimizer_state_bytes(trainer.optimizer)
    sent = knobs_extras.grad_bytes_per_step(args.comm_hook, n_params, trainer.powersgd)
    print0(
        f"done: world {ddp.world_size} | steps {trainer.step} | val_loss {loss:.4f} | val_acc "
        f"{accuracy} | opt_state {held / 2**20:.3f} MiB/rank | grad_comm {sent / 2**10:.1f} "
        f"KiB/step/rank | time {time.perf_counter() - start:.1f}s"
    )
    # DDP: drop the wrapper, then leave the process group.
    del trainer
    cleanup()


if __name__ == "__main__":
    main()
