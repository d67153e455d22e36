"""The obviously-right tree-verify attention: the torch reference backend, optionally in float64.

Owns nothing new: it wraps `specserve.attention.torch_ref.torch_ref_attention` (gather pages, mask,
softmax) so the kernel tests can compare against float64 math on upcast inputs.
"""

from __future__ import annotations

import torch

from specserve.attention.base import AttnBatch
from specserve.attention.torch_ref import torch_ref_attention


def tree_attention_ref(
    q: torch.Tensor,  # [T, Hq, D]
    k_pool: torch.Tensor,  # [P, page_size, Hkv, D]
    v_pool: torch.Tensor,  # [P, page_size, Hkv, D]
    batch: AttnBatch,
    scale: float,
    sliding_window: int | None = None,
    fp64: bool = False,
) -> torch.Tensor:  # [T, Hq, D] in q's dtype, or float64 when `fp64`
    """Reference attention; with `fp64` the inputs are upcast and the result stays float64."""
    if fp64:
        q, k_pool, v_pool = q.double(), k_pool.double(), v_pool.double()
    return torch_ref_attention(q, k_pool, v_pool, batch, scale, sliding_window)
