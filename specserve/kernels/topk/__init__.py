"""Top-k log-probabilities of draft logits: public entry point `topk_logprobs_device`.

Owns the choice between the Triton kernel (kernel.py: one read of the logits, per-chunk top-k
and log-sum-exp, merged by torch) and the torch formula (ref.py). Both return the tables on
the logits' device; `spec.ddtree.topk_logprobs` copies them to the host. Not here: the tree.
"""

from __future__ import annotations

import torch

from specserve.kernels import triton_available
from specserve.kernels.topk.ref import topk_logprobs_ref

# where the kernel pays on the H200 (BENCHMARKS.md, "Where a draft call's tree build goes"):
# many rows of a large vocabulary (a batch of DFlash blocks over Qwen3's); for one request's
# 15 rows its torch merge's launches cost more than it saves
MIN_VOCAB = 16384
MIN_ROWS = 64
GRAPH_K = 64  # the widest top-k a drafter graph computes on a small vocabulary (`graph_k`)


def topk_logprobs_device(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs `[R, k]` float32 and ids `[R, k]` int64 of float32 logits `[R, V]`: the
    kernel on CUDA for ≥ MIN_ROWS rows of ≥ MIN_VOCAB columns and k ≤ its MAX_K, else torch."""
    if (logits.is_cuda and logits.shape[-1] >= MIN_VOCAB and logits.shape[0] >= MIN_ROWS
            and logits.dtype == torch.float32 and triton_available()):
        from specserve.kernels.topk.kernel import MAX_K, topk_logprobs_triton

        if k <= MAX_K and logits.stride(-1) == 1:
            return topk_logprobs_triton(logits, k)
    return topk_logprobs_ref(logits, k)


def graph_k(vocab: int) -> int:
    """The top-k width a drafter's CUDA graph computes on every replay (drafters/dflash_graphs.py
    `tables`): every DDTree budget up to GRAPH_K on a small vocabulary; on a large one (where the
    kernel runs) its smaller compile's width, the default budget's (15) — a wider table would
    double the kernel's rounds on every replay; wider budgets take the top-k after it."""
    if vocab >= MIN_VOCAB and triton_available():
        from specserve.kernels.topk.kernel import ROUNDS

        return min(ROUNDS[0], vocab)
    return min(GRAPH_K, vocab)


def warm_up(vocab: int, device: torch.device | str) -> bool:
    """Compile the kernel now where a drafter of `vocab` tokens on `device` would run it (its
    first batch of ≥ MIN_ROWS rows would otherwise wait for the compile); whether it did."""
    device = torch.device(device)
    if device.type != "cuda" or vocab < MIN_VOCAB or not triton_available():
        return False
    from specserve.kernels.topk.kernel import ROUNDS

    gen = torch.Generator(device).manual_seed(0)
    logits = torch.randn(MIN_ROWS, vocab, device=device, generator=gen)  # [rows, V] float32
    for k in ROUNDS:  # each of the kernel's compiles
        topk_logprobs_device(logits, k)
    return True


__all__ = ["GRAPH_K", "MIN_ROWS", "MIN_VOCAB", "graph_k", "topk_logprobs_device", "warm_up"]
