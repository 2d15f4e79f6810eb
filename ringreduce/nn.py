"""SyncBatchNorm on CPU and CUDA tensors, with ringreduce moving the statistics.

    model = ringreduce.nn.convert_sync_batchnorm(model)        # every BatchNorm*d, like torch's
    ddp = DistributedDataParallel(model)

torch.nn.SyncBatchNorm refuses CPU tensors ("expected input tensor to be on GPU"); this one takes
both. In training, the batch statistics are those of the whole group's batch: forward all-reduces
one fused vector per call (per channel: count x mean and the centered sum of squares plus count x
mean^2, and the count, in float64), backward one more (per channel: the sums of the output gradient
and of the output gradient times the centered input). Ranks may hold different batch sizes, an
empty batch included. Evaluation uses the running statistics and communicates nothing, as torch's.
The weight and bias gradients are this rank's own sums (as torch's SyncBatchNorm returns them):
DDP averages them with the other parameters' gradients.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from ._lifecycle import traced_source
from .collectives import all_reduce


def _shape(x):
    """Broadcast shape of a per-channel vector against x (N, C, *)."""
    return (1, -1) + (1,) * (x.dim() - 2)


class _SyncBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, group):
        c = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        xf = x.float()  # statistics in float32 at least (bf16/fp16 inputs), float64 when given
        if x.dtype == torch.float64:
            xf = x
        n = x.numel() // c if c else 0
        if n:
            var, mean = torch.var_mean(xf, dim=dims, unbiased=False)
        else:
            var = mean = torch.zeros(c, dtype=xf.dtype, device=x.device)
        # One fused all-reduce: [n*mean, n*var + n*mean^2, n]; float64 so that the combination
        # (global M2 = S2 - N*mean^2) does not cancel away the variance.
        stats = torch.cat([mean.double() * n, (var.double() + mean.double() ** 2) * n,
                           torch.tensor([float(n)], dtype=torch.float64, device=x.device)])
        with traced_source("nn"):
            all_reduce(stats, group=group)
        total = stats[-1].item()
        if total <= 1:
            raise ValueError(f"ringreduce.nn.SyncBatchNorm: expected more than 1 value per channel "
                             f"across the group when training, got input size {tuple(x.shape)} and "
                             f"{int(total)} values per channel in the whole group")
        g_mean = stats[:c] / total
        g_var = (stats[c:2 * c] / total - g_mean ** 2).clamp_(min=0)
        if running_mean is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(g_mean.to(running_mean.dtype), alpha=momentum)
                unbiased = g_var * (total / (total - 1))
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        mean_c = g_mean.to(xf.dtype)
        invstd = torch.rsqrt(g_var + eps).to(xf.dtype)
        xhat = (xf - mean_c.view(_shape(x))) * invstd.view(_shape(x))
        y = xhat
        if weight is not None:
            y = y * weight.to(xf.dtype).view(_shape(x)) + bias.to(xf.dtype).view(_shape(x))
        ctx.save_for_backward(x, weight, mean_c, invstd)
        ctx.group, ctx.total, ctx.has_bias = group, total, bias is not None
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, mean, invstd = ctx.saved_tensors
        c = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        xf = x if x.dtype == torch.float64 else x.float()
        g = grad.to(xf.dtype)
        xmu = xf - mean.view(_shape(x))
        if x.numel():
            sum_dy = g.sum(dim=dims)
            sum_dy_xmu = (g * xmu).sum(dim=dims)
        else:
            sum_dy = sum_dy_xmu = torch.zeros(c, dtype=xf.dtype, device=x.device)
        # this rank's weight/bias gradients (DDP averages them), before the sums become global
        grad_weight = (sum_dy_xmu * invstd).to(weight.dtype) if weight is not None else None
        grad_bias = sum_dy.to(weight.dtype) if ctx.has_bias else None
        both = torch.cat([sum_dy, sum_dy_xmu]).double()
        with traced_source("nn"):
            all_reduce(both, group=ctx.group)  # the one fused all-reduce of backward
        n = ctx.total
        mean_dy = (both[:c] / n).to(xf.dtype).view(_shape(x))
        mean_dy_xmu = (both[c:] / n).to(xf.dtype).view(_shape(x))
        inv = invstd.view(_shape(x))
        scale = inv if weight is None else inv * weight.to(xf.dtype).view(_shape(x))
        grad_input = (g - mean_dy - xmu * inv * inv * mean_dy_xmu) * scale
        return grad_input.to(x.dtype), grad_weight, grad_bias, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """torch.nn.SyncBatchNorm's interface, on CPU and CUDA tensors, over ringreduce.

    process_group: the group whose batch the statistics cover (None: the default group).
    Without torch.distributed initialized, or on a group of one rank, it is a plain BatchNorm.
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, process_group=None, device=None, dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device,
                         dtype=dtype)
        self.process_group = process_group

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"ringreduce.nn.SyncBatchNorm: expected at least 2D input (N, C, ...), "
                             f"got {input.dim()}D input of shape {tuple(input.shape)}")

    def forward(self, input):
        self._check_input_dim(input)
        if input.shape[1] != self.num_features:
            raise ValueError(f"ringreduce.nn.SyncBatchNorm: input has {input.shape[1]} channels "
                             f"(dim 1 of shape {tuple(input.shape)}); expected num_features = "
                             f"{self.num_features}")
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                momentum = 1.0 / float(self.num_batches_tracked)
        use_batch = self.training or not self.track_running_stats
        group = self.process_group
        distributed = (use_batch and dist.is_available() and dist.is_initialized()
                       and dist.get_world_size(group if group is not None else dist.group.WORLD) > 1)
        if not distributed:
            return F.batch_norm(input,
                                self.running_mean if not self.training or self.track_running_stats
                                else None,
                                self.running_var if not self.training or self.track_running_stats
                                else None,
                                self.weight, self.bias, use_batch, momentum, self.eps)
        running = self.track_running_stats and self.training
        return _SyncBatchNormFn.apply(input, self.weight, self.bias,
                                      self.running_mean if running else None,
                                      self.running_var if running else None,
                                      self.eps, momentum, group)


def convert_sync_batchnorm(module, process_group=None):
    """Returns module with every BatchNorm*d (torch's _BatchNorm, not already synchronized)
    replaced by ringreduce.nn.SyncBatchNorm over process_group, parameters and buffers kept."""
    out = module
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
        out = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, process_group)
        if module.affine:
            with torch.no_grad():
                out.weight = module.weight
                out.bias = module.bias
        out.running_mean = module.running_mean
        out.running_var = module.running_var
        out.num_batches_tracked = module.num_batches_tracked
        out.training = module.training
        if hasattr(module, "qconfig"):
            out.qconfig = module.qconfig
    for name, child in module.named_children():
        out.add_module(name, convert_sync_batchnorm(child, process_group))
    del module
    return out
