"""DraftTree validation, verify layout (tokens, positions, packed ancestor mask) and child maps."""

import contextlib

import numpy as np
import pytest

from specserve.spec.tree import (
    DraftTree,
    VerifyLayout,
    chain_tree,
    check_trees,
    child_rows,
    mask_to_dense,
    num_mask_words,
    verify_layout,
)
from tests.helpers import random_tree


def dense_by_walking(parents: np.ndarray) -> np.ndarray:
    """[n+1, n+1] bool ancestor-or-self matrix by walking each row's parent chain."""
    rows = parents.shape[0] + 1
    dense = np.zeros((rows, rows), dtype=bool)
    for i in range(rows):
        j = i
        while True:
            dense[i, j] = True
            if j == 0:
                break
            j = int(parents[j - 1])
    return dense


def test_chain_tree_links_each_node_to_the_previous():
    tree = chain_tree([17, 5, 902, 33, 8])
    assert tree.n == 5 and tree.max_depth == 5
    np.testing.assert_array_equal(tree.parents, [0, 1, 2, 3, 4])
    np.testing.assert_array_equal(tree.depths, [1, 2, 3, 4, 5])
    assert tree.token_ids.dtype == np.int64 and tree.parents.dtype == np.int32


def test_empty_tree_is_root_only_step():
    tree = DraftTree.empty()
    assert tree.n == 0 and tree.max_depth == 0
    layout = verify_layout(tree, root_token_id=4242, start=91)
    np.testing.assert_array_equal(layout.token_ids, [4242])
    np.testing.assert_array_equal(layout.positions, [91])
    np.testing.assert_array_equal(layout.mask, [[1]])
    assert child_rows(tree) == [{}]


INVALID = [
        ([3, 4], [0], [1, 1], "equal lengths"),
        ([3, 4, 5], [0, 2, 1], [1, 2, 2], r"parents\[i\]"),
        ([3, 4], [0, -1], [1, 1], r"parents\[i\]"),
        ([3, 4, 5], [0, 1, 1], [1, 2, 3], "depths"),
        ([3, 4], [0, 0], [2, 1], "depths"),
        ([3, 3], [0, 0], [1, 1], "distinct"),
        ([3, 5, 7, 5], [0, 1, 0, 1], [1, 2, 1, 2], "distinct"),  # equal tokens, not adjacent
        ([3, 3, 3], [0, 1, 2], [1, 2, 3], None),  # the same token under different parents: ok
        ([3, 1 << 32], [0, 0], [1, 1], "2\\*\\*32"),
        ([3, -4], [0, 1], [1, 2], "non-negative"),
]


@pytest.mark.parametrize("tokens, parents, depths, msg", INVALID)
def test_invalid_trees_raise(tokens, parents, depths, msg):
    with pytest.raises(ValueError, match=msg) if msg else contextlib.nullcontext():
        DraftTree(
            token_ids=np.array(tokens, dtype=np.int64),
            parents=np.array(parents, dtype=np.int32),
            depths=np.array(depths, dtype=np.int32),
        )


def test_wrong_dtype_or_rank_raises():
    good = chain_tree([9, 8, 7])
    with pytest.raises(ValueError, match="int32"):
        DraftTree(good.token_ids, good.parents.astype(np.int64), good.depths)
    with pytest.raises(ValueError, match="1-D"):
        DraftTree(good.token_ids.reshape(1, 3), good.parents, good.depths)
    with pytest.raises(ValueError, match="numpy array"):
        DraftTree([9, 8, 7], good.parents, good.depths)


def test_same_token_allowed_under_different_parents():
    tree = DraftTree(
        token_ids=np.array([11, 12, 11, 11], dtype=np.int64),
        parents=np.array([0, 0, 1, 2], dtype=np.int32),
        depths=np.array([1, 1, 2, 2], dtype=np.int32),
    )
    assert child_rows(tree) == [{11: 1, 12: 2}, {11: 3}, {11: 4}, {}, {}]


