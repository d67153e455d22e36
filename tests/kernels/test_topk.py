"""The top-k log-probs kernel (kernels/topk) vs torch's top-k and log-sum-exp (ref.py).

On the CPU through the Triton interpreter, on a GPU compiled: irregular vocabularies of two and
more chunks (the last one partial, a vocabulary one column past a chunk), k from 1 to the
kernel's most, rows of spread-out logits (no ties, so the ids must be equal) and rows with the
top values in one chunk and in the partial chunk; then the dispatch (CPU and small vocabularies
take torch) and `spec.ddtree.topk_logprobs` through it.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():  # CPU: the Triton interpreter (set before triton is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from specserve.kernels.topk import (  # noqa: E402
    GRAPH_K,
    MIN_ROWS,
    MIN_VOCAB,
    graph_k,
    topk_logprobs_device,
    warm_up,
)
from specserve.kernels.topk.kernel import BLOCK, MAX_K, ROUNDS, topk_logprobs_triton  # noqa: E402
from specserve.kernels.topk.ref import topk_logprobs_ref  # noqa: E402
from specserve.spec.ddtree import topk_logprobs  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def logits(rows: int, vocab: int, seed: int) -> torch.Tensor:  # [rows, vocab] float32
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * 4
    x[1, -3:] += 40  # row 1: its best columns in the last, partial chunk
    x[2, 5:40] += 30  # row 2: its best k in the first chunk
    return x.float().to(DEV)


@pytest.mark.parametrize("vocab, k, seed", [(2 * BLOCK + 808, 15, 0), (BLOCK + 1, 1, 1),
                                            (3 * BLOCK - 5, MAX_K, 2), (2 * BLOCK + 37, 7, 3)])
def test_kernel_equals_torch(vocab, k, seed):
    x = logits(5, vocab, seed)
    lp, ids = topk_logprobs_triton(x, k)
    want_lp, want_ids = topk_logprobs_ref(x, k)
    assert lp.shape == (5, k) and ids.dtype == torch.int64
    assert torch.equal(ids.cpu(), want_ids.cpu())
    torch.testing.assert_close(lp, want_lp, rtol=0, atol=2e-5)
    assert (lp[:, :-1] >= lp[:, 1:]).all()  # sorted, descending


def test_kernel_rejects_what_it_cannot_take():
    x = logits(3, BLOCK + 9, 4)
    for bad_k in (0, MAX_K + 1):
        with pytest.raises(ValueError, match="k must be"):
            topk_logprobs_triton(x, bad_k)
    with pytest.raises(ValueError, match="float32"):
        topk_logprobs_triton(x.double(), 4)


def test_dispatch_and_the_host_tables():
    """On a GPU ≥ MIN_ROWS rows of ≥ MIN_VOCAB columns go through the kernel, anything else
    through torch; the host tables `spec.ddtree.topk_logprobs` makes are the torch formula's
    either way."""
    x = logits(MIN_ROWS + 6, MIN_VOCAB + 123, 5)
    lp, ids = topk_logprobs_device(x, 15)
    want_lp, want_ids = topk_logprobs_ref(x, 15)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(lp, want_lp, rtol=0, atol=2e-5)
    host_lp, host_ids = topk_logprobs(x, 15)
    np.testing.assert_array_equal(host_ids, want_ids.cpu().numpy())
    np.testing.assert_allclose(host_lp, want_lp.cpu().numpy(), rtol=0, atol=2e-5)
    small = logits(3, 600, 6)
    assert torch.equal(topk_logprobs_device(small, 9)[1], topk_logprobs_ref(small, 9)[1])


def test_warm_up_compiles_only_where_the_kernel_runs():
    """A drafter's warm-up compiles the kernel's two variants on CUDA for a large vocabulary;
    on the CPU or for a small vocabulary there is nothing to compile."""
    assert warm_up(MIN_VOCAB - 1, DEV) is False
    assert warm_up(MIN_VOCAB, "cpu") is False
    assert warm_up(MIN_VOCAB, DEV) is (DEV == "cuda")


def test_a_drafter_graphs_table_width_keeps_the_kernels_smaller_compile_on_a_large_vocabulary():
    """`graph_k`: every size class up to GRAPH_K − 1 nodes on a small vocabulary (all of a tiny
    one), the kernel's first round on a large one (its work for the default budget 15), so a
    replay's tables never double the kernel's rounds."""
    assert (graph_k(37), graph_k(4096), GRAPH_K) == (37, 64, 64)
    assert graph_k(151936) == graph_k(MIN_VOCAB) == ROUNDS[0] == 16 < MAX_K
