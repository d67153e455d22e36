"""Prompt-lookup drafting: suffix matching against a brute-force reference, and the n-gram tree."""

import numpy as np
import pytest

from specserve.drafters.ngram import NgramDrafter, find_ngram_continuation, ngram_tree


def reference_continuation(history, max_ngram, min_ngram, num_tokens):
    """Slow, obviously-correct prompt lookup: per n, scan start positions from the most recent."""
    size = len(history)
    for n in range(max_ngram, min_ngram - 1, -1):
        if size < n + 1:
            continue
        suffix = list(history[size - n :])
        for start in range(size - n - 1, -1, -1):
            if list(history[start : start + n]) == suffix:
                return list(history[start + n : start + n + num_tokens])
    return []


def tree_chains(tree):
    """Split a tree of depth-1 siblings with chains into per-branch token lists."""
    chains = []
    for token, parent in zip(tree.token_ids.tolist(), tree.parents.tolist(), strict=True):
        if parent == 0:
            chains.append([token])
        else:
            chains[-1].append(token)
    return chains


def test_continuation_of_most_recent_match():
    history = [1, 2, 3, 4, 9, 1, 2, 3, 4, 7, 5, 1, 2, 3, 4]
    assert find_ngram_continuation(history, max_ngram=4) == [7, 5, 1, 2, 3, 4]
    assert find_ngram_continuation(history, max_ngram=4, num_tokens=2) == [7, 5]


def test_longest_ngram_beats_a_more_recent_shorter_one():
    history = [5, 6, 7, 8, 0, 7, 3, 5, 6, 7]
    assert find_ngram_continuation(history, max_ngram=3, num_tokens=4) == [8, 0, 7, 3]
    assert find_ngram_continuation(history, max_ngram=1, num_tokens=4) == [3, 5, 6, 7]


def test_no_match_gives_empty():
    assert find_ngram_continuation([10, 11, 12, 13, 14]) == []
    assert find_ngram_continuation([]) == []
    assert find_ngram_continuation([42]) == []
    assert find_ngram_continuation([3, 9, 4, 9], num_tokens=0) == []
    # only a 1-gram matches, and min_ngram demands 2
    assert find_ngram_continuation([3, 9, 4, 9], min_ngram=2) == []
    assert find_ngram_continuation([3, 9, 4, 9], min_ngram=1) == [4, 9]


def test_overlapping_match_with_the_suffix():
    assert find_ngram_continuation([4, 4, 4, 4], max_ngram=4) == [4]
    assert find_ngram_continuation([8, 1, 8, 1, 8], max_ngram=3, num_tokens=5) == [1, 8]


@pytest.mark.parametrize("seed", range(6))
def test_matches_reference_on_random_histories(seed):
    rng = np.random.default_rng(seed)
    for _ in range(60):
        size = int(rng.integers(0, 90))
        history = rng.integers(0, int(rng.integers(2, 9)), size=size).tolist()
        max_ngram = int(rng.integers(1, 6))
        min_ngram = int(rng.integers(1, max_ngram + 1))
        num_tokens = int(rng.integers(1, 13))
        got = find_ngram_continuation(history, max_ngram, min_ngram, num_tokens)
        assert got == reference_continuation(history, max_ngram, min_ngram, num_tokens)


def test_long_history_picks_the_planted_recent_match():
    rng = np.random.default_rng(17)
    history = rng.integers(1000, 51000, size=100_003)  # [100003] int64, disjoint from the plants
    pattern = [7, 8, 9, 10]
    history[30_011:30_015] = pattern
    history[30_015:30_018] = [1, 2, 3]
    history[71_337:71_341] = pattern
    history[71_341:71_344] = [4, 5, 6]
    history[-4:] = pattern
    got = find_ngram_continuation(history, max_ngram=4, num_tokens=3)
    assert got == [4, 5, 6]
    assert got == reference_continuation(history.tolist(), 4, 1, 3)
    tree = ngram_tree(history, budget=6, max_depth=3)
    assert tree_chains(tree) == [[4, 5, 6], [1, 2, 3]]


def test_tree_first_chain_is_the_continuation_and_branches_differ():
    history = [1, 2, 30, 31, 32, 1, 2, 40, 41, 1, 2, 30, 33, 1, 2, 50, 51, 52, 53, 1, 2]
    tree = ngram_tree(history, budget=8, max_ngram=2, max_depth=3)
    assert tree.n == 8 and tree.max_depth == 3
    chains = tree_chains(tree)
    assert chains[0] == find_ngram_continuation(history, max_ngram=2, num_tokens=3)
    assert chains == [[50, 51, 52], [30, 33, 1], [40, 41]]  # last branch cut by the budget
    # a roomy budget: the oldest copy starts with 30 again, so it adds no branch
    roomy = ngram_tree(history, budget=20, max_ngram=2, max_depth=3)
    assert tree_chains(roomy) == [[50, 51, 52], [30, 33, 1], [40, 41, 1]]
    np.testing.assert_array_equal(roomy.depths, [1, 2, 3] * 3)
    np.testing.assert_array_equal(roomy.parents, [0, 1, 2, 0, 4, 5, 0, 7, 8])


@pytest.mark.parametrize("seed", range(4))
def test_tree_respects_budget_and_depth(seed):
    rng = np.random.default_rng(100 + seed)
    for _ in range(40):
        history = rng.integers(0, 6, size=int(rng.integers(2, 200)))  # [len] int64
        budget = int(rng.integers(0, 40))
        max_depth = int(rng.integers(1, 9))
        tree = ngram_tree(history, budget, max_ngram=3, max_depth=max_depth)
        assert tree.n <= budget and tree.max_depth <= max_depth
        first = find_ngram_continuation(history, 3, 1, min(max_depth, budget))
        chains = tree_chains(tree)
        assert (chains[0] if chains else []) == first
        assert len({c[0] for c in chains}) == len(chains)  # distinct depth-1 tokens


def test_tree_empty_cases_and_validation():
    assert ngram_tree([10, 11, 12], budget=8).n == 0
    assert ngram_tree([5, 6, 5], budget=0).n == 0
    with pytest.raises(ValueError, match="budget"):
        ngram_tree([5, 6, 5], budget=1025)
    with pytest.raises(ValueError, match="budget"):
        ngram_tree([5, 6, 5], budget=-1)
    with pytest.raises(ValueError, match="max_depth"):
        ngram_tree([5, 6, 5], budget=3, max_depth=0)
    with pytest.raises(ValueError, match="min_ngram"):
        find_ngram_continuation([5, 6, 5], max_ngram=2, min_ngram=3)


def test_drafter_class_wraps_ngram_tree():
    drafter = NgramDrafter(max_ngram=3, min_ngram=1, max_depth=4)
    history = [9, 8, 7, 6, 5, 9, 8, 7, 1, 2, 3, 9, 8, 7]
    tree = drafter.propose(history, budget=7)
    expected = ngram_tree(history, 7, max_ngram=3, min_ngram=1, max_depth=4)
    np.testing.assert_array_equal(tree.token_ids, expected.token_ids)
    assert tree_chains(tree) == [[1, 2, 3, 9], [6, 5, 9]]
    with pytest.raises(ValueError, match="min_ngram"):
        NgramDrafter(max_ngram=2, min_ngram=0)
