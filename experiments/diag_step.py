"""Where the GPU time of one verify / decode forward goes, kernel by kernel, next to its floor.

The issue-9 verify step at 1k context, budget 64, replays a CUDA graph in 7.8 ms against a 3.9 ms
weights floor while its attention is a few µs per layer: the rest is GEMMs below the copy rate
and the small per-layer kernels (norms, RoPE, KV write, SiLU·mul, residual adds). This script
measures, on the random Qwen3-8B-shape target (bf16, page 16):

  [1] per (ctx, rows): the model forward + logits + argmax captured in a CUDA graph (replay ms)
      and, from torch.profiler over eager runs, every kernel's GPU time grouped into classes
      (gemm, attention, combine, norm, rope, kv write, elementwise, other) with counts per
      layer; GEMMs also by shape with achieved GB/s of their weight bytes. "gaps" = graph replay
      minus the sum of kernel times (launch gaps the graph does not hide).
  [2] per GEMM shape of the layer: F.linear alone at M = rows over rotated weight copies
      (> L2), replayed from a CUDA graph, as a fraction of the copy rate measured in the same
      run. (The first run, experiments/results/diag_step_h200_run1.json, timed these eagerly: its
      "gemms" entries are host-bound — 30-35 µs for every small GEMM — and not valid.)

    PYTHONPATH=.:bench python3 experiments/diag_step.py [--ctxs 1024,32768] [--rows 1,17,65]
        [--out $OUT/diag_step.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
from functools import partial
from pathlib import Path

import numpy as np
import torch
from _e2e_common import ceilings
from _e2e_verify import random_tree
from diag_kernel import _graph_us
from profile_step import build_target, make_runner

from specserve.attention.base import AttnBatch
from specserve.spec.tree import DraftTree, verify_layout

CLASSES = [("attention", r"tree_attn"), ("combine", r"combine"), ("gemm", r"gemm|sm90_|cutlass|"
           r"nvjet|cublas|xmma|splitK"), ("norm", r"rms_norm|RMSNorm|rsqrt"),
           ("kv_write", r"index_put|scatter"), ("rope", r"roll|cat_|CatArray"),
           ("reduce", r"reduce|argmax|max_kernel")]


def klass(name: str) -> str:
    for cls, pat in CLASSES:
        if re.search(pat, name, re.I):
            return cls
    return "elementwise/other"


def kernel_times(fn, n: int = 3) -> dict[str, list[float]]:
    """GPU µs per kernel name per call of `fn` (torch.profiler, eager)."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    out: dict[str, list[float]] = collections.defaultdict(list)
    for e in prof.events():
        if str(getattr(e, "device_type", "")).endswith("CUDA"):
            out[e.name].append(float(e.time_range.elapsed_us()) / n)
    return out


def graph_ms(fn) -> float:
    """GPU ms of `fn` replayed from a CUDA graph (diag_kernel's harness)."""
    return _graph_us([fn], 1, torch) / 1e3


def step_breakdown(model, kv, table, ctx: int, rows: int, layers: int, copy_gbps: float) -> dict:
    vocab = model.config.vocab_size
    rng = np.random.default_rng(ctx + rows)
    tree = random_tree(rows - 1, vocab, rng) if rows > 1 else DraftTree.empty()
    lay = verify_layout(tree, int(rng.integers(vocab)), ctx)
    batch = AttnBatch.build([rows], [ctx], [table], lay.positions, 16, [lay.mask], "cuda")
    ids = torch.as_tensor(lay.token_ids, device="cuda")

    def step():
        return model.logits(model(ids, batch, kv)[0]).argmax(-1)

    with torch.inference_mode():
        g = graph_ms(step)
        kt = kernel_times(step)
    by_class: dict[str, float] = collections.Counter()
    count: dict[str, int] = collections.Counter()
    for name, ts in kt.items():
        by_class[klass(name)] += sum(ts)
        count[klass(name)] += len(ts)
    total = sum(by_class.values()) / 1e3
    top = sorted(((sum(ts), len(ts), name) for name, ts in kt.items()), reverse=True)[:14]
    return dict(ctx=ctx, rows=rows, graph_ms=g, kernels_ms=total, gaps_ms=g - total,
                by_class_ms={k: v / 1e3 for k, v in sorted(by_class.items())},
                per_layer_launches={k: v / layers for k, v in sorted(count.items())},
                top=[dict(us=us, n=n, name=name[:110]) for us, n, name in top],
                copy_GBps=copy_gbps)


