"""DFlash drafter: batching, bounded sliding-layer memory, trees, and request-state errors."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from specserve.drafters.base import DraftRequest
from specserve.drafters.dflash import DFlashDrafter
from specserve.errors import CapacityExhausted
from specserve.models.dflash import DFlashDraftModel
from specserve.models.dflash_config import DFlashConfig
from specserve.spec.ddtree import build_ddtree, topk_logprobs

VOCAB, HIDDEN, WINDOW, BLOCK = 37, 24, 12, 6


def tiny_model(seed: int = 0, layer_types=("sliding_attention", "full_attention"), head_dim=8):
    cfg = DFlashConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=40, num_layers=len(layer_types),
        num_heads=3, num_kv_heads=1, head_dim=head_dim, rms_norm_eps=1e-6, block_size=BLOCK,
        target_layer_ids=(0, 2), mask_token_id=VOCAB - 1, layer_types=tuple(layer_types),
        causal=tuple(t == "sliding_attention" for t in layer_types), sliding_window=WINDOW)
    torch.manual_seed(seed)
    model = DFlashDraftModel(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3) if p.ndim > 1 else p.uniform_(0.5, 1.5)
    return model


def features(n: int, seed: int) -> torch.Tensor:  # [n, 2 * HIDDEN]
    return torch.randn(n, 2 * HIDDEN, generator=torch.Generator().manual_seed(seed))


def request(rid: str, start: int, context, bonus: int = 3, budget: int = 8, max_depth: int = 99):
    return DraftRequest(rid, bonus, start, budget=budget, max_depth=max_depth, context=context)


def test_batched_requests_equal_each_alone():
    model = tiny_model()
    together = DFlashDrafter(model, num_pages=30, page_size=4, poison=True)
    alone = {rid: DFlashDrafter(model, num_pages=30, page_size=4, poison=True) for rid in "ab"}
    # (request, new rows, bonus, max_depth) per call; "b" joins late and its block shrinks.
    calls = [[("a", 23, 5, 99)], [("a", 4, 7, 99), ("b", 9, 11, 3)], [("b", 2, 2, 99),
                                                                      ("a", 1, 30, 2)]]
    starts, seed = {"a": 0, "b": 0}, 10
    for call in calls:
        batch = []
        for rid, n_new, bonus, depth in call:
            starts[rid] += n_new
            seed += 1
            batch.append(request(rid, starts[rid], features(n_new, seed), bonus, max_depth=depth))
        joint = together.draft_logits(batch)
        for req, got in zip(batch, joint, strict=True):
            (single,) = alone[req.request_id].draft_logits([req])
            assert got.shape == (min(BLOCK - 1, req.max_depth), VOCAB)
            torch.testing.assert_close(got, single, rtol=1e-5, atol=1e-5)
    assert together.last_stats is None  # draft_logits does not build trees


def _feed_long(page_size: int, sliding_pages: int) -> tuple[DFlashDrafter, list]:
    drafter = DFlashDrafter(tiny_model(), num_pages=100_100 // page_size + 2,
                            page_size=page_size, sliding_num_pages=sliding_pages)
    start, held = 0, []
    for i, n in enumerate((40_000, 30_001, 29_999)):
        start += n
        drafter.draft_logits([request("r", start, features(n, i))])
        held.append((start, drafter.cache.held_slots("r", 0), drafter.cache.held_slots("r", 1)))
    drafter.draft_logits([request("r", start, None, bonus=9)])  # no new context: still fine
    return drafter, held


def test_sliding_layers_stay_bounded_full_layers_keep_all():
    logits = {}
    # The sliding pools are sized to the bound itself: any leak would exhaust them.
    for page_size, slack, sliding_pages in ((1, 0, WINDOW + BLOCK), (16, 2 * 15, 3)):
        drafter, held = _feed_long(page_size, sliding_pages)
        for length, sliding, full in held:
            assert sliding <= WINDOW + BLOCK + slack
            assert length + BLOCK <= full <= length + BLOCK + page_size - 1
        logits[page_size] = drafter.draft_logits([request("r", 100_003, features(3, 7))])[0]
        drafter.release("r")
        assert drafter.cache.num_free_pages(0) == sliding_pages
        assert drafter.cache.num_free_pages(1) == 100_100 // page_size + 2
    assert torch.isfinite(logits[1]).all()
    torch.testing.assert_close(logits[1], logits[16], rtol=1e-5, atol=1e-5)


def test_tree_and_chain_follow_the_logits():
    model = tiny_model(seed=1)
    plain, ddtree, chain = (DFlashDrafter(model, 20, 5, tree=t) for t in (True, True, False))
    ctx = features(17, 3)
    (logits,) = plain.draft_logits([request("r", 17, ctx, budget=7)])
    tree = ddtree.draft([request("r", 17, ctx, budget=7)])[0]
    expected = build_ddtree(*topk_logprobs(logits, 7), budget=7, max_depth=BLOCK - 1)
    assert tree.n == 7 and np.array_equal(tree.token_ids, expected.token_ids)
    assert np.array_equal(tree.parents, expected.parents)
    stats = ddtree.last_stats
    assert (stats.num_requests, stats.context_rows, stats.block_rows) == (1, 17, BLOCK)
    assert stats.forward_s > 0 and stats.tree_s > 0
    (path,) = chain.draft([request("r", 17, ctx, budget=3)])
    assert path.token_ids.tolist() == logits.argmax(-1)[:3].tolist()  # the budget caps the chain
    assert path.parents.tolist() == [0, 1, 2]
    (longer,) = chain.draft([request("r", 17, None, budget=50)])
    assert longer.token_ids.tolist() == logits.argmax(-1).tolist()  # as deep as the block


def test_budget_zero_is_empty_but_keeps_the_context():
    drafter = DFlashDrafter(tiny_model(), 20, 4)
    for budget, depth in ((0, 5), (5, 0)):
        drafter.release("r")
        (tree,) = drafter.draft([request("r", 11, features(11, 1), budget=budget,
                                         max_depth=depth)])
        assert tree.n == 0 and drafter.cache.length("r") == 11
        assert drafter.last_stats.block_rows == 0
        (tree,) = drafter.draft([request("r", 13, features(2, 2), budget=4)])
        assert tree.n == 4


def test_continuity_violations_name_the_request():
    drafter = DFlashDrafter(tiny_model(), 20, 4)
    drafter.draft([request("kept", 10, features(10, 1))])
    with pytest.raises(ValueError, match=r"'kept'.*\[12, 15\).*holds \[0, 10\)"):
        drafter.draft([request("kept", 15, features(3, 2))])
    with pytest.raises(ValueError, match=r"'late'.*\[4, 9\)"):
        drafter.draft([request("late", 9, features(5, 3))])
    with pytest.raises(ValueError, match="'kept'.*context must be"):
        drafter.draft([request("kept", 13, torch.ones(3, 5))])
    assert drafter.cache.length("kept") == 10 and drafter.cache.length("late") == 0
    assert drafter.draft([request("kept", 13, features(3, 4))])[0].n == 8


def test_capacity_is_all_or_nothing():
    drafter = DFlashDrafter(tiny_model(layer_types=("full_attention",)), num_pages=6, page_size=4)
    drafter.draft([request("a", 9, features(9, 1))])
    held = drafter.cache.held_slots("a", 0)
    with pytest.raises(CapacityExhausted, match="needs 5 more pages, 2 of 6"):
        drafter.draft([request("a", 11, features(2, 2)), request("b", 9, features(9, 3))])
    assert drafter.cache.length("a") == 9 and drafter.cache.held_slots("a", 0) == held
    assert drafter.cache.length("b") == 0
    drafter.release("a")
    assert drafter.cache.num_free_pages(0) == 6


def test_stacked_context_kv_equals_per_layer_and_follows_weight_updates():
    model = tiny_model(seed=4, layer_types=("sliding_attention", "full_attention",
                                            "sliding_attention"))
    fused = torch.randn(7, HIDDEN, generator=torch.Generator().manual_seed(1))
    positions = torch.tensor([3, 4, 5, 9, 10, 11, 40])
    layers = (0, 2)  # one group's layers, not adjacent
    for _ in range(2):  # before and after the update
        k, v = model.context_kv_layers(layers, fused, positions)  # [2, 7, Hkv, D]
        for j, layer in enumerate(layers):
            want_k, want_v = model.context_kv(layer, fused, positions)
            torch.testing.assert_close(k[j], want_k, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(v[j], want_v, rtol=1e-5, atol=1e-6)
        with torch.no_grad():  # an in-place update (an optimizer step): the stack must follow
            model.layers[2].self_attn.v_proj.weight.mul_(1.5)
            model.layers[0].self_attn.k_norm.weight.add_(0.25)


@pytest.mark.parametrize("graphs", [False, True], ids=["dynamic", "static"])
def test_a_call_builds_each_tree_from_its_own_rows(graphs):
    """A call's trees come from one top-k (the largest budget's) over every request's rows and
    one host copy; each equals the tree built from that request's logits alone — budgets 8 / 3
    and a block cut short by max_depth beside a feed (budget 0) in the same call; the chain
    drafter's paths are each request's argmax, capped by its budget."""
    calls = [[("a", 13, 8, 99), ("b", 9, 3, 99), ("c", 17, 0, 99)],
             [("a", 2, 8, 99), ("b", 3, 3, 2), ("c", 4, 0, 99)]]
    kw = dict(graphs=graphs, capture=False)
    raw, ddtree, chain = (DFlashDrafter(tiny_model(seed=2), 40, 4, tree=t, **kw)
                          for t in (True, True, False))
    starts = {}
    for n, call in enumerate(calls):
        batch = []
        for rid, n_new, budget, depth in call:
            starts[rid] = starts.get(rid, 0) + n_new
            batch.append(request(rid, starts[rid], features(n_new, 10 * n + len(batch)),
                                 bonus=5 + len(batch), budget=budget, max_depth=depth))
        logits = raw.draft_logits(batch)
        trees, paths = ddtree.draft(batch), chain.draft(batch)
        for r, lg, tree, path in zip(batch, logits, trees, paths, strict=True):
            if r.budget == 0:
                assert tree.n == 0 and path.n == 0
                continue
            depth = min(BLOCK - 1, r.max_depth)
            assert lg.shape[0] == depth
            want = build_ddtree(*topk_logprobs(lg, r.budget), budget=r.budget, max_depth=depth)
            assert tree.n == r.budget
            for field in ("token_ids", "parents", "depths", "scores"):
                assert np.array_equal(getattr(tree, field), getattr(want, field)), field
            assert path.token_ids.tolist() == lg.argmax(-1)[: r.budget].tolist()
    assert ddtree.last_stats.block_rows == BLOCK + 3  # a full block and one of depth 2


def test_a_chain_ask_is_the_argmax_path_scored_beside_trees_in_the_same_call():
    """A request asking for a chain gets its rows' argmax tokens, `budget` deep at most, each
    node scored with its path's log-probability (the log-softmax of torch, summed); the trees
    asked for in the same call are the trees they are alone."""
    drafter, raw = (DFlashDrafter(tiny_model(seed=4), 40, 4) for _ in range(2))
    batch = [request("t", 11, features(11, 1), bonus=5, budget=6),
             replace(request("c", 7, features(7, 2), bonus=9, budget=3), chain=True),
             replace(request("d", 13, features(13, 3), bonus=2, budget=40), chain=True)]
    logits = raw.draft_logits(batch)
    trees = drafter.draft(batch)
    want = build_ddtree(*topk_logprobs(logits[0], 6), budget=6, max_depth=BLOCK - 1)
    for field in ("token_ids", "parents", "depths", "scores"):
        assert np.array_equal(getattr(trees[0], field), getattr(want, field)), field
    for r, lg, tree in zip(batch[1:], logits[1:], trees[1:], strict=True):
        best, ids = torch.log_softmax(lg.double(), dim=-1).max(dim=-1)  # [L] each
        n = min(r.budget, lg.shape[0])
        assert tree.n == n and tree.token_ids.tolist() == ids[:n].tolist()
        assert tree.parents.tolist() == list(range(n)) and tree.depths.tolist() == \
            list(range(1, n + 1))
        np.testing.assert_allclose(tree.scores, best.cumsum(0)[:n].numpy(), rtol=1e-5)
