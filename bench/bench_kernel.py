"""Tree-verify attention benchmark (H200 / any CUDA GPU) and the sm_120 cross-compile check.

Owns the kernel's headline measurement (BENCHMARKS.md, the "Tree-verify attention kernel"
sections) in one run: copy bandwidth (D2D, bytes read + written) and
bf16 matmul rate, then per point (ctx L, tree rows N, (Hq, Hkv), page size, page order) the
µs of: ours (auto splits), ours with S=1, the naive Triton baseline (naive.py), gather + SDPA
with a bool mask, SDPA over pre-gathered contiguous KV, and the KV-read floor (bytes / copy BW).
Each point is checked against the fp32 reference first; KV pools (≥ 3, each K and V ≥ 64 MB,
together ≥ 192 MB of K/V read) are rotated so L2 (60 MB on H200) does not flatter. Timings:
`triton.testing.do_bench` median over a CUDA graph of 36 calls cycling through the pools (one
per layer of the 8B shape; eager fallback), divided by 36.

    python bench/bench_kernel.py [--out PATH] [--quick]     # markdown table + JSON
    python bench/bench_kernel.py --sm120-check [--quick]    # cross-compile every sm_120 config
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import astuple
from pathlib import Path

D = 128
POOL_BYTES = 64 << 20  # each K and each V pool is at least this large
L2_ROTATE = 192 << 20  # the pools one timed graph cycles through hold ≥ this (3 × the H200 L2)


def compile_report(arch: int, quick: bool = False, configs=None) -> list[dict]:
    """Cross-compile kernel configs for sm_`arch` (90 or 120; no GPU needed) and read shared
    memory, registers and spill bytes (ptxas -v). `configs`: [(head_dim, Config, elem_size)],
    default every config the launcher can pick on `arch`, each for bf16 and fp16 (elem 2) or
    fp32, in the page-16, page-64 and page-1 + sliding-window variants, plus the combine kernel
    (one-shot and chunked) and the prefill merge kernel per head_dim. `quick`: bf16 page 16
    only, no combine or merge. RuntimeError
    when triton's CUDA backend or its ptxas is missing."""
    from specserve.kernels.tree_attention import kernel as K
    from specserve.kernels.tree_attention.configs import all_configs, tail_block_n, tail_row_words

    ptxas = _ptxas(arch)
    report = []
    for head_dim, cfg, elem in configs or all_configs(arch):
        if quick and elem == 4:
            continue
        dts = ["bf16"] if quick else (["bf16", "fp16"] if elem == 2 else ["fp32"])
        variants = [dict(PAGE_SIZE=16, SLIDING=False, HAS_TREE=True)]
        if not quick:
            variants += [dict(PAGE_SIZE=64, SLIDING=False, HAS_TREE=True),
                         dict(PAGE_SIZE=1, SLIDING=True, HAS_TREE=True)]
        for dt in dts:
            for extra in variants:
                cons = dict(GROUP=4, HEAD_DIM=head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                            TAIL_N=tail_block_n(cfg), DOT_PREC="ieee" if elem == 4 else "tf32",
                            MASK_ALL=elem == 4, ROW_WORDS=tail_row_words(arch, cfg), USE_PDL=True,
                            **extra)
                got = _compile(K._tree_attn_kernel, dt, cons, cfg.num_warps, cfg.num_stages,
                               arch, ptxas)
                report.append(dict(kernel="_tree_attn_kernel", arch=arch, head_dim=head_dim,
                                   dtype=dt, block_m=cfg.block_m, block_n=cfg.block_n,
                                   num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                                   variant=str(extra), **got))
                print(report[-1], flush=True)
    if not quick:
        head_dims = sorted({c[0] for c in configs or all_configs(arch)})
        report += _combine_report(arch, head_dims, ptxas)
        report += _merge_report(arch, head_dims, ptxas)
    return report


