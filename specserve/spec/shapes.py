"""Sub-trees of a drafted tree, and what each is expected to (and did) accept.

Owns the candidate shapes adaptive speculation chooses among for one request: the tree's first
k nodes (for a DDTree, whose nodes come best first, that is exactly the DDTree of budget k) and
the chain inside it (from the root, always the most probable child). Under the drafter's
factorised model a node's path is accepted with probability exp(score), so a shape's expected
accepted length is the sum over its nodes. What a shape *did* accept is exact for any shape
inside the verified tree: the acceptance walk draws the target's token at each node whatever the
tree holds, so a sub-tree accepts the leading part of the verified path that lies inside it.
Pure numpy; no timing (engine/cost.py) and no policy (engine/adaptive.py).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specserve.spec.tree import DraftTree, VerifyLayout, ancestor_mask, num_mask_words

TREE, CHAIN, OFF = "tree", "chain", "off"


@dataclass(frozen=True)
class Choice:
    """What adaptive speculation verifies for a request this step, and why."""

    shape: str  # TREE | CHAIN | OFF (B = 0: plain decoding)
    nodes: int  # draft nodes chosen (0 for OFF)
    why: str


@dataclass(frozen=True)
class Shape:
    """A prefix-closed subset of a drafted tree: `nodes` are indices into it, parents first."""

    kind: str  # TREE (the first k nodes) | CHAIN (the most probable path)
    nodes: np.ndarray  # [k] int64 node indices of the drafted tree, ascending
    expected: float  # expected accepted length under the drafter (sum of exp(score))


def prefix(tree: DraftTree, k: int) -> Shape:
    """The first `k` nodes (any topological order keeps every prefix parent-closed)."""
    k = max(0, min(k, tree.n))
    return Shape(TREE, np.arange(k, dtype=np.int64), _expected(tree, np.arange(k)))


def chain(tree: DraftTree, k: int) -> Shape:
    """At most `k` nodes of the path that takes the most probable child at every depth."""
    if tree.scores is None or tree.n == 0 or k <= 0:
        return Shape(CHAIN, np.zeros(0, dtype=np.int64), 0.0)
    nodes = np.asarray(_best_path(tree.parents.tolist(), tree.scores.tolist())[:k],
                       dtype=np.int64)
    return Shape(CHAIN, nodes, _expected(tree, nodes))


def _best_path(parents: list[int], scores: list[float]) -> list[int]:
    """The node indices of the path from the root through each node's most probable child."""
    best: dict[int, int] = {}  # parent row -> the child node with the highest score
    for i, parent in enumerate(parents):
        j = best.get(parent)
        if j is None or scores[i] > scores[j]:
            best[parent] = i
    path, row = [], 0
    while row in best:
        path.append(best[row])
        row = best[row] + 1
    return path


def expected(tree: DraftTree) -> float:
    """The whole tree's expected accepted length under the drafter (0 without scores)."""
    return _expected(tree, np.arange(tree.n))


def _expected(tree: DraftTree, nodes: np.ndarray) -> float:
    if tree.scores is None or len(nodes) == 0:
        return 0.0
    return float(np.exp(tree.scores[nodes].astype(np.float64)).sum())


def subtree(tree: DraftTree, shape: Shape) -> DraftTree:
    """The shape as a DraftTree of its own (parents re-indexed, scores kept)."""
    nodes, k = shape.nodes, len(shape.nodes)
    if k == tree.n:
        return tree
    scores = tree.scores
    if shape.kind == TREE:  # a prefix: its parents already point inside it
        return DraftTree.unchecked(tree.token_ids[:k], tree.parents[:k], tree.depths[:k],
                                   None if scores is None else scores[:k])
    row_of = np.zeros(tree.n + 1, dtype=np.int64)  # old verify row -> new verify row
    row_of[nodes + 1] = np.arange(1, k + 1)
    return DraftTree.unchecked(
        tree.token_ids[nodes],  # [k] int64
        row_of[tree.parents[nodes]].astype(np.int32),  # [k] int32
        tree.depths[nodes],  # [k] int32
        None if scores is None else scores[nodes],  # [k] float32
    )


