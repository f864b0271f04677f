"""RMSNorm with a CPU forward and backward of few passes over the activations.

torch's RMSNorm on CPU is composite (pow, mean, rsqrt, two products; autograd then differentiates
each): about 4 passes over [N, H, d] forward and 10 backward, which was ~8% of a Pyramid-Flow
training step on a 2-core CPU (benchmarks/pyramid_step.py, issue 31). `RMSNorm` is `nn.RMSNorm`
(same parameter, init and state dict) whose CPU fp32/fp64 path is one autograd function: 3 passes
forward, 6 backward. CUDA runs torch's fused kernel and torch.compile fuses the composite, so both
keep `nn.RMSNorm.forward`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class _RMSNormFunction(torch.autograd.Function):
    """y = x * r * w with r = 1 / sqrt(mean(x^2) + eps) over the last dim.

    Backward: dx = r * (g w) - x * r^3 / d * sum(g w x), dw = sum over rows of g * x * r.
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        d = x.shape[-1]
        r = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_().div_(d).add_(eps).rsqrt_()
        ctx.save_for_backward(x, weight, r)
        return torch.mul(x, r).mul_(weight)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight, r = ctx.saved_tensors
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = torch.mul(x, r).mul_(grad).reshape(-1, x.shape[-1]).sum(0)
        grad_x = None
        if ctx.needs_input_grad[0]:
            gw = grad * weight
            coef = torch.linalg.vecdot(gw, x).unsqueeze(-1).mul_(r.pow(3)).div_(-x.shape[-1])
            grad_x = gw.mul_(r).addcmul_(x, coef)
        return grad_x, grad_weight, None


class RMSNorm(nn.RMSNorm):
    """`nn.RMSNorm` over the last dim with a learnt weight; see the module docstring."""

    def forward(self, x: Tensor) -> Tensor:
        if (x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64) or self.weight is None
                or len(self.normalized_shape) != 1 or torch.compiler.is_compiling()
                or torch.is_autocast_enabled("cpu")):
            return super().forward(x)
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        return _RMSNormFunction.apply(x, self.weight.to(x.dtype), eps)
