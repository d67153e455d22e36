"""The draft tree data type and its flattened verify layout.

Owns `DraftTree` (draft nodes below the root, in topological order), the verify layout the target
forward consumes (tokens, depth positions, packed ancestor-only mask) and the child maps the
acceptance walk follows. It does not build trees (spec/ddtree.py, drafters/*) and does not run
attention or acceptance; it is pure numpy on the host.

Verify rows: row 0 is the root (the bonus token of the previous round), row i + 1 is node i.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MAX_BUDGET = 1024  # the most draft nodes (excluding the root) any tree builder may emit
MASK_WORD_BITS = 32  # bits per packed mask word (uint32)


def check_budget(budget: int) -> None:
    """Raise ValueError unless 0 <= budget <= MAX_BUDGET (shared by every tree builder)."""
    if isinstance(budget, bool) or not isinstance(budget, int | np.integer):
        raise ValueError(f"budget must be an int, got {type(budget).__name__}")
    if not 0 <= budget <= MAX_BUDGET:
        raise ValueError(f"budget must be in [0, {MAX_BUDGET}], got {budget}")


def _check_array(name: str, arr: object, dtype: type) -> None:
    if not isinstance(arr, np.ndarray):
        raise ValueError(f"{name} must be a numpy array, got {type(arr).__name__}")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.dtype != dtype:
        raise ValueError(f"{name} must be {np.dtype(dtype).name}, got {arr.dtype}")


@dataclass(frozen=True)
class DraftTree:
    """Draft nodes below the root, in topological order (each parent before its children).

    Verify rows: row 0 is the root (the bonus token), row i+1 is node i.
    """

    token_ids: np.ndarray  # [n] int64 node tokens
    parents: np.ndarray  # [n] int32 verify-row index of each node's parent: 0 = root, j+1 = node j
    depths: np.ndarray  # [n] int32 depth of each node; children of the root have depth 1
    # [n] float32 the drafter's log-probability of each node's path (None: the drafter has no
    # probabilities, e.g. n-gram); DDTree emits nodes best first, so these never increase
    scores: np.ndarray | None = None

    def __post_init__(self) -> None:
        _check_array("token_ids", self.token_ids, np.int64)
        _check_array("parents", self.parents, np.int32)
        _check_array("depths", self.depths, np.int32)
        n = self.token_ids.shape[0]
        if self.parents.shape[0] != n or self.depths.shape[0] != n:
            raise ValueError(
                f"token_ids, parents, depths must have equal lengths, got "
                f"{n}, {self.parents.shape[0]}, {self.depths.shape[0]}"
            )
        if self.scores is not None:
            _check_array("scores", self.scores, np.float32)
            if self.scores.shape[0] != n:
                raise ValueError(f"scores must have length {n}, got {self.scores.shape[0]}")
            if n and not (np.all(self.scores <= 0) and np.all(np.isfinite(self.scores))):
                raise ValueError("scores must be finite log-probabilities (<= 0)")
        if n == 0:
            return
        if np.any(self.token_ids < 0):
            raise ValueError("token_ids must be non-negative")
        rows = np.arange(n, dtype=np.int64)  # [n] node index i (its own verify row is i + 1)
        if np.any(self.parents < 0) or np.any(self.parents > rows):
            raise ValueError("parents[i] must be in [0, i] (a parent precedes its child)")
        row_depths = np.concatenate([[0], self.depths.astype(np.int64)])  # [n+1] int64, root = 0
        if np.any(self.depths != row_depths[self.parents] + 1):
            raise ValueError("depths[i] must equal the depth of its parent + 1 (root depth is 0)")
        if int(self.token_ids.max()) >= 1 << 32:
            raise ValueError("token_ids must be below 2**32")
        keys = np.sort((self.parents.astype(np.int64) << 32) | self.token_ids)  # [n] (parent, tok)
        # one sort, not np.unique(axis=0): cheaper (BENCHMARKS.md, "Figures formerly in source
        # comments")
        if np.any(keys[1:] == keys[:-1]):
            raise ValueError("siblings must carry distinct token_ids")

    @classmethod
    def empty(cls) -> DraftTree:
        """A root-only tree: verifying it is a plain autoregressive step."""
        return cls(
            token_ids=np.zeros(0, dtype=np.int64),
            parents=np.zeros(0, dtype=np.int32),
            depths=np.zeros(0, dtype=np.int32),
        )

    @classmethod
    def unchecked(cls, token_ids, parents, depths, scores=None) -> DraftTree:
        """A tree cut from a checked one (a prefix, a path): its invariants hold by
        construction, so the per-step policy does not pay for checking them again."""
        tree = object.__new__(cls)
        for name, value in (("token_ids", token_ids), ("parents", parents),
                            ("depths", depths), ("scores", scores)):
            object.__setattr__(tree, name, value)
        return tree

    @property
    def n(self) -> int:
        """Number of draft nodes (the root excluded)."""
        return int(self.token_ids.shape[0])

    @property
    def max_depth(self) -> int:
        """Depth of the deepest node; 0 for a root-only tree."""
        return int(self.depths.max()) if self.n else 0


def chain_tree(token_ids: Sequence[int] | np.ndarray,
               scores: np.ndarray | None = None) -> DraftTree:
    """A chain: node 0 is a child of the root, node i a child of node i - 1; `scores` [n]
    float32: each node's path log-probability (None: unscored)."""
    tokens = np.asarray(token_ids, dtype=np.int64).reshape(-1)  # [n] int64
    n = tokens.shape[0]
    return DraftTree(
        token_ids=tokens,
        parents=np.arange(n, dtype=np.int32),  # [n] int32 node i's parent row is i
        depths=np.arange(1, n + 1, dtype=np.int32),  # [n] int32
        scores=scores,
    )


