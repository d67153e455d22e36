"""DDTree: top-k log-probs, heap optimality against brute force, tree structure and layout."""

import itertools

import numpy as np
import pytest
import torch

from specserve.spec.ddtree import build_ddtree, build_ddtree_timed, topk_logprobs
from specserve.spec.tree import DraftTree, mask_to_dense, verify_layout


def tree_paths(tree: DraftTree) -> list[tuple[int, ...]]:
    """Root-to-node token path of every node, in node order."""
    paths: list[tuple[int, ...]] = [()]
    for parent, token in zip(tree.parents.tolist(), tree.token_ids.tolist(), strict=True):
        paths.append(paths[parent] + (token,))
    return paths[1:]


def full_logprobs(logits: torch.Tensor) -> np.ndarray:
    return torch.log_softmax(logits.double(), dim=-1).numpy()  # [L, V] float64


def ranked_prefixes(logprobs: np.ndarray) -> tuple[list[tuple[int, ...]], np.ndarray]:
    """Every prefix of length 1..L with its log-prob, best first."""
    num_depths, vocab = logprobs.shape
    prefixes, scores = [], []
    for depth in range(1, num_depths + 1):
        for prefix in itertools.product(range(vocab), repeat=depth):
            prefixes.append(prefix)
            scores.append(sum(logprobs[d, t] for d, t in enumerate(prefix)))
    order = np.argsort(-np.array(scores), kind="stable")
    return [prefixes[i] for i in order], np.array(scores)[order]


@pytest.mark.parametrize("num_depths", [3, 4, 5])
@pytest.mark.parametrize("vocab", [3, 4, 5, 7])
def test_tree_is_the_budget_most_probable_prefixes(num_depths, vocab):
    compared = 0
    for seed in range(2):
        gen = torch.Generator().manual_seed(1000 * num_depths + 10 * vocab + seed)
        logits = 2.5 * torch.randn(num_depths, vocab, generator=gen)  # [L, V] float32
        prefixes, scores = ranked_prefixes(full_logprobs(logits))
        for budget in range(1, min(40, len(prefixes)) + 1):
            if budget < len(prefixes) and scores[budget - 1] - scores[budget] < 1e-5:
                continue  # a tie at the cut: either prefix is optimal
            lp, ids = topk_logprobs(logits, min(budget, vocab))
            tree = build_ddtree(lp, ids, budget)
            assert tree.n == budget
            DraftTree(tree.token_ids, tree.parents, tree.depths, tree.scores)  # built unchecked
            assert set(tree_paths(tree)) == set(prefixes[:budget])
            compared += 1
    assert compared >= 75  # 2 seeds x up to 40 budgets; only near-ties are skipped


def test_tree_is_prefix_closed_topological_and_lays_out():
    gen = torch.Generator().manual_seed(7)
    logits = 1.5 * torch.randn(5, 7, generator=gen)  # [5, 7] float32
    lp, ids = topk_logprobs(logits, 7)
    tree = build_ddtree(lp, ids, budget=45)
    assert tree.n == 45
    DraftTree(tree.token_ids, tree.parents, tree.depths, tree.scores)  # its invariants hold
    assert np.all(tree.parents <= np.arange(tree.n))  # parents precede children
    paths = tree_paths(tree)
    assert len(set(paths)) == tree.n
    assert all(p[:-1] in set(paths) for p in paths if len(p) > 1)  # prefix-closed
    layout = verify_layout(tree, root_token_id=3, start=211)
    np.testing.assert_array_equal(layout.positions, 211 + np.concatenate([[0], tree.depths]))
    assert layout.mask.shape == (46, 2)
    dense = mask_to_dense(layout.mask, 46)  # [46, 46] bool
    for row in range(1, 46):  # ancestors of a row = root + the rows of its path's prefixes
        path = paths[row - 1]
        ancestors = {0} | {1 + paths.index(path[:d]) for d in range(1, len(path) + 1)}
        assert set(np.flatnonzero(dense[row]).tolist()) == ancestors


def test_budget_one_is_the_argmax_at_depth_one():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 53, generator=gen)  # [6, 53] float32
    lp, ids = topk_logprobs(logits, 1)
    tree = build_ddtree(lp, ids, budget=1)
    assert tree.n == 1 and tree.depths[0] == 1 and tree.parents[0] == 0
    assert tree.token_ids[0] == int(logits[0].argmax())


