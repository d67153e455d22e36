"""The DDTree build vectorised with numpy, per request and for a batch of 8, against the heap.

spec/ddtree.py builds each request's tree with a pure-Python heap (≈ 1 µs a node). The best-B
prefixes can also be found depth by depth: extend the kept nodes of depth d − 1 by the K
tokens of depth d, keep the best B (argpartition), drop what is below the B-th best score so
far, then take the best B of all depths by (−score, depth) — parents sort before their
children, so the set is prefix-closed and, without ties, the heap's own set and order. This
times both on tables drawn from softmaxes of three temperatures (flat to peaked: the
trees wide and shallow to deep), checks each vectorised tree equals the heap's, and prints µs
per tree (per request) and per batch of 8 (one vectorised call for the 8 rows).

    PYTHONPATH=. python experiments/ddtree_vectorized.py [--out ddtree_vectorized.json]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from specserve.spec.ddtree import build_ddtree

NEG = -np.inf


def _kth(scores: np.ndarray, budgets: np.ndarray) -> np.ndarray:
    """Each row's budget-th best score so far ([R]; −inf while fewer nodes are kept)."""
    desc = -np.sort(-scores, axis=1)  # [R, T]
    at = np.minimum(budgets - 1, desc.shape[1] - 1)
    return np.where(budgets <= desc.shape[1], desc[np.arange(len(budgets)), at], NEG)


def _depths(lp: np.ndarray, budgets: np.ndarray, cap: int):
    """Per depth: kept scores [R, n_d], parent index into depth d − 1's kept [R, n_d], rank."""
    rows, (R, _, K) = np.arange(lp.shape[0])[:, None], lp.shape
    bmax = int(budgets.max())
    s = lp[:, 0, : min(K, bmax)]  # [R, n_0]
    kept = [(s, np.full(s.shape, -1), np.broadcast_to(np.arange(s.shape[1]), s.shape))]
    every, floor = s, _kth(s, budgets)
    for d in range(1, cap):
        cand = (s[:, :, None] + lp[:, d, None, :]).reshape(R, -1)  # [R, n · K]
        idx = (np.argpartition(-cand, bmax - 1, axis=1)[:, :bmax] if cand.shape[1] > bmax
               else np.broadcast_to(np.arange(cand.shape[1]), cand.shape))
        s = np.where(cand[rows, idx] >= floor[:, None], cand[rows, idx], NEG)  # [R, ≤ bmax]
        if not np.isfinite(s).any():
            break
        kept.append((s, idx // K, idx % K))
        every = np.concatenate([every, s], axis=1)
        floor = _kth(every, budgets)
    return kept, every


def build_batch(lp: np.ndarray, ids: np.ndarray, budgets: np.ndarray) -> list[tuple]:
    """Trees of R requests at once from tables lp / ids [R, L, K]: (tokens, parents, depths)."""
    kept, score = _depths(lp.astype(np.float64), budgets, lp.shape[1])
    sizes = [k[0].shape[1] for k in kept]
    offs = np.cumsum([0] + sizes)
    depth = np.repeat(np.arange(1, len(kept) + 1), sizes)  # [T]
    gpar = np.concatenate([kept[0][1]] + [offs[d - 1] + kept[d][1] for d in range(1, len(kept))],
                          axis=1)  # [R, T] index of the parent, −1 at depth 1
    rank = np.concatenate([k[2] for k in kept], axis=1)  # [R, T]
    order = np.lexsort((np.broadcast_to(depth, score.shape), -score), axis=1)  # [R, T]
    row = np.empty_like(order)
    np.put_along_axis(row, order, np.arange(1, order.shape[1] + 1)[None].repeat(len(lp), 0), 1)
    trees = []
    for r, n in enumerate(np.minimum(budgets, np.isfinite(score).sum(1))):
        o = order[r, :n]
        parents = np.where(gpar[r, o] < 0, 0, row[r, np.maximum(gpar[r, o], 0)])
        trees.append((ids[r, depth[o] - 1, rank[r, o]], parents, depth[o]))
    return trees


def tables(rng, temp: float, budget: int, rows: int, depth: int = 16, vocab: int = 5000):
    """Sorted top-`budget` log-prob tables [rows, depth, budget] of random softmaxes."""
    logits = rng.standard_normal((rows, depth, vocab)) / temp
    lp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    ids = np.argsort(-lp, axis=-1)[..., :budget]
    return np.take_along_axis(lp, ids, -1).astype(np.float32), ids


def timed(fn, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e6


def times(lp: np.ndarray, ids: np.ndarray, budgets: np.ndarray, reps: int) -> dict:
    """µs per tree (request 0 alone) and per batch of all rows, heap and vectorised."""
    budget = int(budgets[0])
    return {"heap_us": timed(lambda: build_ddtree(lp[0], ids[0], budget), reps),
            "vec_us": timed(lambda: build_batch(lp[:1], ids[:1], budgets[:1]), reps),
            "heap8_us": timed(lambda: [build_ddtree(lp[r], ids[r], budget)
                                       for r in range(len(lp))], reps),
            "vec8_us": timed(lambda: build_batch(lp, ids, budgets), reps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rng, out = np.random.default_rng(0), []
    print("text (temp)      B  deepest  same  heap µs/tree  vec µs/tree  heap ×8 µs  vec ×8 µs")
    for text, temp in [("flat", 3.0), ("middle", 1.0), ("peaked", 0.3)]:
        for budget in (15, 31, 63):
            lp, ids = tables(rng, temp, budget, 8)
            budgets = np.full(8, budget)
            heap = [build_ddtree(lp[r], ids[r], budget) for r in range(8)]
            vec = build_batch(lp, ids, budgets)
            same = all(np.array_equal(h.token_ids, v[0]) and np.array_equal(h.parents, v[1])
                       for h, v in zip(heap, vec, strict=True))
            one = build_batch(lp[:1], ids[:1], budgets[:1])
            assert np.array_equal(one[0][0], heap[0].token_ids)
            row = {"text": text, "budget": budget, "same": same,
                   "deepest": int(max(h.depths.max() for h in heap)),
                   **times(lp, ids, budgets, args.reps)}
            out.append(row)
            print(f"{text:<8} ({temp})  {budget:3d}  {row['deepest']:7d}  {str(same):<5} "
                  f"{row['heap_us']:12.0f}  {row['vec_us']:11.0f}  {row['heap8_us']:10.0f}  "
                  f"{row['vec8_us']:9.0f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
