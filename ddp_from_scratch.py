"""Lesson 9: DDP's gradient sync by hand: naive, overlapped, bucketed; each checked against
torch's DistributedDataParallel (--sync torch), whose weights --save-weights keeps:

    torchrun --standalone --nproc_per_node=2 ddp_from_scratch.py --sync torch --save-weights t.pt
    torchrun --standalone --nproc_per_node=2 ddp_from_scratch.py --sync bucket --reference t.pt
"""

import contextlib
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_common import (
    Parser,
    cleanup,
    load_checkpoint,
    positive_int,
    print0,
    save_checkpoint,
    setup,
)


def parse_args(argv=None):
    parser = Parser(description="Lesson 9: DDP's gradient sync by hand.")
    parser.add_argument("--sync", default="bucket", choices=["naive", "overlap", "bucket", "torch"])
    parser.add_argument("--steps", type=positive_int, default=20, help="optimizer steps")
    parser.add_argument("--accum", type=positive_int, default=2, help="micro-batches per step")
    parser.add_argument("--batch-size", type=positive_int, default=8, help="per micro-batch, rank")
    parser.add_argument("--bucket-mb", type=float, default=0.5, help="also torch's bucket_cap_mb")
    parser.add_argument("--save-weights", metavar="PATH", help="rank 0 saves the final weights")
    parser.add_argument("--reference", metavar="PATH", help="weights to compare with (torch's)")
    return parser.parse_args(argv)


class Net(nn.Module):
    """A tiny language model with what hand-written syncs get wrong: a tied weight (the embedding
    is the output layer too), a frozen layer, and a head (aux) that is used on some steps only."""

    def __init__(self, vocab=256, width=256, depth=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.layers[0].requires_grad_(False)
        self.head = nn.Linear(width, vocab, bias=False)
        self.embed.weight = self.head.weight
        self.aux = nn.Linear(width, 1)

    def forward(self, tokens, use_aux):
        h = self.embed(tokens[:, :-1])
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        loss = F.cross_entropy(self.head(h).flatten(0, 1), tokens[:, 1:].flatten())
        return loss + self.aux(h).pow(2).mean() if use_aux else loss


class NaiveSync:
    """Step 1: after backward, all-reduce every gradient, one after another; divide by W."""

    def __init__(self, model, bucket_mb=0):
        self.world_size = dist.get_world_size()
        # DDP: a frozen parameter has no gradient to average; parameters() lists a tied one once.
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.syncing = True
        # DDP: every rank starts from rank 0's weights and buffers, the frozen ones included.
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.detach(), src=0)

    @contextlib.contextmanager
    def no_sync(self):
        """Gradients only add up locally in here: the micro-batches before a step's last one."""
        self.syncing = False
        try:
            yield
        finally:
            self.syncing = True

    def finish(self):
        """After the step's last backward: every gradient becomes the average over the ranks."""
        used_here = self.fill_unused()
        for p in self.params:
            dist.all_reduce(p.grad)
            p.grad /= self.world_size
        self.drop_unused(used_here)

    def fill_unused(self):
        # DDP: every rank must join the same all-reduces; a gradient this rank did not produce
        # (aux, unused here) counts as zeros.
        used_here = [p.grad is not None for p in self.params]
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return used_here

    def drop_unused(self, used_here):
        # DDP: a parameter no rank used gets no gradient (momentum would move it on zeros). As in
        # torch's reducer the map is pinned: its copy to the GPU does not wait for the all-reduces.
        used = torch.tensor(used_here, dtype=torch.int32, pin_memory=self.params[0].is_cuda)
        used = used.to(self.params[0].device, non_blocking=True)
        dist.all_reduce(used)
        if not all(used_here):
            for p, ranks in zip(self.params, used.tolist(), strict=True):
                if ranks == 0:
                    p.grad = None