def check_trees(sizes: Sequence[int], token_ids: np.ndarray, parents: np.ndarray,
                depths: np.ndarray, scores: np.ndarray | None = None) -> list[DraftTree | str]:
    """Trees laid end to end (tree j: `sizes[j]` nodes; flat int64 / int32 / int32 / float32 or
    None arrays) checked all at once: each a `DraftTree` of views into them, or why it is not
    one (DraftTree's own message, from that tree alone). One check for a drafter reply's trees
    instead of one per tree (a batch-8 reply's conversion on the verifier was mostly its
    per-tree checks); two trees or fewer are checked one by one, which costs less than the
    pass (BENCHMARKS.md, "The verifier reads a reply's trees in one pass")."""
    total = sum(int(n) for n in sizes)
    for name, arr, dtype in (("token_ids", token_ids, np.int64), ("parents", parents, np.int32),
                             ("depths", depths, np.int32)) + (
                                 (("scores", scores, np.float32),) if scores is not None else ()):
        _check_array(name, arr, dtype)
        if arr.shape[0] != total:
            raise ValueError(f"{name} must hold {total} nodes, got {arr.shape[0]}")
    ends = np.cumsum(np.asarray(sizes, dtype=np.int64))  # [T]
    starts = ends - np.asarray(sizes, dtype=np.int64)  # [T]
    few = len(ends) <= 2  # each checked alone, in Python: less than the pass's fixed cost
    failed = None if few else _failed_trees(sizes, starts, token_ids, parents, depths, scores)
    out: list[DraftTree | str] = []
    for j, (a, b) in enumerate(zip(starts.tolist(), ends.tolist(), strict=True)):
        parts = (token_ids[a:b], parents[a:b], depths[a:b],
                 None if scores is None else scores[a:b])
        bad = not _valid_alone(*parts) if few else failed[j]
        out.append(_checked(*parts) if bad else DraftTree.unchecked(*parts))
    return out


def _valid_alone(token_ids, parents, depths, scores) -> bool:
    """Whether one tree (checked-dtype 1-D arrays) holds DraftTree's invariants, node by node
    over host lists: for a step's tree or two, cheaper than DraftTree's numpy checks."""
    row_depths, seen = [0], set()  # depth by verify row (the root's is 0); (parent, token)
    for i, (tok, par, dep) in enumerate(zip(token_ids.tolist(), parents.tolist(),
                                            depths.tolist(), strict=True)):
        if not (0 <= tok < 1 << 32 and 0 <= par <= i and dep == row_depths[par] + 1
                and (par, tok) not in seen):
            return False
        row_depths.append(dep)
        seen.add((par, tok))
    return scores is None or all(math.isfinite(x) and x <= 0 for x in scores.tolist())


def _failed_trees(sizes, starts, token_ids, parents, depths, scores) -> np.ndarray:  # [T] bool
    """Which trees break any of DraftTree's invariants, every node checked in one pass."""
    tree_of = np.repeat(np.arange(len(starts)), sizes)  # [N] each node's tree
    first = starts[tree_of]  # [N] its tree's first node
    tok, par, dep = token_ids, parents.astype(np.int64), depths.astype(np.int64)  # [N] each
    bad = (tok < 0) | (tok >= 1 << 32) | (par < 0) | (par > np.arange(len(tok)) - first)
    up = np.clip(first + par - 1, 0, max(len(tok) - 1, 0))  # [N] the parent node (par > 0)
    bad |= dep != np.where(par > 0, dep[up], 0) + 1
    if scores is not None:
        bad |= ~(np.isfinite(scores) & (scores <= 0))
    order = np.lexsort((tok, par, tree_of))  # siblings with one token: adjacent
    same = ((np.diff(tree_of[order]) == 0) & (np.diff(par[order]) == 0)
            & (np.diff(tok[order]) == 0))
    bad[order[1:][same]] = True
    return np.bincount(tree_of[bad], minlength=len(starts)) > 0


