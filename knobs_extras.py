"""Lesson 7's companion: what ddp_knobs.py needs around its three knobs but does not teach.

- SyncBatchNorm on CPU ranks (nn.SyncBatchNorm runs on GPUs only): GlooSyncBatchNorm.
- PowerSGD's state in a checkpoint: powersgd_state_dict, load_powersgd_state,
  rebuild_buckets_now.
- A workaround for fused AdamW under ZeRO after a resume: place_state_on_param_device.
- The figures the `done:` line reports: optimizer_state_bytes, comm_bytes_per_step.
"""

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

# ---------------------------------------------------------------------------------------------
# SyncBatchNorm on CPU ranks
# ---------------------------------------------------------------------------------------------


class AllReduceSum(torch.autograd.Function):
    """Differentiable all-reduce (sum). Every rank's loss depends on every rank's x through the
    sum, so the gradient of x is the sum over ranks of the output's gradients: the same op."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    backward = forward


class GlooSyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """SyncBatchNorm for CPU ranks: nn.SyncBatchNorm refuses CPU tensors ("expected input tensor
    to be on GPU"). The same computation with the all-reduce above, in two all-reduces per layer
    (sums, then squared deviations from the global mean: exact and stable) where nn.SyncBatchNorm
    needs one. BatchNorm2d's parameters and buffers: checkpoints move freely between the two."""

    def _check_input_dim(self, input):
        # _BatchNorm leaves the shape check to its subclasses; any (N, C, ...) input works here.
        pass

    def forward(self, x):
        if not (self.training and dist.is_initialized() and dist.get_world_size() > 1):
            # Evaluation, or one process: plain BatchNorm.
            return super().forward(x)
        dims = [0] + list(range(2, x.dim()))
        shape = [1, -1] + [1] * (x.dim() - 2)
        count = torch.tensor([x.numel() // x.shape[1]], dtype=x.dtype, device=x.device)
        # Per-channel sums and the sample count, over all ranks: the global mean.
        sums = AllReduceSum.apply(torch.cat([x.sum(dims), count]))
        n = sums[-1]
        mean = sums[:-1] / n
        centred = x - mean.view(shape)
        # The variance of the global batch, from deviations from the global mean.
        var = AllReduceSum.apply(centred.pow(2).sum(dims)) / n
        with torch.no_grad():
            self.num_batches_tracked.add_(1)
            momentum = self.momentum
            if momentum is None:
                momentum = 1 / float(self.num_batches_tracked)
            self.running_mean.lerp_(mean, momentum)
            # The running variance is unbiased, over the global count.
            self.running_var.lerp_(var * n / (n - 1).clamp(min=1), momentum)
        y = centred * torch.rsqrt(var + self.eps).view(shape)
        return y * self.weight.view(shape) + self.bias.view(shape)


def convert_to_gloo_sync_batchnorm(model):
    """Every BatchNorm2d -> GlooSyncBatchNorm with the same parameters and statistics."""
    for name, child in model.named_children():
        if isinstance(child, nn.BatchNorm2d):
            new = GlooSyncBatchNorm(child.num_features, child.eps, child.momentum)
            new.load_state_dict(child.state_dict())
            setattr(model, name, new.to(child.weight.device))
        else:
            convert_to_gloo_sync_batchnorm(child)
    return model


# ---------------------------------------------------------------------------------------------
# PowerSGD: on gloo, and its state in a checkpoint
# ---------------------------------------------------------------------------------------------


def powersgd_state_dict(state):
    """This rank's PowerSGD state as tensors and ints (weights_only=True loads them): the error
    left over per bucket (differs per rank), the warm-start factors, the step count, the RNG."""
    _, keys, pos, has_gauss, gauss = state.rng.get_state()
    return {
        "iter": state.iter,
        "rng": [torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
        "numel": [state.total_numel_before_compression, state.total_numel_after_compression],
        "error": {k: v.cpu() for k, v in state.error_dict.items()},
        "p": {k: v.cpu() for k, v in state.p_memory_dict.items()},
        "q": {k: v.cpu() for k, v in state.q_memory_dict.items()},
    }


def load_powersgd_state(state, saved, device):
    """The inverse of powersgd_state_dict, onto this rank's device."""
    state.iter = saved["iter"]
    state.error_dict = {k: v.to(device) for k, v in saved["error"].items()}
    state.p_memory_dict = {k: v.to(device) for k, v in saved["p"].items()}
    state.q_memory_dict = {k: v.to(device) for k, v in saved["q"].items()}
    keys, pos, has_gauss, gauss = saved["rng"]
    state.rng.set_state(("MT19937", keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    state.total_numel_before_compression = saved["numel"][0]
    state.total_numel_after_compression = saved["numel"][1]


def rebuild_buckets_now(ddp_model, x):
    """PowerSGD's state is per bucket, so a resumed run must bucket the gradients as the saved run
    did. DDP starts with ONE bucket and rebuilds its buckets in gradient-ready order after the
    first backward (why PowerSGD's warm-up is >= 2 steps). So: one throw-away forward/backward
    (plain all-reduce: the fresh hook state is in warm-up), BatchNorm statistics put back,
    gradients dropped."""
    buffers = [b.clone() for b in ddp_model.module.buffers()]
    ddp_model(x).sum().backward()
    for b, saved in zip(ddp_model.module.buffers(), buffers, strict=True):
        b.copy_(saved)
    ddp_model.zero_grad(set_to_none=True)


# ---------------------------------------------------------------------------------------------
# ZeRO with fused AdamW, after a resume
# ---------------------------------------------------------------------------------------------


def place_state_on_param_device(optimizer):
    """ZeroRedundancyOptimizer.load_state_dict moves 0-dim state tensors (Adam's `step`) to the
    CPU (pytorch/pytorch#124133). The fused and capturable kernels want them on the parameter's
    device and fail at the first step after a resume. Put them back, as torch.optim's own load
    does."""
    # ZeRO: the optimizer over this rank's shard.
    local = getattr(optimizer, "optim", optimizer)
    for group in local.param_groups:
        if not (group.get("fused") or group.get("capturable")):
            continue
        for p in group["params"]:
            for key, value in local.state.get(p, {}).items():
                if torch.is_tensor(value) and value.device != p.device:
                    local.state[p][key] = value.to(p.device)


# ---------------------------------------------------------------------------------------------
# What the `done:` line reports
# ---------------------------------------------------------------------------------------------


def optimizer_state_bytes(optimizer):
    """Optimizer state held by THIS rank (with ZeRO: its shard's)."""
    local = getattr(optimizer, "optim", optimizer)
    return sum(t.nbytes for s in local.state.values() for t in s.values() if torch.is_tensor(t))


def comm_bytes_per_step(comm_hook, n_params, state):
    """Gradient bytes one rank hands to all-reduce per step: 4 per parameter in fp32, 2 with the
    16-bit hooks; PowerSGD counts the factors and uncompressed tensors it actually sent."""
    if state is not None and state.iter > state.start_powerSGD_iter:
        compressed_steps = state.iter - state.start_powerSGD_iter
        return 4 * state.total_numel_after_compression / compressed_steps
    if comm_hook in ("fp16", "bf16"):
        return 2 * n_params
    return 4 * n_params
