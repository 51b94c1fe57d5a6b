"""RMSNorm, fused with the residual add (pre-norm decoders).

`_norm` and the residual add below are the reference; CUDA tensors use one Triton kernel
(triton_fused.py), CPU tensors one native kernel (cpu_kernels.py) when it is available.
"""
from __future__ import annotations

import torch
from torch import nn

from sparsex.layers import cpu_kernels


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual)."""
        if x.is_cuda:
            from sparsex.layers.triton_fused import rms_norm           # one kernel instead of ~8
            return rms_norm(x, self.weight, self.eps, residual)
        if cpu_kernels.supports(x, self.weight) and self.weight.dtype == x.dtype and (
                residual is None or residual.dtype == x.dtype):
            return cpu_kernels.rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
