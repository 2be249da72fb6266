"""Lesson 7's companion: what ddp_knobs.py needs around its knobs but does not teach: the model
and its data, SyncBatchNorm on CPU processes, PowerSGD's state in a checkpoint, the figures of
the `done:` line."""

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import group
from torch.utils.data import TensorDataset


class Net(nn.Module):
    """A small CNN with BatchNorm: a 3x16x16 image -> 10 class scores (10,266 parameters)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(32)
        self.fc = nn.Linear(32 * 4 * 4, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.fc(x.flatten(1))


def synthetic_images(n_train=4096, n_test=1024):
    """Images that need no download: each class a fixed smooth random pattern, each image its
    class's pattern plus noise, drawn from a fixed seed: the same data in every run."""
    generator = torch.Generator().manual_seed(12345)
    patterns = F.interpolate(torch.rand(10, 3, 4, 4, generator=generator), 16, mode="bilinear")
    sets = []
    for n in (n_train, n_test):
        y = torch.randint(0, 10, (n,), generator=generator)
        x = patterns[y] + 1.5 * torch.randn(n, 3, 16, 16, generator=generator)
        sets.append(TensorDataset(x, y))
    return sets


class CpuSyncBatchNorm(nn.BatchNorm2d):
    """nn.SyncBatchNorm for CPU tensors, which it refuses: forward all-reduces each channel's sum,
    sum of squares and the sample count; backward, their gradients."""

    def forward(self, x):
        if not self.training:
            return super().forward(x)
        dims = [0, 2, 3]
        count = x.new_tensor([x.numel() // x.shape[1]])
        # torch's differentiable all-reduce: its backward all-reduces the gradients, since every
        # process's loss depends on every process's input through the sum.
        sums = funcol.all_reduce(
            torch.cat([x.sum(dims), (x * x).sum(dims), count]), "sum", group.WORLD
        )
        n = sums[-1]
        mean, mean_of_squares = sums[:-1].view(2, -1) / n
        var = mean_of_squares - mean * mean
        with torch.no_grad():
            self.num_batches_tracked += 1
            self.running_mean.lerp_(mean, self.momentum)
            # The running variance is unbiased, over the global count, as nn.SyncBatchNorm's.
            self.running_var.lerp_(var * n / (n - 1), self.momentum)
        shape = (1, -1, 1, 1)
        x_hat = (x - mean.view(shape)) * torch.rsqrt(var + self.eps).view(shape)
        return x_hat * self.weight.view(shape) + self.bias.view(shape)


def cpu_sync_batchnorm(model):
    """Every BatchNorm2d of model becomes a CpuSyncBatchNorm: the same parameters and buffers
    (checkpoints fit either), another forward."""
    for module in model.modules():
        if type(module) is nn.BatchNorm2d:
            module.__class__ = CpuSyncBatchNorm
    return model


# What PowerSGD changes as it trains, besides its step count (attributes of torch's PowerSGDState):
# per bucket, the error its factors missed (different on every process) and the factors it starts
# the next step from. Its random generator draws only when it first makes the factors: they carry
# what it drew.
POWERSGD_TENSORS = ("error_dict", "p_memory_dict", "q_memory_dict")


def powersgd_state(state):
    """This process's PowerSGD state, its tensors on the CPU (weights_only loads it)."""
    saved = {key: {i: t.cpu() for i, t in getattr(state, key).items()} for key in POWERSGD_TENSORS}
    return {"iter": state.iter, **saved}


def load_powersgd_state(model, state, saved, sample):
    """Gives DDP model's PowerSGD state this process's saved one. The state is per gradient
    bucket, and DDP regroups its buckets after the first backward: one backward first (on sample;
    the fresh state's warm-up: a plain all-reduce), then back the BatchNorm statistics it moved."""
    statistics = [b.clone() for b in model.module.buffers()]
    model(sample).sum().backward()
    for buffer, saved_buffer in zip(model.module.buffers(), statistics, strict=True):
        buffer.copy_(saved_buffer)
    model.zero_grad(set_to_none=True)
    state.iter = saved["iter"]
    for key in POWERSGD_TENSORS:
        setattr(state, key, {i: t.to(sample.device) for i, t in saved[key].items()})


def optimizer_state_bytes(optimizer):
    """Bytes of optimizer state this process holds (with ZeRO: its shard's, in .optim)."""
    local = getattr(optimizer, "optim", optimizer)
    return sum(t.nbytes for state in local.state.values() for t in state.values())


def grad_bytes_per_step(comm_hook, n_params, powersgd):
    """Gradient bytes one process hands to all-reduce per step: 4 per parameter in fp32, 2 with a
    16-bit hook; with PowerSGD, fp32 divided by the compression rate it has counted so far."""
    if powersgd is not None and powersgd.total_numel_after_compression:
        return 4 * n_params / powersgd.compression_stats()[0]
    return (2 if comm_hook in ("fp16", "bf16") else 4) * n_params