def _merge_report(arch: int, head_dims: list[int], ptxas: str) -> list[dict]:
    """The prefill path's LSE merge of two results (specserve/attention/prefill.py) per head_dim
    it serves (cuDNN's ≤ 128) and input dtype."""
    from specserve.kernels.tree_attention.combine import _merge_pair_kernel

    report = []
    for head_dim in [d for d in head_dims if d <= 128]:
        for dt in ("bf16", "fp16"):
            got = _compile(_merge_pair_kernel, dt, dict(HEAD_DIM=head_dim, BLOCK_T=16), 4, 1,
                           arch, ptxas)
            report.append(dict(kernel="_merge_pair_kernel", arch=arch, head_dim=head_dim,
                               dtype=dt, **got))
            print(report[-1], flush=True)
    return report


def _combine_report(arch: int, head_dims: list[int], ptxas: str) -> list[dict]:
    """The combine kernels per head_dim: per row one-shot and chunked (where 65 parts exceed
    BLOCK_S), and by row blocks."""
    from specserve.kernels.tree_attention.combine import _combine_kernel, _combine_rows_kernel
    from specserve.kernels.tree_attention.configs import COMBINE_BLOCK_R, combine_block_s

    report = []
    for head_dim in head_dims:
        seen = []
        for parts in (2, 65):
            block_s, lse_block = combine_block_s(parts, head_dim)
            cons = dict(HEAD_DIM=head_dim, BLOCK_S=block_s, LSE_BLOCK=lse_block,
                        ONE_SHOT=parts <= block_s, USE_PDL=True, TRIGGER_FIRST=False)
            if cons in seen:
                continue
            seen.append(cons)
            got = _compile(_combine_kernel, "bf16", cons, 4, 1, arch, ptxas)
            report.append(dict(kernel="_combine_kernel", arch=arch, head_dim=head_dim,
                               dtype="bf16", variant=str(cons), **got))
            print(report[-1], flush=True)
        cons = dict(HEAD_DIM=head_dim, BLOCK_R=COMBINE_BLOCK_R, USE_PDL=True,
                    TRIGGER_FIRST=False)
        got = _compile(_combine_rows_kernel, "bf16", cons, 4, 2, arch, ptxas)
        report.append(dict(kernel="_combine_rows_kernel", arch=arch, head_dim=head_dim,
                           dtype="bf16", variant=str(cons), **got))
        print(report[-1], flush=True)
    return report


def _ptxas(arch: int) -> str:
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return get_ptxas(arch).path
    except Exception as e:  # noqa: BLE001 — any failure means: no CUDA backend here
        raise RuntimeError(f"no triton CUDA backend / ptxas: {e}") from e


_PTR_TYPES = {"BlockTable": "*i32", "CuQ": "*i32", "CtxLens": "*i32", "Positions": "*i64",
              "TreeMask": "*i32", "OPart": "*fp32", "LsePart": "*fp32", "L1": "*fp32",
              "L2": "*fp32"}
_ALIGNED = ("stride_qt", "stride_kp", "stride_ks", "stride_kh", "stride_os", "stride_ot",
            "stride_oh")