def gemm_alone(model, rows: int, copy_gbps: float) -> list[dict]:
    """Each distinct layer GEMM at M = rows, alone, weights rotated beyond L2."""
    import torch.nn.functional as F
    layer, fused = model.model.layers[0], model._fused[0]
    shapes = {"qkv": fused.qkv_w, "o": layer.self_attn.o_proj.weight,
              "gate_up": fused.gate_up_w, "down": layer.mlp.down_proj.weight,
              "lm_head": model.lm_head.weight}
    out = []
    for name, w in shapes.items():
        copies = max(2, -(-200_000_000 // (w.numel() * 2)))
        ws = [w.clone() for _ in range(copies)]
        x = torch.randn(rows, w.shape[1], device="cuda", dtype=w.dtype)
        # one pass over the copies, replayed from a graph: GPU µs per call
        us = _graph_us([partial(F.linear, x, wc) for wc in ws], 1, torch)
        floor = w.numel() * 2 / (copy_gbps * 1e3)  # µs
        out.append(dict(gemm=name, n=w.shape[0], k=w.shape[1], rows=rows, us=us,
                        floor_us=floor, pct_copy=100 * floor / us))
        del ws
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctxs", default="1024,32768")
    ap.add_argument("--rows", default="1,17,65")
    ap.add_argument("--out", default=str(Path(os.environ.get("OUT", ".")) / "diag_step.json"))
    args = ap.parse_args()
    a = argparse.Namespace(tiny=False, layers=None, device="cuda", std=0.02, page_size=16,
                           chunk=8192)
    ctxs = [int(x) for x in args.ctxs.split(",")]
    rows_list = [int(x) for x in args.rows.split(",")]
    copy_gbps = ceilings("cuda", False)["copy_GBps"]
    model, shape = build_target(a, torch.bfloat16)
    runner = make_runner(a, model, "bfloat16", max(ctxs) + max(rows_list) + 1)
    runner.blocks.reserve("d", max(ctxs) + max(rows_list) + 1)
    runner.blocks.ensure("d", max(ctxs) + max(rows_list) + 1)
    table = runner.blocks.page_table("d")
    res = dict(device=torch.cuda.get_device_name(), copy_GBps=copy_gbps, steps=[], gemms=[])
    for ctx in ctxs:
        for rows in rows_list:
            r = step_breakdown(model, runner.kv, table, ctx, rows, shape["num_layers"], copy_gbps)
            res["steps"].append(r)
            cls = ", ".join(f"{k} {v:.2f}" for k, v in r["by_class_ms"].items())
            print(f"ctx {ctx} rows {rows}: graph {r['graph_ms']:.2f} ms, kernels "
                  f"{r['kernels_ms']:.2f}, gaps {r['gaps_ms']:.2f} | {cls}", flush=True)
            for t in r["top"][:8]:
                print(f"    {t['us']:9.1f} us  x{t['n']:3d}  {t['name']}")
    for rows in rows_list:
        for g in gemm_alone(model, rows, copy_gbps):
            res["gemms"].append(g)
            print(f"gemm {g['gemm']:8s} M={rows:4d} N={g['n']:6d} K={g['k']:5d}: {g['us']:7.1f} us"
                  f" (floor {g['floor_us']:.1f}, {g['pct_copy']:.0f}% of copy)", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
