"""``horovod.torch.sync_batch_norm``: batch normalisation with statistics over every rank's batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from . import mpi_ops

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(_BatchNorm):
    """Horovod's ``SyncBatchNorm(num_features, eps, momentum, affine, track_running_stats)``:
    in training the mean and variance are those of the union of every rank's batch.

    Each rank's per-channel count, sum and sum of squares travel in one autograd-aware
    allreduce (Sum; its backward allreduces the gradients, so the input gradient is the
    full-batch one). The statistics are taken in float64 from those sums. Unlike Horovod's
    (GPU only: it raises for a CPU input), CPU and GPU inputs both work. In eval mode with
    running statistics it is ``F.batch_norm`` on them, as Horovod's."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)

    def _check_input_dim(self, input) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def _run_bn(self, input):
        return F.batch_norm(
            input,
            self.running_mean,
            self.running_var,
            self.weight,
            self.bias,
            self.training or not self.track_running_stats,
            self.momentum,
            self.eps,
        )

    def forward(self, input):
        self._check_input_dim(input)
        if self.training and self.track_running_stats:
            self.num_batches_tracked = self.num_batches_tracked + 1
        if (not self.training and self.track_running_stats) or mpi_ops.size() == 1:
            return self._run_bn(input)
        c = input.shape[1]
        x = input.transpose(0, 1).reshape(c, -1)  # channels first
        x64 = x.double()
        local = torch.cat([torch.full((1,), float(x.shape[1]), dtype=torch.float64), x64.sum(1), (x64 * x64).sum(1)])
        total = mpi_ops.allreduce(local, op=mpi_ops.Sum, name="sync_batch_norm.stats")
        n = total[0]
        mean = total[1 : 1 + c] / n
        var = total[1 + c :] / n - mean * mean
        if self.training and self.track_running_stats:
            with torch.no_grad():
                if self.momentum is None:  # cumulative moving average
                    factor = 1.0 / float(self.num_batches_tracked)
                else:
                    factor = self.momentum
                unbiased = var * (n / (n - 1)) if float(n) > 1 else var
                self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
                self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)
        shape = [1, c] + [1] * (input.dim() - 2)
        invstd = torch.rsqrt(var + self.eps)
        y = (input - mean.to(input.dtype).view(shape)) * invstd.to(input.dtype).view(shape)
        if self.weight is not None:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y