def test_layout_of_small_hand_tree():
    # root ─ a(1) ─ c(3) ─ e(5)
    #      └ b(2) ─ d(4)
    tree = DraftTree(
        token_ids=np.array([101, 202, 303, 404, 505], dtype=np.int64),
        parents=np.array([0, 0, 1, 2, 3], dtype=np.int32),
        depths=np.array([1, 1, 2, 2, 3], dtype=np.int32),
    )
    layout = verify_layout(tree, root_token_id=7, start=13)
    assert isinstance(layout, VerifyLayout) and layout.num_rows == 6
    np.testing.assert_array_equal(layout.token_ids, [7, 101, 202, 303, 404, 505])
    np.testing.assert_array_equal(layout.positions, [13, 14, 14, 15, 15, 16])
    expected = [0b1, 0b11, 0b101, 0b1011, 0b10101, 0b101011]
    np.testing.assert_array_equal(layout.mask[:, 0], expected)
    assert layout.mask.dtype == np.uint32 and layout.mask.shape == (6, 1)
    assert child_rows(tree) == [{101: 1, 202: 2}, {303: 3}, {404: 4}, {505: 5}, {}, {}]


@pytest.mark.parametrize("n, seed", [(1, 0), (30, 1), (31, 2), (32, 3), (63, 4), (97, 5), (300, 6)])
def test_random_tree_layout_matches_parent_walk(n, seed):
    rng = np.random.default_rng(seed)
    tree = random_tree(rng, n, vocab=1000)
    start = int(rng.integers(1, 5000))
    layout = verify_layout(tree, root_token_id=int(rng.integers(0, 1000)), start=start)
    assert layout.mask.shape == (n + 1, -(-(n + 1) // 32)) == (n + 1, num_mask_words(n + 1))
    np.testing.assert_array_equal(mask_to_dense(layout.mask, n + 1), dense_by_walking(tree.parents))
    np.testing.assert_array_equal(layout.positions[1:], start + tree.depths)
    assert layout.positions[0] == start
    # child maps must invert parents: every node is reachable from its parent by its token
    children = child_rows(tree)
    for row in range(1, n + 1):
        assert children[int(tree.parents[row - 1])][int(tree.token_ids[row - 1])] == row
    assert sum(len(c) for c in children) == n


def test_mask_bits_past_first_word():
    tree = chain_tree(np.arange(100, 140))  # 41 rows -> 2 words
    mask = verify_layout(tree, root_token_id=1, start=0).mask
    assert mask.shape == (41, 2)
    # row 40 of a chain sees all 41 rows: word 0 full, word 1 has bits 0..8
    assert mask[40, 0] == np.uint32(0xFFFFFFFF) and mask[40, 1] == np.uint32(0x1FF)
    assert mask[31, 1] == 0 and mask[32, 1] == 1 and mask[33, 1] == 0b11


def test_mask_to_dense_unpacks_hand_packed_words():
    mask = np.array([[0b101, 0], [1 << 31, 0b10]], dtype=np.uint32)  # [2, 2]
    dense = mask_to_dense(mask, 2)
    np.testing.assert_array_equal(dense, [[True, False], [False, False]])
    wide = np.zeros((34, 2), dtype=np.uint32)
    wide[33] = [1 << 31, 0b10]
    dense = mask_to_dense(wide, 34)
    assert dense.shape == (34, 34) and dense.sum() == 2
    assert dense[33, 31] and dense[33, 33]
    with pytest.raises(ValueError, match="too small"):
        mask_to_dense(np.zeros((34, 1), dtype=np.uint32), 34)


def test_verify_layout_rejects_negative_inputs():
    tree = chain_tree([5, 6])
    with pytest.raises(ValueError, match="root_token_id"):
        verify_layout(tree, root_token_id=-3, start=4)
    with pytest.raises(ValueError, match="start"):
        verify_layout(tree, root_token_id=3, start=-4)


def flat(trees: list[DraftTree], scores: bool) -> tuple:
    """`check_trees`' arguments for `trees` laid end to end."""
    cat = [np.concatenate([getattr(t, f) for t in trees]) for f in ("token_ids", "parents",
                                                                     "depths")]
    if scores:
        cat.append(np.concatenate([t.scores for t in trees]))
    return [t.n for t in trees], *cat


@pytest.mark.parametrize("tokens, parents, depths, msg",
                         [case for case in INVALID if case[3] != "equal lengths"])
@pytest.mark.parametrize("with_scores", [False, True])
def test_trees_checked_together_fail_alone_with_their_own_message(tokens, parents, depths, msg,
                                                                  with_scores):
    """A reply's trees are checked in one pass: a bad tree among good ones (irregular sizes, an
    empty one) gets DraftTree's own message; the others come back equal, as views."""
    rng = np.random.default_rng(len(tokens) + 7 * len(INVALID))
    odd = DraftTree.unchecked(np.array(tokens, dtype=np.int64),
                              np.array(parents, dtype=np.int32),
                              np.array(depths, dtype=np.int32))
    trees = [random_tree(rng, n, vocab=500) for n in (5, 0, 17, 1, 33)]
    trees.insert(3, odd)
    for t in trees:  # scores as a drafter sends them: non-increasing log-probs
        object.__setattr__(t, "scores", -np.cumsum(rng.random(t.n)).astype(np.float32)
                           if with_scores else None)
    got = check_trees(*flat(trees, with_scores))
    for i, (g, t) in enumerate(zip(got, trees, strict=True)):
        if i == 3 and msg is not None:
            with pytest.raises(ValueError, match=msg):
                DraftTree(t.token_ids, t.parents, t.depths, t.scores)
            assert isinstance(g, str)
            assert g == _message(t)
            continue
        assert isinstance(g, DraftTree), g
        for field in ("token_ids", "parents", "depths", "scores"):
            a, b = getattr(g, field), getattr(t, field)
            assert (a is None and b is None) or np.array_equal(a, b), field


@pytest.mark.parametrize("tokens, parents, depths, msg",
                         [case for case in INVALID if case[3] != "equal lengths"])
@pytest.mark.parametrize("with_scores", [False, True])
def test_one_or_two_trees_are_checked_alone_with_the_same_verdicts(tokens, parents, depths,
                                                                   msg, with_scores):
    """A reply of one or two trees (a batch-1 step's) is checked tree by tree in Python: the
    same verdict and message as DraftTree's own, the good tree beside it returned equal."""
    rng = np.random.default_rng(len(tokens) + 11)
    odd = DraftTree.unchecked(np.array(tokens, dtype=np.int64),
                              np.array(parents, dtype=np.int32),
                              np.array(depths, dtype=np.int32))
    good = random_tree(rng, 13, vocab=300)
    for t in (odd, good):
        object.__setattr__(t, "scores", -np.cumsum(rng.random(t.n)).astype(np.float32)
                           if with_scores else None)
    for trees in ([odd], [good, odd]):
        got = check_trees(*flat(trees, with_scores))
        assert got[-1] == _message(odd) if msg else isinstance(got[-1], DraftTree)
        if len(trees) == 2:
            assert isinstance(got[0], DraftTree)
            assert np.array_equal(got[0].token_ids, good.token_ids)
            assert np.array_equal(got[0].parents, good.parents)


def _message(t: DraftTree) -> str:
    try:
        DraftTree(t.token_ids, t.parents, t.depths, t.scores)
    except ValueError as e:
        return str(e)
    return ""


@pytest.mark.parametrize("bad", [0.5, np.nan, -np.inf])
def test_trees_checked_together_check_scores(bad):
    rng = np.random.default_rng(3)
    trees = [random_tree(rng, n, vocab=100) for n in (4, 9, 2)]
    for t in trees:
        object.__setattr__(t, "scores", np.linspace(-0.1, -3, t.n, dtype=np.float32))
    trees[1].scores[6] = bad
    got = check_trees(*flat(trees, True))
    assert isinstance(got[0], DraftTree) and isinstance(got[2], DraftTree)
    assert got[1] == "scores must be finite log-probabilities (<= 0)"
    one, two = check_trees(*flat(trees[:2], True))  # two trees: each checked alone
    assert isinstance(one, DraftTree) and two == got[1]


def test_trees_checked_together_need_flat_arrays_of_their_dtypes():
    with pytest.raises(ValueError, match="int32"):
        check_trees([2], np.array([1, 2]), np.array([0, 0]), np.array([1, 1], dtype=np.int32))
    with pytest.raises(ValueError, match="hold 3 nodes"):
        check_trees([3], np.array([1, 2]), np.array([0, 0], dtype=np.int32),
                    np.array([1, 1], dtype=np.int32))
