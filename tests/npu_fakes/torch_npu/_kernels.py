"""The NPU kernels MindSpeed's default paths call, in plain torch (the kernels' documented maths).
Only what a CPU-emulated launch reaches; see the package docstring for the rest."""

from __future__ import annotations

import torch

__all__ = ["npu_rms_norm", "npu_rotary_mul", "npu_swiglu"]


def npu_rms_norm(x: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6):
    """(y, rstd): y = x / sqrt(mean(x^2) + eps) * gamma over the last dimension."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + epsilon)
    return (xf * rstd).to(x.dtype) * gamma, rstd


def npu_rotary_mul(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   rotary_mode: str = "half") -> torch.Tensor:
    """x * cos + rotate_half(x) * sin (rotate_half: the two halves of the last dimension)."""
    if rotary_mode == "interleave":
        x1, x2 = x[..., ::2], x[..., 1::2]
        rot = torch.stack((-x2, x1), dim=-1).flatten(-2)
    else:
        x1, x2 = x.chunk(2, dim=-1)
        rot = torch.cat((-x2, x1), dim=-1)
    return x * cos + rot * sin


class _SwiGLU(torch.autograd.Function):
    """Keeps what the NPU kernel keeps for backward: its input alone (``npu_swiglu_backward``
    takes the gradient and ``x``), so the memory harness counts a MindSpeed build's MLP as the
    device holds it, not as the two unfused ops would."""

    @staticmethod
    def forward(ctx, x, dim):
        ctx.save_for_backward(x)
        ctx.dim = dim
        a, b = x.chunk(2, dim=dim)
        return torch.nn.functional.silu(a) * b

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            xx = x.detach().requires_grad_(True)
            a, b = xx.chunk(2, dim=ctx.dim)
            (gx,) = torch.autograd.grad(torch.nn.functional.silu(a) * b, xx, grad)
        return gx, None


def npu_swiglu(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """silu(a) * b for (a, b) = x split in two along ``dim``."""
    return _SwiGLU.apply(x, dim)
