"""Where a tree-attention call's time goes at one shape (H200 diagnostics, issue 5).

For each shape (ctx, tree nodes N; 32/8 heads, head_dim 128, page 16, shuffled pages) prints, in
one run next to each other: the KV-read floor (bytes / copy bandwidth of a 1 GiB copy); our call
timed in a CUDA graph of 3 calls (bench_kernel.py's harness) and of 36
calls (one per layer of an 8B model: the pools rotate, so L2 never holds the next one); and,
from torch.profiler over graph replays, the GPU time of each of our two kernels (attention,
combine) — the rest of the per-call time is launch gaps. With programmatic dependent launch on
(the sm_90 default) the combine's time includes its wait for the attention kernel: split the
two with `--options "{'pdl': False}"`.

    PYTHONPATH=.:bench python experiments/diag_kernel.py [--out PATH]
        [--shapes "[(32768, 1), (32768, 16)]"]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import triton


def _graph_us(calls, reps, torch) -> float:
    """µs per call of a CUDA graph replaying `calls` `reps` times in a row."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            for c in calls:
                c()
    ms = triton.testing.do_bench(graph.replay, return_mode="median")
    return ms * 1e3 / (reps * len(calls))


def _kernel_times(calls, torch) -> dict:
    """GPU µs per launch of each kernel name, from torch.profiler over 20 graph replays."""
    from torch.profiler import ProfilerActivity, profile

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            graph.replay()
        torch.cuda.synchronize()
    out: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type.name == "CUDA" and ev.device_time > 0:
            out.setdefault(ev.name.split("(")[0][:40], []).append(ev.device_time)
    return {k: sum(v) / len(v) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", default="[(32768, 1), (32768, 16), (131072, 16)]")
    ap.add_argument("--options", default="{}", help="launcher options (python dict literal)")
    args = ap.parse_args()

    import numpy as np
    import torch
    from bench_kernel import _copy_bw, _point

    from specserve.kernels.tree_attention.kernel import tree_attention_triton

    hq, hkv, d, page = 32, 8, 128, 16
    opts = eval(args.options)  # noqa: S307 — our own CLI
    copy_bw = _copy_bw(torch, triton)
    print(f"# {torch.cuda.get_device_name()}: copy {copy_bw / 1e9:.0f} GB/s; options {opts}")
    rows = []
    print("| ctx | N | floor µs | ours graph×3 µs | ours graph×36 µs | attn kernel µs | "
          "combine µs | gaps µs |")
    print("|---|---|---|---|---|---|---|---|")
    for ctx, n in eval(args.shapes):  # noqa: S307
        sets = _point(ctx, n, hq, hkv, page, True, 7, torch, np)
        qs = [torch.randn(n, hq, d, device="cuda", dtype=torch.bfloat16) for _ in sets]
        calls = [lambda q=q, s=s: tree_attention_triton(q, *s, d**-0.5, options=opts)
                 for q, s in zip(qs, sets, strict=True)]
        kv_bytes = 2 * ctx * hkv * d * 2
        floor = kv_bytes / copy_bw * 1e6
        g3 = _graph_us(calls, 1, torch)
        g36 = _graph_us(calls, 12, torch)
        kt = _kernel_times(calls, torch)
        attn = sum(v for k, v in kt.items() if "tree_attn" in k)
        comb = sum(v for k, v in kt.items() if "combine" in k)
        row = dict(ctx=ctx, n=n, floor_us=floor, graph3_us=g3, graph36_us=g36,
                   attn_us=attn, combine_us=comb, kernels=kt, options=opts)
        rows.append(row)
        print(f"| {ctx} | {n} | {floor:.1f} | {g3:.1f} | {g36:.1f} | {attn:.1f} "
              f"| {comb:.1f} | {g3 - attn - comb:.1f} |", flush=True)
        del sets, qs, calls
        torch.cuda.empty_cache()
    out = Path(args.out or Path(os.environ.get("OUT", ".")) / "diag.json")
    out.write_text(json.dumps(dict(copy_GBps=copy_bw / 1e9, rows=rows), indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
