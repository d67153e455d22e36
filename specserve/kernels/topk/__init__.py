"""Top-k log-probabilities of draft logits: public entry point `topk_logprobs_device`.

Owns the choice between the Triton kernel (kernel.py: one read of the logits, per-chunk top-k
and log-sum-exp, merged by torch) and the torch formula (ref.py). Both return the tables on
the logits' device; `spec.ddtree.topk_logprobs` copies them to the host. Not here: the tree.
"""

from __future__ import annotations

import torch

from specserve.kernels import triton_available
from specserve.kernels.topk.ref import topk_logprobs_ref

MIN_VOCAB = 16384  # below it torch's own top-k is as fast (one chunk a row)


def topk_logprobs_device(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs `[R, k]` float32 and ids `[R, k]` int64 of float32 logits `[R, V]`: the
    kernel on CUDA for a vocabulary ≥ MIN_VOCAB and k ≤ its MAX_K, else torch."""
    if (logits.is_cuda and logits.shape[-1] >= MIN_VOCAB and logits.dtype == torch.float32
            and triton_available()):
        from specserve.kernels.topk.kernel import MAX_K, topk_logprobs_triton

        if k <= MAX_K and logits.stride(-1) == 1:
            return topk_logprobs_triton(logits, k)
    return topk_logprobs_ref(logits, k)


__all__ = ["MIN_VOCAB", "topk_logprobs_device"]