def prefix_layout(layout: VerifyLayout, k: int) -> VerifyLayout:
    """The verify layout of a tree's first `k` nodes, cut from the whole tree's (its rows'
    ancestors are all among them)."""
    rows = k + 1
    return VerifyLayout(layout.token_ids[:rows], layout.positions[:rows],
                        np.ascontiguousarray(layout.mask[:rows, :num_mask_words(rows)]))


def chain_layout(layout: VerifyLayout, nodes: np.ndarray) -> VerifyLayout:
    """The verify layout of the chain `nodes` (a path from the root, by depth), cut from the
    whole tree's: its rows' tokens and positions, and a path's mask (each row sees the ones
    before it), built once per length."""
    rows = np.concatenate([[0], nodes + 1])  # [k + 1] int64
    return VerifyLayout(layout.token_ids[rows], layout.positions[rows], _path_mask(len(rows)))


@functools.cache
def _path_mask(rows: int) -> np.ndarray:
    mask = ancestor_mask(np.arange(rows - 1, dtype=np.int32))  # [rows, W] uint32
    mask.flags.writeable = False  # shared by every chain of this length
    return mask


def realized(accepted_rows: Sequence[int], shape: Shape) -> int:
    """Accepted length the shape would have had: the verified path's leading nodes inside it
    (`accepted_rows`: verify rows of the accepted nodes, by depth, as `Acceptance.rows`)."""
    inside = set(shape.nodes.tolist())
    depth = 0
    for row in accepted_rows:
        if row - 1 not in inside:
            break
        depth += 1
    return depth


@dataclass(frozen=True)
class Curves:
    """Every candidate shape of one drafted tree at once (no per-shape walks): for k nodes, the
    first k nodes' and the best chain's expected length and depth. Host lists: the policy reads
    single entries."""

    prefix_expected: list[float]  # [n + 1] k = 0 … n
    prefix_depth: list[int]  # [n + 1]
    chain_nodes: np.ndarray  # [L] int64 the best path's node indices, by depth
    chain_expected: list[float]  # [L + 1]
    reach: list[int]  # [L] the prefix length holding the chain's first j + 1 nodes

    def expected(self, kind: str, k: int) -> float:
        table = self.prefix_expected if kind == TREE else self.chain_expected
        return table[k if k < len(table) else -1]

    def depth(self, kind: str, k: int) -> int:
        if kind == TREE:
            table = self.prefix_depth
            return table[k if k < len(table) else -1]
        return min(k, len(self.reach))

    def chain_inside(self, k: int) -> bool:
        """Whether the chain of `k` nodes lies inside the first `k` nodes: that prefix then
        accepts at least as much (a sub-tree accepts the verified path's part inside it)."""
        m = min(k, len(self.reach))
        return m == 0 or self.reach[m - 1] <= k


def curves(tree: DraftTree) -> Curves:
    """The Curves of a tree with scores (as `prefix` and `chain` give them one by one)."""
    p = np.exp(tree.scores.astype(np.float64)).tolist() if tree.n else []  # [n]
    path = _best_path(tree.parents.tolist(), tree.scores.tolist()) if tree.n else []
    return Curves([0.0, *itertools.accumulate(p)],
                  [0, *itertools.accumulate(tree.depths.tolist(), max)],
                  np.asarray(path, dtype=np.int64),
                  [0.0, *itertools.accumulate(p[j] for j in path)],
                  [j + 1 for j in itertools.accumulate(path, max)])


def realized_prefix(accepted: Sequence[int], k: int) -> int:
    """`realized` for the first k nodes; `accepted`: the accepted path's node indices."""
    depth = 0
    for node in accepted:
        if node >= k:
            break
        depth += 1
    return depth


def realized_chain(accepted: Sequence[int], path: np.ndarray, k: int) -> int:
    """`realized` for the chain's first k nodes (`path`: Curves.chain_nodes)."""
    depth = 0
    for node, on in zip(accepted, path[:k].tolist(), strict=False):
        if node != on:
            break
        depth += 1
    return depth