def _compile(fn, dt: str, cons: dict, num_warps: int, num_stages: int, arch: int,
             ptxas: str) -> dict:
    """triton.compile `fn` for GPUTarget("cuda", arch, 32) with inputs of dtype `dt`; its
    shared memory (bytes), registers and spill bytes (ptxas -v on the PTX)."""
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {}
    for name in fn.arg_names:
        if name in cons:
            sig[name] = "constexpr"
        elif name in ("Q", "K", "V", "Out", "O1", "O2"):
            sig[name] = "*" + dt
        elif name in _PTR_TYPES:
            sig[name] = _PTR_TYPES[name]
        else:
            sig[name] = "fp32" if name == "sm_scale_log2" else "i32"
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]]
             for n, t in sig.items() if t.startswith("*") or n in _ALIGNED}
    compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=cons, attrs=attrs),
                              target=GPUTarget("cuda", arch, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages))
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(compiled.asm["ptx"])
        log = subprocess.run([ptxas, "-v", f"--gpu-name=sm_{arch}a", str(ptx), "-o",
                              str(Path(tmp) / "k.o")], capture_output=True, text=True,
                             check=True).stderr
    spills = sum(int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", log))
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    return dict(shared=compiled.metadata.shared, regs=regs, spills=spills)


def sm120_check(quick: bool = False) -> list[dict]:
    """Compile every kernel config the launcher can pick on sm_120 (GPUTarget("cuda", 120, 32)),
    assert shared memory ≤ 101,376 B and 0 spill bytes (ptxas -v). Needs no GPU; RuntimeError
    when triton's CUDA backend or its Blackwell ptxas is missing."""
    from specserve.kernels.tree_attention.configs import SM120_SMEM_LIMIT

    report = compile_report(120, quick)
    bad = [r for r in report if r["shared"] > SM120_SMEM_LIMIT or r["spills"]]
    assert not bad, f"sm_120 configs over the shared-memory limit or spilling: {bad}"
    return report


LAYERS = 36  # calls per timed CUDA graph: one per layer of the Qwen3-8B shape


def _bench(calls, torch, triton) -> tuple[float, str]:
    """µs per call: median of a CUDA graph replaying LAYERS calls that cycle through `calls`
    (one per pool, so consecutive calls never share a pool), else eager. A graph of 36 calls is
    how a model's forward runs them: one graph launch per forward, not per call."""
    for c in calls:
        c()  # compile / warm up
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(LAYERS):
                calls[i % len(calls)]()
        ms = triton.testing.do_bench(graph.replay, return_mode="median")
        return ms * 1e3 / LAYERS, "graph"
    except Exception:  # noqa: BLE001 — not capturable: eager, rotating pools
        torch.cuda.synchronize()
        it = iter(range(1 << 62))
        ms = triton.testing.do_bench(lambda: calls[next(it) % len(calls)](),
                                     return_mode="median")
        return ms * 1e3, "eager"


def _copy_bw(torch, triton) -> float:
    """Bytes/s of a 1 GiB device-to-device copy (bytes read + written)."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    return 2 * x.numel() / (triton.testing.do_bench(lambda: y.copy_(x), return_mode="median")
                            * 1e-3)


def _matmul_rate(torch, triton) -> float:
    """FLOP/s of an 8192³ bf16 matmul."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192**3 / (triton.testing.do_bench(lambda: a @ a, return_mode="median") * 1e-3)


def _point(ctx, n_rows, hq, hkv, page, shuffled, seed, torch, np):
    """(k_pool, v_pool, batch) sets for one request of `n_rows` tree rows over `ctx`: ≥ 3, and
    enough that the K/V they read together is ≥ L2_ROTATE (a 36-call graph never finds the next
    call's K/V in L2)."""
    from specserve.attention.base import AttnBatch
    from specserve.spec.tree import DraftTree, verify_layout

    rng = np.random.default_rng(seed)
    n = n_rows - 1
    parents = np.array([rng.integers(max(0, i - 3), i + 1) for i in range(n)], dtype=np.int32)
    depths = np.zeros(n, dtype=np.int32)
    for i, p in enumerate(parents):
        depths[i] = 1 if p == 0 else depths[p - 1] + 1
    lay = verify_layout(DraftTree(np.arange(n, dtype=np.int64), parents, depths), 1, ctx)
    need = -(-(ctx + n_rows) // page)
    page_bytes = page * hkv * D * 2
    num_pages = max(need, -(-POOL_BYTES // page_bytes))
    sets = []
    used = 2 * (ctx + n_rows) * hkv * D * 2  # K + V bytes one call reads
    for _ in range(min(LAYERS, max(3, -(-L2_ROTATE // used)))):
        if shuffled:
            table = rng.permutation(num_pages)[:need]
        else:
            start = int(rng.integers(0, num_pages - need + 1))
            table = np.arange(start, start + need)
        batch = AttnBatch.build([n_rows], [ctx], [table.tolist()], lay.positions, page,
                                [lay.mask], device="cuda")
        k = torch.randn(num_pages, page, hkv, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(num_pages, page, hkv, D, device="cuda", dtype=torch.bfloat16)
        sets.append((k, v, batch))
    return sets


def _measure(i, ctx, n_rows, hq, hkv, page, shuffled, copy_bw, mm) -> dict:
    """Check, then time every implementation at one point; prints one table row."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    import triton

    from specserve.attention.torch_ref import visible_mask
    from specserve.kernels.tree_attention.kernel import tree_attention_triton
    from specserve.kernels.tree_attention.naive import tree_attention_naive
    from specserve.kernels.tree_attention.ref import tree_attention_ref

    sets = _point(ctx, n_rows, hq, hkv, page, shuffled, i, torch, np)
    scale = D**-0.5
    qs = [torch.randn(n_rows, hq, D, device="cuda", dtype=torch.bfloat16) for _ in sets]
    k0, v0, b0 = sets[0]
    ref = tree_attention_ref(qs[0], k0, v0, b0, scale).float()  # fp32 math on GPU
    err = {}
    for name, fn in (("ours", tree_attention_triton), ("naive", tree_attention_naive)):
        out = fn(qs[0], k0, v0, b0, scale)
        err[name] = float((out.float() - ref).abs().max() / ref.abs().max())
    del ref
    groups = hq // hkv

    def gathered(k, v, b):  # [1, Hkv, L+N, D] contiguous K, V of request 0
        pos = torch.arange(ctx + n_rows, device="cuda")
        pages = b.block_table[0, pos // page].long()
        return (k[pages, pos % page].transpose(0, 1)[None].contiguous(),
                v[pages, pos % page].transpose(0, 1)[None].contiguous())

    mask = visible_mask(b0, 0, None)  # [N, L+N] bool (the same tree in every set)
    contig = [gathered(k, v, b) for k, v, b in sets]
    qt = [q.transpose(0, 1)[None] for q in qs]  # [1, Hq, N, D]

    def sdpa(q, kc, vc):
        return F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, scale=scale,
                                              enable_gqa=groups > 1)

    res = {}
    res["ours"], mode = _bench([lambda q=q, s=s: tree_attention_triton(q, *s, scale)
                                for q, s in zip(qs, sets, strict=True)], torch, triton)
    res["s1"], _ = _bench([lambda q=q, s=s: tree_attention_triton(q, *s, scale, num_splits=1)
                           for q, s in zip(qs, sets, strict=True)], torch, triton)
    res["naive"], _ = _bench([lambda q=q, s=s: tree_attention_naive(q, *s, scale)
                              for q, s in zip(qs, sets, strict=True)], torch, triton)
    res["gather_sdpa"], _ = _bench([lambda q=q, s=s: sdpa(q, *gathered(*s))
                                    for q, s in zip(qt, sets, strict=True)], torch, triton)
    res["sdpa"], _ = _bench([lambda q=q, c=c: sdpa(q, *c)
                             for q, c in zip(qt, contig, strict=True)], torch, triton)
    kv_bytes = 2 * (ctx + n_rows) * hkv * D * 2
    floor_mem = kv_bytes / copy_bw * 1e6
    floor_fl = 4 * n_rows * hq * (ctx + n_rows) * D / mm * 1e6
    floor = max(floor_mem, floor_fl)
    plan = next(p for key, p in b0.memo.items()  # the launcher's own plan for "ours"
                if key[0] == "plan" and key[6] is None and key[8] is None and not key[9])
    s_auto, cfg = plan.parts - 1, plan.config
    combine = (f"shot {plan.combine_shot}" if plan.combine_shot else
               f"rows {plan.combine_rows}" if plan.combine_rows else "per row")
    row = dict(ctx=ctx, n=n_rows, hq=hq, hkv=hkv, page=page, shuffled=shuffled,
               splits_auto=s_auto, config=list(astuple(cfg)), combine=combine, timing=mode,
               floor_mem_us=floor_mem,
               floor_flop_us=floor_fl, kv_bytes=kv_bytes, err=err,
               **{f"{k}_us": v for k, v in res.items()})
    print(f"| {ctx} | {n_rows} | {hq}/{hkv} | {page} | {'shuf' if shuffled else 'contig'} "
          f"| {s_auto} | {combine} | {res['ours']:.1f} | {res['s1']:.1f} | {res['naive']:.1f} "
          f"| {res['gather_sdpa']:.1f} | {res['sdpa']:.1f} | {floor:.1f} "
          f"| {100 * floor / res['ours']:.0f}% | {res['naive'] / res['ours']:.1f} "
          f"| {max(err.values()):.1e} |", flush=True)
    del sets, contig, qs, qt
    torch.cuda.empty_cache()
    return row


def run(args, partial: Path | None = None) -> dict:
    import torch
    import triton

    dev = torch.cuda.get_device_properties(0)
    copy_bw, mm = _copy_bw(torch, triton), _matmul_rate(torch, triton)
    env = dict(gpu=dev.name, sms=dev.multi_processor_count, torch=torch.__version__,
               triton=triton.__version__, copy_GBps=copy_bw / 1e9, bf16_TFLOPs=mm / 1e12)
    print(f"# {dev.name}: copy {copy_bw / 1e9:.0f} GB/s, bf16 matmul {mm / 1e12:.0f} TFLOP/s\n")
    ctxs = (4096, 32768) if args.quick else (4096, 32768, 131072)
    points = [(c, n, 32, 8, 16, s) for c in ctxs for n in (1, 16, 64, 256) for s in (False, True)]
    points += [(32768, n, hq, hkv, 16, True) for hq, hkv in ((64, 8), (28, 4)) for n in (1, 16, 64)]
    points += [(32768, n, 32, 8, p, True) for p in (1, 64) for n in (16, 64)]
    if not args.quick:
        points += [(131072, 64, hq, hkv, 16, True) for hq, hkv in ((64, 8), (28, 4))]
    rows = []
    hdr = ("| ctx | N | Hq/Hkv | page | order | S | combine | ours µs | S=1 µs | naive µs "
           "| gather+SDPA µs | SDPA µs | floor µs | % floor | × naive | max err |")
    print(hdr)
    print("|" + "---|" * (hdr.count("|") - 1))
    t_start = time.time()
    for i, point in enumerate(points):
        rows.append(_measure(i, *point, copy_bw, mm))
        if partial is not None:  # each row on disk as it comes (a run cut short keeps them)
            partial.write_text(json.dumps(dict(env=env, rows=rows), indent=1))
    print(f"\n{len(rows)} points in {time.time() - t_start:.0f} s; errors vs fp32 ref must be "
          "≤ 2e-2 (bf16)")
    return dict(env=env, rows=rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="JSON path (default $OUT/kernel_bench.json)")
    ap.add_argument("--quick", action="store_true", help="fewer points / configs")
    ap.add_argument("--sm120-check", action="store_true", help="only cross-compile for sm_120")
    args = ap.parse_args()
    import torch

    if not args.sm120_check and not torch.cuda.is_available():
        ap.error("times the kernel on a CUDA GPU (none here); --sm120-check cross-compiles "
                 "without one")
    default = "sm120_check.json" if args.sm120_check else "kernel_bench.json"
    out = Path(args.out or Path(os.environ.get("OUT", ".")) / default)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"sm120": sm120_check(args.quick)} if args.sm120_check else run(args, out)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
