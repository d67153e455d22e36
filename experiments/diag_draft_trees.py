"""Where a DFlash draft call's tree build goes, by batch size (issue 23 diagnostic).

Builds the random Qwen3-8B-shape DFlash drafter (5 layers; `--tiny`: tiny shapes on the CPU),
warms its graphs, gives `--batch` requests `--ctx` context rows each, then per batch size times
`--steps` draft calls (one new context row per request each, budget `--budget`): the call's
forward and tree seconds from `DFlashDrafter.last_stats`, and on the last call's logits, side by
side: the call's trees as the drafter builds them (one top-k and one copy for the call;
again with the top-k on torch's formula instead of kernels/topk), a top-k and a copy per
request (the code before 2026-12-04), and the pieces (the concatenation, the top-k + copy, the
heaps). Medians in ms; writes JSON.

    PYTHONPATH=.:bench python3 experiments/diag_draft_trees.py [--batches 1,8] [--out F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from _e2e_common import QWEN3_8B, TINY, build_models

from specserve.drafters.base import DraftRequest
from specserve.drafters.dflash import DFlashDrafter
from specserve.engine.warmup import warm_up_drafter
from specserve.kernels import topk
from specserve.spec.ddtree import build_ddtree, topk_logprobs


def timed(fn, dev: str, reps: int) -> float:
    """Median ms of `fn()` over `reps` calls, synchronised."""
    ms = []
    for _ in range(reps):
        if dev == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if dev == "cuda":
            torch.cuda.synchronize()
        ms.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ms)


def torch_topk(fn):
    """`fn()` with the top-k on torch's formula however many rows (kernels/topk's MIN_ROWS)."""
    saved, topk.MIN_ROWS = topk.MIN_ROWS, 1 << 62
    try:
        return fn()
    finally:
        topk.MIN_ROWS = saved


def run_batch(drafter, a, batch: int, dev, dtype) -> dict:
    cfg = drafter.model.config
    width, gen = cfg.num_taps * cfg.hidden_size, torch.Generator().manual_seed(batch)
    fwd, tree, logits, reqs = [], [], None, []
    for _ in range(a.steps):
        reqs = []
        for i in range(batch):
            rid = f"b{batch}r{i}"
            new = a.ctx if drafter.cache.length(rid) == 0 else 1
            ctx = torch.randn(new, width, generator=gen).to(dev, dtype)
            reqs.append(DraftRequest(rid, 7 + i, drafter.cache.length(rid) + new, a.budget, 99,
                                     ctx))
        drafter.draft(reqs)
        fwd.append(drafter.last_stats.forward_s * 1e3)
        tree.append(drafter.last_stats.tree_s * 1e3)
    logits = [lg.clone() for lg in drafter.draft_logits(
        [DraftRequest(r.request_id, r.bonus_token, r.start, a.budget, 99, None) for r in reqs])]
    k = min(a.budget, logits[0].shape[1])
    tables = [topk_logprobs(lg, k) for lg in logits]
    row = dict(batch=batch, forward_ms=statistics.median(fwd[2:]),
               tree_ms=statistics.median(tree[2:]),
               trees_call_ms=timed(lambda: drafter._trees(reqs, logits), dev, a.reps),
               trees_call_torch_ms=torch_topk(lambda: timed(lambda: drafter._trees(reqs, logits),
                                                            dev, a.reps)),
               trees_per_request_ms=timed(lambda: [build_ddtree(*topk_logprobs(lg, k), a.budget)
                                                   for lg in logits], dev, a.reps),
               cat_ms=timed(lambda: torch.cat(logits), dev, a.reps),
               topk_copy_ms=timed(lambda: topk_logprobs(torch.cat(logits), k), dev, a.reps),
               heaps_ms=timed(lambda: [build_ddtree(lp, ids, a.budget) for lp, ids in tables],
                              dev, a.reps))
    for r in reqs:
        drafter.release(r.request_id)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--budget", type=int, default=15)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (smoke test)")
    ap.add_argument("--out", default=str(Path(os.environ.get("OUT", ".")) /
                                         "diag_draft_trees.json"))
    a = ap.parse_args()
    dev, dtype = ("cpu", torch.float32) if a.tiny else ("cuda", torch.bfloat16)
    _, dmodel = build_models(dict(TINY, num_layers=12) if a.tiny else QWEN3_8B, 5, dev, dtype)
    batches = [int(b) for b in a.batches.split(",")]
    pages = max(batches) * (-(-(a.ctx + a.steps + 64) // 16)) * 2 + 8
    drafter = DFlashDrafter(dmodel, pages, 16, capture=None if not a.tiny else False)
    warm_up_drafter(drafter, min(300, a.ctx), max_batch=max(batches))
    res = dict(ctx=a.ctx, budget=a.budget, device=dev, rows=[])
    for batch in batches:
        row = run_batch(drafter, a, batch, dev, dtype)
        res["rows"].append(row)
        print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                       for k, v in row.items()), flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