def test_confident_drafter_gets_full_argmax_chain_plus_branches():
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(5, 29, generator=gen)  # [5, 29] float32
    argmax = torch.randint(0, 29, (5,), generator=gen)  # [5] int64
    logits[torch.arange(5), argmax] += 9.0  # top-1 prob > 0.95 per depth: the chain dominates
    budget = 12
    lp, ids = topk_logprobs(logits, budget)
    tree = build_ddtree(lp, ids, budget)
    paths = set(tree_paths(tree))
    chain = tuple(argmax.tolist())
    assert all(chain[:d] in paths for d in range(1, 6))
    assert tree.n == budget and tree.max_depth == 5
    # the other budget - 5 nodes are branches; the likeliest one-token deviation must be among them
    full = full_logprobs(logits)  # [5, 29] float64
    second = np.argsort(-full, axis=1)[:, 1]  # [5] second-best token per depth
    deviations = [chain[:d] + (int(second[d]),) for d in range(5)]
    best = max(deviations, key=lambda p: sum(full[d, t] for d, t in enumerate(p)))
    assert best in paths and len(paths - {chain[:d] for d in range(1, 6)}) == budget - 5


def test_max_depth_and_exhausted_heap():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 3, generator=gen)  # [4, 3] float32
    lp, ids = topk_logprobs(logits, 3)
    shallow = build_ddtree(lp, ids, budget=30, max_depth=2)
    assert shallow.n == 3 + 9 and shallow.max_depth == 2  # every prefix up to depth 2, then empty
    full = build_ddtree(lp, ids, budget=1024)
    assert full.n == 3 + 9 + 27 + 81 and full.max_depth == 4
    assert build_ddtree(lp, ids, budget=0).n == 0
    with pytest.raises(ValueError, match="max_depth"):
        build_ddtree(lp, ids, budget=4, max_depth=5)


def test_ties_break_by_push_order():
    lp = np.log(np.full((2, 2), 0.5, dtype=np.float32))  # [2, 2] uniform
    ids = np.array([[40, 41], [50, 51]], dtype=np.int64)  # [2, 2]
    tree = build_ddtree(lp, ids, budget=3)
    np.testing.assert_array_equal(tree.token_ids, [40, 41, 50])
    np.testing.assert_array_equal(tree.parents, [0, 0, 1])  # the older child entry wins the tie


@pytest.mark.parametrize("budget", [-1, 1025, 5000])
def test_budget_out_of_range_raises(budget):
    lp = np.log(np.full((3, 2), 0.5, dtype=np.float32))
    ids = np.array([[1, 2]] * 3, dtype=np.int64)
    with pytest.raises(ValueError, match="budget"):
        build_ddtree(lp, ids, budget)
    with pytest.raises(ValueError, match="budget"):
        build_ddtree_timed(torch.randn(3, 9), budget)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_topk_logprobs_matches_log_softmax_topk(dtype):
    gen = torch.Generator().manual_seed(19)
    logits = (3.0 * torch.randn(15, 1237, generator=gen)).to(dtype)  # [15, 1237]
    lp, ids = topk_logprobs(logits, 37)
    assert isinstance(lp, np.ndarray) and isinstance(ids, np.ndarray)
    assert lp.dtype == np.float32 and ids.dtype == np.int64 and lp.shape == ids.shape == (15, 37)
    ref_lp, ref_ids = torch.log_softmax(logits.float(), dim=-1).topk(37, dim=-1)
    np.testing.assert_allclose(lp, ref_lp.numpy(), atol=1e-6, rtol=1e-6)
    np.testing.assert_array_equal(ids, ref_ids.numpy())
    assert np.all(np.diff(lp, axis=1) <= 0)


def test_topk_logprobs_rejects_bad_k_and_shape():
    logits = torch.randn(4, 9)
    with pytest.raises(ValueError, match="k must"):
        topk_logprobs(logits, 10)
    with pytest.raises(ValueError, match="k must"):
        topk_logprobs(logits, 0)
    with pytest.raises(ValueError, match="2-D"):
        topk_logprobs(logits[0], 3)


def test_timed_build_equals_untimed():
    gen = torch.Generator().manual_seed(23)
    logits = torch.randn(15, 211, generator=gen)  # [15, 211] float32
    tree, build_time_s = build_ddtree_timed(logits, budget=64)
    lp, ids = topk_logprobs(logits, 64)
    expected = build_ddtree(lp, ids, 64)
    assert build_time_s >= 0.0 and tree.n == 64
    np.testing.assert_array_equal(tree.token_ids, expected.token_ids)
    np.testing.assert_array_equal(tree.parents, expected.parents)
    small_vocab, _ = build_ddtree_timed(logits[:, :5], budget=300)  # K = min(budget, V) = 5
    assert small_vocab.n == 300
    assert build_ddtree_timed(logits, budget=0)[0].n == 0
