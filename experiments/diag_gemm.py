"""Skinny GEMMs of a verify step (M = tree rows) on the GPU: cuBLAS by M and BLAS library vs a
plain Triton kernel, next to the weights-read floor (issue 9).

The verify step at 1k context is its GEMMs: M = 65 rows against the Qwen3-8B layer weights, so
each GEMM should stream its weights at the copy rate. diag_step measured cuBLAS at 57-65 % of it
for the small ones (qkv, o, down) and 84 % for gate_up. This script asks whether that is the
shape (M = 65 just past 64: other M, as the rows buckets could pad to), the library choice
(`torch.backends.cuda.preferred_blas_library`), or the kernels (a plain Triton split-N /
split-K kernel over a small config grid). Every call is replayed from a CUDA graph over weight
copies that together exceed L2 (≥ 200 MB), random bf16 values, and checked against F.linear.

    PYTHONPATH=.:bench python3 experiments/diag_gemm.py [--ms 17,64,65,72,80,128]
        [--out $OUT/diag_gemm.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from _e2e_common import ceilings
from diag_kernel import _graph_us

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096),
          "down": (4096, 12288)}  # (N, K) of one Qwen3-8B layer
CHAIN_CONFIGS = [(32, 64, 6), (64, 64, 6), (32, 128, 4)]  # (BLOCK_N, BLOCK_K, stages)
TRITON_GRID = list(itertools.product((32, 64, 128), (128, 256), (3, 5), (1, 2, 4)))


@triton.jit
def _skinny_mm(X, W, Y, M, N, K, s_xm, s_wn, s_ym, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
               PREFETCH_K: tl.constexpr, USE_PDL: tl.constexpr):
    """Y[:M, n-block] (+)= X[:M] @ W[n-block].T over this program's K slice; fp32 atomics when
    SPLIT_K > 1 (Y fp32, zeroed by the caller). USE_PDL (launched as a programmatic
    dependent): before waiting for the kernel ahead (griddepcontrol.wait) it asks L2 for the
    first PREFETCH_K columns of its weight rows — they do not depend on that kernel — so the
    weight stream starts early."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if PREFETCH_K > 0:
        lines = tl.arange(0, PREFETCH_K // 64) * 64  # one address per 128-byte line (bf16)
        pre = W + offs_n[:, None] * s_wn + lines[None, :]
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n mov.u32 $0, 0;",
                                  "=r,l", [pre], dtype=tl.int32, is_pure=False, pack=1)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    k_per = K // SPLIT_K
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(pid_k * k_per, (pid_k + 1) * k_per, BLOCK_K):
        x = tl.load(X + offs_m[:, None] * s_xm + (k + offs_k)[None, :],
                    mask=offs_m[:, None] < M, other=0.0)
        w = tl.load(W + offs_n[:, None] * s_wn + (k + offs_k)[None, :])  # [BLOCK_N, BLOCK_K]
        acc = tl.dot(x, tl.trans(w), acc)
    ptrs = Y + offs_m[:, None] * s_ym + offs_n[None, :]
    if SPLIT_K == 1:
        tl.store(ptrs, acc.to(Y.dtype.element_ty), mask=offs_m[:, None] < M)
    else:
        tl.atomic_add(ptrs, acc, mask=offs_m[:, None] < M, sem="relaxed")


@triton.jit
def _pre_norm(X, Y, K, TRIGGER: tl.constexpr, BLOCK: tl.constexpr):
    """A norm-like kernel ahead of each GEMM (one row per program), as in the model's layer;
    TRIGGER: let the next kernel (a programmatic dependent) launch at once."""
    if TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    x = tl.load(X + row * K + offs, mask=offs < K, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, 0) / K + 1e-6)
    tl.store(Y + row * K + offs, (x * r).to(Y.dtype.element_ty), mask=offs < K)


