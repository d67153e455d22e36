"""RMSNorm as HF computes it: the norm of the decoder, the DFlash drafter and the fused
kernels' torch reference (a module of its own so that the kernels' reference imports it from
below the model, not from the decoder that runs the kernels)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm — `weight * (x.float() * rsqrt(mean(x²) + eps)).to(x.dtype)` — in 2 kernels:
    F.rms_norm without a weight computes in fp32 and rounds once to x's dtype (bitwise the HF
    value on the CPU; a fused kernel on CUDA), then the weight multiply rounds as HF's does."""
    return F.rms_norm(x, (x.shape[-1],), eps=eps) * weight
