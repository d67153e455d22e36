"""DDTree: the optimal draft tree under a factorised drafter (paper Algorithm 1).

Owns the per-depth top-k log-probs (one top-k on the drafter's device, kernels/topk; one host
copy) and the best-first heap that picks the `budget` most probable prefixes. Given per-depth
marginals q_1..q_L, the tree maximising E_Q[accepted length] = sum of q(prefix) over its nodes
is the set of the B most probable prefixes, which is prefix-closed; the heap enumerates it in
O(B log B) by pushing, for each popped node, only its next sibling and its first child. It does
not verify or walk trees (spec/tree.py holds the layout; acceptance lives elsewhere).
"""

from __future__ import annotations

import heapq
import time

import numpy as np
import torch

from specserve.kernels.topk import topk_logprobs_device
from specserve.spec.tree import DraftTree, check_budget


def topk_logprobs(draft_logits: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-depth top-k log-probs of raw draft logits, computed in float32 on their device.

    Args:
        draft_logits: [L, V] any float dtype, any device; raw logits (no temperature).
        k: tokens kept per depth, 1 <= k <= V (callers pass min(budget, V)).

    Returns:
        logprobs [L, K] float32 and token_ids [L, K] int64 on the host, sorted descending.
    """
    if draft_logits.ndim != 2 or not draft_logits.is_floating_point():
        raise ValueError(f"draft_logits must be a 2-D float tensor, got {draft_logits.shape}")
    vocab = draft_logits.shape[1]
    if not 1 <= k <= vocab:
        raise ValueError(f"k must be in [1, {vocab}], got {k}")
    return unpack_tables(pack_tables(draft_logits, k).cpu().numpy(), k)


def pack_tables(draft_logits: torch.Tensor, k: int) -> torch.Tensor:  # [L, 2K] int32
    """`topk_logprobs`' device part: the tables packed for one host copy — the float32
    log-probs bit-cast to int32 beside the ids (vocab ids < 2**31), so the round trip costs a
    single sync instead of two. Capturable in a CUDA graph (drafters/dflash_graphs.py)."""
    top_lp, top_ids = topk_logprobs_device(draft_logits.float(), k)  # [L, K] float32, int64
    return torch.cat([top_lp.view(torch.int32), top_ids.to(torch.int32)], dim=1)


def unpack_tables(host: np.ndarray, k: int, cols: int | None = None
                  ) -> tuple[np.ndarray, np.ndarray]:
    """`pack_tables`' rows `[L, 2k]` int32 on the host → their first `cols` (None: k) columns:
    log-probs `[L, cols]` float32 and ids `[L, cols]` int64 (the tables are sorted, so these are
    the top `cols`)."""
    cols = k if cols is None else cols
    logprobs = np.ascontiguousarray(host[:, :cols]).view(np.float32)  # [L, cols] float32
    return logprobs, host[:, k : k + cols].astype(np.int64)


def _check_tables(logprobs: np.ndarray, token_ids: np.ndarray) -> None:
    if logprobs.ndim != 2 or logprobs.shape != token_ids.shape:
        raise ValueError(
            f"logprobs and token_ids must both be [L, K], got {logprobs.shape}, {token_ids.shape}"
        )


def build_ddtree(
    logprobs: np.ndarray,
    token_ids: np.ndarray,
    budget: int,
    max_depth: int | None = None,
) -> DraftTree:
    """Best-first DDTree over per-depth top-K tables (Algorithm 1).

    Args:
        logprobs: [L, K] float per-depth log-probs, sorted descending along K.
        token_ids: [L, K] int the tokens of those log-probs.
        budget: draft nodes to emit (root excluded), 0 <= budget <= MAX_BUDGET.
        max_depth: deepest depth allowed, 0 <= max_depth <= L; None means L.

    Returns:
        A DraftTree of min(budget, reachable prefixes) nodes in heap-pop order, which is
        topological. Ties in path log-prob go to the entry pushed first. Built unchecked: the
        heap makes every parent precede its child one depth up and siblings take distinct ranks
        of a top-k row (checking cost half the build, a drafter builds one per request a step).

    Raises:
        ValueError: bad budget, max_depth or table shapes.
    """
    check_budget(budget)
    _check_tables(logprobs, token_ids)
    num_depths, k = logprobs.shape
    depth_cap = num_depths if max_depth is None else max_depth
    if not 0 <= depth_cap <= num_depths:
        raise ValueError(f"max_depth must be in [0, {num_depths}], got {max_depth}")
    if budget == 0 or depth_cap == 0 or k == 0:
        return DraftTree.empty()
    tokens, parents, depths, scores = _best_first(logprobs, token_ids, budget, depth_cap)
    return DraftTree.unchecked(
        token_ids=np.asarray(tokens, dtype=np.int64),  # [n] int64
        parents=np.asarray(parents, dtype=np.int32),  # [n] int32
        depths=np.asarray(depths, dtype=np.int32),  # [n] int32
        scores=np.minimum(np.asarray(scores, dtype=np.float32), 0),  # [n] float32 path lp
    )


def _best_first(
    logprobs: np.ndarray, token_ids: np.ndarray, budget: int, depth_cap: int
) -> tuple[list[int], list[int], list[int], list[float]]:
    """The heap loop of Algorithm 1; returns node tokens, parent rows, depths and path
    log-probs in pop order."""
    k = logprobs.shape[1]
    lp = logprobs.astype(np.float64).tolist()  # [L][K] python floats: the heap loop is scalar
    ids = token_ids.tolist()  # [L][K] python ints
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    scores: list[float] = []
    # Entry: (-path logprob, push order, parent row, parent path logprob, depth, rank). Scores
    # are recomputed from the parent's path logprob, never by subtracting, so siblings stay exact.
    heap = [(-lp[0][0], 0, 0, 0.0, 1, 0)]
    pushes = 1
    while heap and len(tokens) < budget:
        _, _, parent, parent_lp, depth, rank = heapq.heappop(heap)
        tokens.append(ids[depth - 1][rank])
        parents.append(parent)
        depths.append(depth)
        row = len(tokens)  # verify row of the node just added
        path_lp = parent_lp + lp[depth - 1][rank]
        scores.append(path_lp)
        if rank + 1 < k:  # next sibling: same parent, next rank at this depth
            sibling_lp = parent_lp + lp[depth - 1][rank + 1]
            heapq.heappush(heap, (-sibling_lp, pushes, parent, parent_lp, depth, rank + 1))
            pushes += 1
        if depth < depth_cap:  # first child: best token one depth further
            child_lp = path_lp + lp[depth][0]
            heapq.heappush(heap, (-child_lp, pushes, row, path_lp, depth + 1, 0))
            pushes += 1
    return tokens, parents, depths, scores


def build_ddtree_timed(
    draft_logits: torch.Tensor, budget: int, max_depth: int | None = None
) -> tuple[DraftTree, float]:
    """Top-k (K = min(budget, V)) then heap build; returns the tree and the host heap time (s).

    Args:
        draft_logits: [L, V] raw draft logits for block slots 1..L, any float dtype and device.
        budget: draft nodes (root excluded), 0 <= budget <= MAX_BUDGET.
        max_depth: deepest depth allowed; None means L.

    Returns:
        (tree, build_time_s) where build_time_s covers build_ddtree only, not the top-k or copy.
    """
    check_budget(budget)
    if budget == 0:
        return DraftTree.empty(), 0.0
    logprobs, token_ids = topk_logprobs(draft_logits, min(budget, draft_logits.shape[-1]))
    t0 = time.perf_counter()
    tree = build_ddtree(logprobs, token_ids, budget, max_depth)
    return tree, time.perf_counter() - t0