class OverlapSync(NaiveSync):
    """Step 2: a hook per parameter starts its all-reduce as soon as backward has produced its
    gradient, while backward computes the layers below; finish() only waits."""

    def __init__(self, model, bucket_mb=0):
        super().__init__(model)
        self.buckets = self.make_buckets(bucket_mb)
        self.bucket_of = {p: i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.reset()
        for p in self.params:
            # DDP: runs once per backward, when p.grad is complete (a tied weight: both uses).
            p.register_post_accumulate_grad_hook(self.grad_ready)

    def make_buckets(self, bucket_mb):
        # Reverse order: backward produces the last layers' gradients first.
        return [[p] for p in reversed(self.params)]

    def reset(self):
        self.missing = [len(bucket) for bucket in self.buckets]
        self.sent = []

    def grad_ready(self, param):
        if not self.syncing:
            return
        self.missing[self.bucket_of[param]] -= 1
        # DDP: a bucket goes when its last gradient is in and the buckets before it have gone:
        # collectives pair up by order, so every rank sends the same buckets in the same order.
        while len(self.sent) < len(self.buckets) and self.missing[len(self.sent)] == 0:
            self.launch(len(self.sent))

    def launch(self, i):
        (param,) = self.buckets[i]
        self.sent.append((i, param.grad, dist.all_reduce(param.grad, async_op=True)))

    def finish(self):
        used_here = self.fill_unused()
        # Buckets still waiting for a gradient this rank did not produce go now.
        while len(self.sent) < len(self.buckets):
            self.launch(len(self.sent))
        # DDP: wait for every all-reduce before optimizer.step() reads the gradients.
        for i, tensor, work in self.sent:
            work.wait()
            tensor /= self.world_size
            self.unpack(i, tensor)
        self.drop_unused(used_here)
        self.reset()

    def unpack(self, i, tensor):
        """The all-reduce summed the gradient itself: nothing to copy back."""


class BucketSync(OverlapSync):
    """Step 3: buckets of about bucket_mb, each sent as one flat tensor (fewer, larger messages)
    when its last gradient is ready; the averages are copied back after the wait."""

    def make_buckets(self, bucket_mb):
        buckets, size = [[]], 0
        for p in reversed(self.params):
            nbytes = p.numel() * p.element_size()
            if buckets[-1] and size + nbytes > bucket_mb * 2**20:
                buckets.append([])
                size = 0
            buckets[-1].append(p)
            size += nbytes
        return buckets

    def launch(self, i):
        flat = torch.cat([p.grad.flatten() for p in self.buckets[i]])
        self.sent.append((i, flat, dist.all_reduce(flat, async_op=True)))

    def unpack(self, i, tensor):
        bucket = self.buckets[i]
        for p, part in zip(bucket, tensor.split([p.numel() for p in bucket]), strict=True):
            p.grad.copy_(part.view_as(p))


def build(args, ddp):
    """The model (other weights on every rank, until the sync), its forward, sync, optimizer."""
    torch.manual_seed(ddp.rank)
    model = Net().to(ddp.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if args.sync == "torch":
        # DDP: the reference. find_unused_parameters: aux is unused on some steps.
        ddp_model = DDP(model, bucket_cap_mb=args.bucket_mb, find_unused_parameters=True)
        return model, ddp_model, ddp_model, optimizer
    sync = {"naive": NaiveSync, "overlap": OverlapSync, "bucket": BucketSync}[args.sync]
    return model, model, sync(model, args.bucket_mb), optimizer


def train(args, ddp, net, sync, optimizer):
    """args.steps optimizer steps of args.accum micro-batches each: the last loss, ms a step."""
    # Random tokens, other ones on every rank, made on the device (a copy would make the host wait).
    rng = torch.Generator(ddp.device).manual_seed(1000 + ddp.rank)
    start = time.perf_counter()
    for step in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        for micro in range(args.accum):
            tokens = torch.randint(256, (args.batch_size, 33), generator=rng, device=ddp.device)
            # DDP: no all-reduce on a step's earlier micro-batches (no_sync): gradients add up.
            with sync.no_sync() if micro < args.accum - 1 else contextlib.nullcontext():
                # On some steps one rank uses aux, on others none does.
                loss = net(tokens, use_aux=(step + ddp.rank) % 4 == 0)
                loss.backward()
        if args.sync != "torch":
            # DDP: torch's DDP has averaged the gradients inside backward; ours, here.
            sync.finish()
        optimizer.step()
    # .item() waits for the device to finish.
    return loss.item(), 1000 * (time.perf_counter() - start) / args.steps


def main():
    args = parse_args()
    reference = Net()
    if args.reference:
        load_checkpoint(args.reference, model=reference)
    # DDP: join the process group; torchrun says which process this is.
    ddp = setup()
    model, net, sync, optimizer = build(args, ddp)
    print0(
        f"start: sync {args.sync} | world {ddp.world_size} | backend {ddp.backend} | device "
        f"{ddp.device.type} | steps {args.steps} x {args.accum} micro-batches of {args.batch_size}"
    )
    loss, step_ms = train(args, ddp, net, sync, optimizer)
    done = f"done: sync {args.sync} | loss {loss:.4f} | step_ms {step_ms:.1f}"
    if args.reference:
        pairs = zip(model.state_dict().values(), reference.state_dict().values(), strict=True)
        diff = max((w.cpu() - w_torch).abs().max().item() for w, w_torch in pairs)
        done += f" | max |w - w_torch| {diff:.2e}"
    if args.save_weights:
        # DDP: every rank holds the same weights: rank 0 writes them.
        save_checkpoint({"model": model.state_dict()}, args.save_weights)
        done += f" | saved {args.save_weights}"
    print0(done)
    del net, sync
    cleanup()


if __name__ == "__main__":
    main()