def chain(name, n, k, m, copy_gbps, configs) -> list[dict]:
    """µs per [norm-like kernel → GEMM] pair, 36 pairs in a graph over rotated weights: cuBLAS,
    the Triton GEMM as a plain launch, as a programmatic dependent, and with the L2 prefetch."""
    ws = _copies(n, k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    xn = torch.empty_like(x)
    ref = F.linear(xn, ws[0])
    block = triton.next_power_of_2(k)

    def pre(trigger):
        _pre_norm[(m,)](x, xn, k, TRIGGER=trigger, BLOCK=block, num_warps=8)

    def ours(w, cfg, pdl, pref):
        block_n, block_k, stages = cfg
        y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        _skinny_mm[(n // block_n, 1)](x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
                                      BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=block_n,
                                      BLOCK_K=block_k, SPLIT_K=1, PREFETCH_K=pref, USE_PDL=pdl,
                                      num_warps=4, num_stages=stages, launch_pdl=pdl)
        return y

    def pairs(gemm, trigger):
        calls = []
        for w in ws * max(1, 36 // len(ws)):
            calls += [partial(pre, trigger), partial(gemm, w)]
        return calls

    floor = n * k * 2 / (copy_gbps * 1e3)
    pre_us = _graph_us([partial(pre, False)] * 36, 1, torch)
    rows = [dict(gemm=name, m=m, impl="norm alone", us=pre_us)]
    us = _graph_us(pairs(partial(F.linear, xn), False), 1, torch) * 2
    rows.append(dict(gemm=name, m=m, impl="norm+cublas", us=us, gemm_us=us - pre_us,
                     floor_us=floor))
    for cfg in configs:
        for pdl, pref in ((False, 0), (True, 0), (True, 512), (True, 2048), (True, k)):
            label = f"norm+triton{list(cfg)}" + (f" pdl prefetch {pref}" if pdl else "")
            try:
                pre(False)
                got = ours(ws[0], cfg, pdl, pref)
                torch.cuda.synchronize()
                err = float((got.float() - ref.float()).abs().max() / ref.float().abs().max())
                us = _graph_us(pairs(partial(ours, cfg=cfg, pdl=pdl, pref=pref), pdl), 1,
                               torch) * 2
            except Exception as e:  # noqa: BLE001 — a config may not fit
                rows.append(dict(gemm=name, m=m, impl=label, error=f"{type(e).__name__}"))
                continue
            rows.append(dict(gemm=name, m=m, impl=label, us=us, gemm_us=us - pre_us,
                             floor_us=floor, err=err))
    for r in rows:
        if "error" in r:
            print(f"{name:8s} M={m:4d} {r['impl']:48s} {r['error']}", flush=True)
        elif "gemm_us" in r:
            print(f"{name:8s} M={m:4d} {r['impl']:48s} pair {r['us']:6.1f} us, gemm "
                  f"{r['gemm_us']:6.1f} ({100 * floor / r['gemm_us']:3.0f}% of copy)", flush=True)
    return rows


def triton_linear(x, w, cfg):
    block_n, block_k, stages, split_k = cfg
    m, k = x.shape
    n = w.shape[0]
    if split_k == 1:
        y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    else:
        y = torch.zeros(m, n, device=x.device, dtype=torch.float32)
    _skinny_mm[(n // block_n, split_k)](
        x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
        BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=block_n, BLOCK_K=block_k,
        SPLIT_K=split_k, PREFETCH_K=0, USE_PDL=False, num_warps=4, num_stages=stages)
    return y


def _copies(n, k):
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    count = max(2, -(-200_000_000 // (n * k * 2)))
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
            for _ in range(count)]


def measure(name, n, k, ms, copy_gbps, triton_ms) -> list[dict]:
    ws = _copies(n, k)
    floor = n * k * 2 / (copy_gbps * 1e3)  # µs
    rows = []
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x, ws[0]).float()
        for lib in ("default", "cublas", "cublaslt"):
            prev = torch.backends.cuda.preferred_blas_library()
            if lib != "default":
                torch.backends.cuda.preferred_blas_library(lib)
            try:
                us = _graph_us([partial(F.linear, x, w) for w in ws], 1, torch)
            finally:
                torch.backends.cuda.preferred_blas_library(prev)
            rows.append(dict(gemm=name, m=m, n=n, k=k, impl=f"torch:{lib}", us=us,
                             floor_us=floor, pct_copy=100 * floor / us))
        if m not in triton_ms:
            continue
        best = None
        for cfg in TRITON_GRID:
            if n % cfg[0] or (k // cfg[3]) % cfg[1]:
                continue
            try:
                err = float((triton_linear(x, ws[0], cfg).float() - ref).abs().max()
                            / ref.abs().max())
                us = _graph_us([partial(triton_linear, x, w, cfg) for w in ws], 1, torch)
            except Exception as e:  # noqa: BLE001 — a config may not fit (shared memory)
                print(f"  triton {cfg}: {type(e).__name__}", flush=True)
                continue
            if best is None or us < best["us"]:
                best = dict(gemm=name, m=m, n=n, k=k, impl="triton", config=list(cfg), us=us,
                            floor_us=floor, pct_copy=100 * floor / us, err=err)
        if best is not None:
            rows.append(best)
    for r in rows:
        print(f"{r['gemm']:8s} M={r['m']:4d} {r['impl']:16s} {r['us']:7.1f} us "
              f"({r['pct_copy']:3.0f}% of copy)" + (f" cfg {r['config']} err {r['err']:.1e}"
                                                    if "config" in r else ""), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="17,64,65,72,80,128")
    ap.add_argument("--triton-ms", default="64,65")
    ap.add_argument("--chain", action="store_true",
                    help="only [norm → GEMM] pairs: cuBLAS vs Triton, plain / PDL / L2 prefetch")
    ap.add_argument("--chain-ms", default="64,65")
    ap.add_argument("--out", default=str(Path(os.environ.get("OUT", ".")) / "diag_gemm.json"))
    args = ap.parse_args()
    ms = [int(x) for x in args.ms.split(",")]
    triton_ms = {int(x) for x in args.triton_ms.split(",") if x}
    copy_gbps = ceilings("cuda", False)["copy_GBps"]
    print(f"# {torch.cuda.get_device_name()} copy {copy_gbps:.0f} GB/s", flush=True)
    res = dict(device=torch.cuda.get_device_name(), copy_GBps=copy_gbps, rows=[])
    if args.chain:
        for name, (n, k) in SHAPES.items():
            for m in (int(x) for x in args.chain_ms.split(",")):
                res["rows"] += chain(name, n, k, m, copy_gbps, CHAIN_CONFIGS)
                torch.cuda.empty_cache()
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1))
        return
    for name, (n, k) in SHAPES.items():
        res["rows"] += measure(name, n, k, ms, copy_gbps, triton_ms)
        torch.cuda.empty_cache()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