def _checked(*parts) -> DraftTree | str:
    try:
        return DraftTree(*parts)
    except ValueError as e:
        return str(e)


def num_mask_words(num_rows: int) -> int:
    """Packed uint32 words per mask row for `num_rows` verify rows."""
    return (num_rows + MASK_WORD_BITS - 1) // MASK_WORD_BITS


@dataclass(frozen=True)
class VerifyLayout:
    """A draft tree flattened for one target forward: root row first, then nodes in tree order.

    Bit (j % 32) of word (j // 32) of mask row i is set iff row j is row i or an ancestor of it.
    """

    token_ids: np.ndarray  # [n+1] int64 root (bonus) token then node tokens
    positions: np.ndarray  # [n+1] int64 start + depth; the root sits at start
    mask: np.ndarray  # [n+1, W] uint32 packed ancestor-or-self bits, W = ceil((n+1)/32)

    def __post_init__(self) -> None:
        rows = self.token_ids.shape[0]
        if self.token_ids.ndim != 1 or rows == 0:
            raise ValueError(f"token_ids must be 1-D and non-empty, got {self.token_ids.shape}")
        if self.positions.shape != (rows,):
            raise ValueError(f"positions must have shape ({rows},), got {self.positions.shape}")
        if self.mask.shape != (rows, num_mask_words(rows)) or self.mask.dtype != np.uint32:
            raise ValueError(
                f"mask must be uint32 [{rows}, {num_mask_words(rows)}], "
                f"got {self.mask.dtype} {self.mask.shape}"
            )

    @property
    def num_rows(self) -> int:
        """Verify rows = draft nodes + 1 (the root)."""
        return int(self.token_ids.shape[0])


def ancestor_mask(parents: np.ndarray) -> np.ndarray:
    """Packed ancestor-or-self mask [n+1, W] uint32 from node parent rows [n] int32."""
    rows = parents.shape[0] + 1
    if rows == 1:  # root only: a plain step
        return np.ones((1, 1), dtype=np.uint32)
    mask = np.zeros((rows, num_mask_words(rows)), dtype=np.uint32)  # [n+1, W] uint32
    r = np.arange(rows)  # [n+1] int64
    mask[r, r // MASK_WORD_BITS] = np.left_shift(1, r % MASK_WORD_BITS).astype(np.uint32)
    # pointer jumping: after t rounds each row holds its ancestors up to 2^t - 1 levels up
    # (log2(depth) whole-array rounds, not one Python step per row)
    up = np.concatenate([[0], parents.astype(np.int64)])  # [n+1] int64, the root its own
    while True:
        mask |= mask[up]
        if not up.any():
            return mask
        up = up[up]


def verify_layout(tree: DraftTree, root_token_id: int, start: int) -> VerifyLayout:
    """Flatten `tree` under root token `root_token_id` at absolute position `start`.

    Raises:
        ValueError: root_token_id or start is negative.
    """
    if root_token_id < 0:
        raise ValueError(f"root_token_id must be non-negative, got {root_token_id}")
    if start < 0:
        raise ValueError(f"start must be non-negative, got {start}")
    token_ids = np.concatenate([np.array([root_token_id], dtype=np.int64), tree.token_ids])
    depths = np.concatenate([[0], tree.depths.astype(np.int64)])  # [n+1] int64
    return VerifyLayout(
        token_ids=token_ids,  # [n+1] int64
        positions=start + depths,  # [n+1] int64
        mask=ancestor_mask(tree.parents),  # [n+1, W] uint32
    )


def child_rows(tree: DraftTree) -> list[dict[int, int]]:
    """For each verify row, map child token id -> the child's verify row (the acceptance walk)."""
    children: list[dict[int, int]] = [{} for _ in range(tree.n + 1)]
    pairs = zip(tree.parents.tolist(), tree.token_ids.tolist(), strict=True)
    for node, (parent, token) in enumerate(pairs):
        children[parent][token] = node + 1
    return children


def mask_to_dense(mask: np.ndarray, num_rows: int) -> np.ndarray:
    """Unpack the first `num_rows` rows/columns of a packed mask into [rows, rows] bool."""
    if mask.ndim != 2 or mask.shape[0] < num_rows or mask.shape[1] < num_mask_words(num_rows):
        raise ValueError(f"mask {mask.shape} too small for {num_rows} rows")
    cols = np.arange(num_rows)  # [rows] int64
    words = mask[:num_rows, cols // MASK_WORD_BITS].astype(np.uint32)  # [rows, rows] uint32
    shifts = (cols % MASK_WORD_BITS).astype(np.uint32)  # [rows] uint32
    return ((words >> shifts) & np.uint32(1)).astype(bool)  # [rows, rows] bool
