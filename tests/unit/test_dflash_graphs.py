"""The DFlash drafter's static block forward (drafters/dflash_graphs.py) vs its dynamic path.

On the CPU the static path runs eagerly (`capture=False`): the same padded buffers, dummy
requests on a trash page and per-step metadata copy a CUDA graph replays on a GPU. Its draft
logits must equal the dynamic path's over a batched multi-call scenario — requests joining late,
a bucket of 4 holding 3 real requests plus a dummy, blocks shrinking near max_depth (mixed block
lengths take the dynamic path), a sliding-window causal layer and a full bidirectional one,
4-token pages interleaved between requests and poisoned with NaN.
"""

from __future__ import annotations

import os

import pytest
import torch

from specserve.drafters.base import DraftRequest
from specserve.drafters.dflash import DFlashDrafter
from tests.unit.test_dflash_cache import BLOCK, HIDDEN, tiny_model

# (request, new context rows, bonus, max_depth) per call
CALLS = [[("a", 23, 5, 99)], [("a", 4, 7, 99), ("b", 9, 11, 3)],
         [("b", 2, 2, 99), ("a", 1, 30, 2)], [("a", 3, 1, 99), ("b", 1, 4, 99)],
         [("c", 7, 9, 99), ("a", 2, 3, 99), ("b", 1, 8, 99)], [("c", 1, 6, 99)]]


def run_calls(drafter: DFlashDrafter, device: str = "cpu") -> list[torch.Tensor]:
    starts, seed, out = {}, 10, []
    for call in CALLS:
        batch = []
        for rid, n_new, bonus, depth in call:
            starts[rid] = starts.get(rid, 0) + n_new
            seed += 1
            ctx = torch.randn(n_new, 2 * HIDDEN, generator=torch.Generator().manual_seed(seed))
            batch.append(DraftRequest(rid, bonus, starts[rid], budget=8, max_depth=depth,
                                      context=ctx.to(device)))
        out += drafter.draft_logits(batch)
    return out


def test_static_block_forward_equals_dynamic():
    want = run_calls(DFlashDrafter(tiny_model(), num_pages=60, page_size=4, poison=True))
    drafter = DFlashDrafter(tiny_model(), num_pages=60, page_size=4, poison=True, graphs=True,
                            capture=False)
    got = run_calls(drafter)
    assert sorted(drafter.graphs._graphs) == [(1, BLOCK), (2, BLOCK), (4, BLOCK)]
    assert [g.shape for g in got] == [w.shape for w in want] and len(got) == 11
    for g, w in zip(got, want, strict=True):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_trash_pages_are_never_handed_out():
    drafter = DFlashDrafter(tiny_model(), num_pages=60, page_size=4, graphs=True, capture=False)
    run_calls(drafter)
    for name, group in drafter.cache.groups.items():
        trash = drafter.graphs.trash[name]
        assert trash not in group.free
        for entry in drafter.cache._requests.values():
            assert trash not in entry.pages[name].live


@pytest.mark.skipif(not torch.cuda.is_available() or bool(os.environ.get("TRITON_INTERPRET")),
                    reason="needs a CUDA device (and TRITON_INTERPRET unset)")
def test_captured_block_forward_equals_dynamic_on_gpu():
    """The same scenario with the block forwards captured as CUDA graphs and replayed (head_dim
    16: the Triton kernel's smallest)."""
    model = tiny_model(head_dim=16).cuda()
    want = run_calls(DFlashDrafter(model, num_pages=60, page_size=4, poison=True), "cuda")
    drafter = DFlashDrafter(model, num_pages=60, page_size=4, poison=True, graphs=True)
    got = run_calls(drafter, "cuda")
    assert all(st.graph is not None for st in drafter.graphs._graphs.values())
    for g, w in zip(got, want, strict=True):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
