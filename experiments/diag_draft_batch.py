"""A batched DFlash draft call whose requests have different block lengths (issue 9 diagnostic).

A request within a block of its max_tokens drafts a shorter block (`1 + min(block − 1,
max_depth)`). Until 2026-12-01 a call mixing lengths ran the drafter's whole block forward
eagerly; then `DFlashDrafter` replayed one CUDA graph per distinct length; since 2026-12-04 it
replays one, at the longest, the shorter blocks masked to their length. This script times one
draft call of `--batch` requests (each `--ctx` context rows, then one new row per call, as in
decode; chains) three ways, side by side: every block full ("uniform"), one request at depth
`--short-depth` ("mixed"), each with the drafter's graphs and eagerly (graphs=False), and reports
the largest difference between the two paths' logits (equal in fp32 on the CPU, as its test
checks; on a GPU in bf16 the graphs' fused layer kernels round differently).

    PYTHONPATH=.:bench python3 experiments/diag_draft_batch.py [--ctx 1024] [--batch 4]
        [--short-depth 4] [--out F]
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


def calls(drafter, a, depths, dev, dtype, steps: int) -> tuple[list[float], list]:
    """`steps` draft calls (one new context row per request each); ms per call, last logits."""
    cfg = drafter.model.config
    width, gen = cfg.num_taps * cfg.hidden_size, torch.Generator().manual_seed(1)
    ms, logits = [], None
    for _ in range(steps):
        reqs = []
        for i, depth in enumerate(depths):
            rid = f"r{i}"
            new = a.ctx if drafter.cache.length(rid) == 0 else 1
            ctx = torch.randn(new, width, generator=gen).to(dev, dtype)
            reqs.append(DraftRequest(rid, 7 + i, drafter.cache.length(rid) + new, 16, depth, ctx))
        t0 = time.perf_counter()
        logits = drafter.draft_logits(reqs)
        if dev == "cuda":
            torch.cuda.synchronize()
        ms.append((time.perf_counter() - t0) * 1e3)
    return ms, logits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--short-depth", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (smoke test)")
    ap.add_argument("--out", default=str(Path(os.environ.get("OUT", ".")) /
                                         "diag_draft_batch.json"))
    a = ap.parse_args()
    dev, dtype = ("cpu", torch.float32) if a.tiny else ("cuda", torch.bfloat16)
    _, dmodel = build_models(dict(TINY, num_layers=12) if a.tiny else QWEN3_8B, 5, dev, dtype)
    full = dmodel.config.block_size - 1
    mixes = {"uniform": [full] * a.batch, "mixed": [full] * (a.batch - 1) + [a.short_depth]}
    pages = a.batch * (-(-(a.ctx + 4 * a.steps + 64) // 16)) + 8
    res = dict(ctx=a.ctx, batch=a.batch, short_depth=a.short_depth, rows=[])
    for mix, depths in mixes.items():
        got = {}
        for mode in ("graphs", "eager"):
            drafter = DFlashDrafter(dmodel, pages, 16, tree=False, graphs=mode == "graphs",
                                    capture=None if not a.tiny else False)
            warm_up_drafter(drafter, min(300, a.ctx))
            ms, got[mode] = calls(drafter, a, depths, dev, dtype, a.steps)
            row = dict(mix=mix, mode=mode, median_ms=statistics.median(ms[2:]), ms=ms,
                       graphs=sorted(drafter.graphs._graphs) if drafter.graphs else None)
            res["rows"].append(row)
            print(f"{mix:8s} {mode:6s}: {row['median_ms']:.3f} ms per draft call", flush=True)
        diff = max(float((g - e).abs().max()) for g, e in zip(got["graphs"], got["eager"],
                                                              strict=True))
        res["rows"][-1]["max_diff_vs_graphs"] = diff
        print(f"{mix:8s} max |graphs − eager| logits: {diff:.2e}", flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
