"""The top-k log-probabilities of draft logits in torch: what kernel.py computes, and the path
every device without Triton (and every vocabulary below kernel.py's reach) takes."""

from __future__ import annotations

import torch


def topk_logprobs_ref(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row the `k` largest log-softmax values, descending, and their columns.

    Args:
        logits: [R, V] float32 raw logits.
        k: 1 <= k <= V.

    Returns:
        log-probs [R, k] float32 and ids [R, k] int64, on the logits' device.
    """
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # [R, 1] float32
    vals, ids = logits.topk(k, dim=-1)  # [R, k] float32, [R, k] int64
    return vals - lse, ids
