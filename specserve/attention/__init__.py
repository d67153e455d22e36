"""Attention backends behind one interface (`attention.base.AttentionBackend`).

`backend_for(device)`: the Triton tree-verify kernel (`kernels/tree_attention`) on CUDA, the
torch reference on CPU. The kernel package is imported lazily, only when a GPU is used.
"""

from __future__ import annotations

import torch

from specserve.attention.base import AttentionBackend


def backend_for(device: torch.device | str) -> AttentionBackend:
    if torch.device(device).type == "cuda":
        from kernels.tree_attention import tree_attention

        return tree_attention
    from specserve.attention.torch_ref import torch_ref_attention

    return torch_ref_attention
