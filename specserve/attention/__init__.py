"""Attention backends behind one interface (`attention.base.AttentionBackend`).

`backend_for(device)`: on CUDA `attention.prefill.prefill_attention` — long causal prefill
chunks through cuDNN's fused attention, everything else (trees, decodes, short chunks, windowed
layers) through the Triton tree-verify kernel (`specserve/kernels/tree_attention`); the torch
reference on CPU. The kernel package is imported lazily, only when a GPU is used.
"""

from __future__ import annotations

import torch

from specserve.attention.base import AttentionBackend


def backend_for(device: torch.device | str) -> AttentionBackend:
    if torch.device(device).type == "cuda":
        from specserve.attention.prefill import prefill_attention, use_ragged_plans

        use_ragged_plans()  # before any cuDNN attention call of this process
        return prefill_attention
    from specserve.attention.torch_ref import torch_ref_attention

    return torch_ref_attention
