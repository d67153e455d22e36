"""Verify-tree attention over a paged prefix: cuDNN's paged SDPA vs our tree kernel (issue 9).

At 32k-128k context a budget-64 tree's attention is compute-bound (260 packed rows per KV
head) and our Triton kernel runs it at ~37-50 % of the matmul rate. cuDNN's fused attention
runs prefill chunks at ~600 TFLOP/s (diag_sdpa) and takes paged K/V caches (block tables) —
so can it take the tree's prefix part? The tree's new tokens see every prefix key, so the
prefix part is unmasked attention: the G query heads of each KV head are packed into the
query axis (q [1, Hkv, N·G, D], no GQA for cuDNN), K/V are the pool itself as a paged
container (a strided view, no copy), the block table and the lengths live on the device (a
CUDA graph can replay it for other requests), and the LSE comes out in log2 (the unit of our
kernel's partials), so the tree tail can merge in.

Printed per (ctx, N): our kernel (prefix + tail + combine, CUDA graph of the call), our
kernel on the tail alone (ctx 0: what would stay ours), cuDNN's paged prefix (graph-replayed),
the q packing copy, the FLOP floor of the prefix part at the matmul rate, and cuDNN's error vs
an fp32 torch reference over the gathered pages. Needs the `nvidia-cudnn-frontend` wheel.

    PYTHONPATH=.:bench python3 experiments/diag_cudnn_paged.py [--shapes "[(32768, 65)]"]
        [--out $OUT/diag_cudnn_paged.json]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np
import torch
import triton
from bench_kernel import _matmul_rate, _point
from diag_kernel import _graph_us

from specserve.kernels.tree_attention.kernel import tree_attention_triton

HQ, HKV, D, PAGE = 32, 8, 128, 16


VARIANT = dict(log2=True, packed_container=False)


def cudnn_prefix(q_packed, k_pool, v_pool, table, ctx, handle, splits=1):
    """A callable running cuDNN's paged SDPA of q_packed [1, Hkv, R, D] over the first `ctx`
    keys of the request's pages; returns (callable, o [1, Hkv, R, D] bf16, lse [1, Hkv, R, 1]).
    VARIANT: LSE in log2 or natural log; the container as a view of the pool or a copy in
    cuDNN's packed [P, Hkv, page, D] layout."""
    import cudnn

    r = q_packed.shape[2]
    per = -(-ctx // (splits * PAGE))  # pages per split: the splits are batch entries
    n_pages = per
    table = torch.nn.functional.pad(table[: splits * per], (0, max(0, splits * per
                                                                   - table.shape[0])))
    lens = [max(0, min(ctx - i * per * PAGE, per * PAGE)) for i in range(splits)]
    q_packed = q_packed.expand(splits, -1, -1, -1).contiguous()
    kc = k_pool.permute(0, 2, 1, 3)  # [P, Hkv, page, D] view of [P, page, Hkv, D]
    vc = v_pool.permute(0, 2, 1, 3)
    if VARIANT["packed_container"]:
        kc, vc = kc.contiguous(), vc.contiguous()
    bt = table.to(torch.int32).view(splits, 1, n_pages, 1)
    sq = torch.full((splits, 1, 1, 1), r, dtype=torch.int32, device="cuda")
    skv = torch.tensor(lens, dtype=torch.int32, device="cuda").view(splits, 1, 1, 1)
    o = torch.empty_like(q_packed)
    lse = torch.empty(splits, HKV, r, 1, dtype=torch.float32, device="cuda")
    g = cudnn.pygraph(io_data_type=cudnn.data_type.BFLOAT16,
                      intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT, handle=handle)
    tq, tk, tv = g.tensor_like(q_packed), g.tensor_like(kc), g.tensor_like(vc)
    tbt_k, tbt_v = g.tensor_like(bt), g.tensor_like(bt.clone())
    tsq, tskv = g.tensor_like(sq), g.tensor_like(skv)
    to, tl = g.sdpa(name="prefix", q=tq, k=tk, v=tv, attn_scale=D ** -0.5,
                    use_padding_mask=True, seq_len_q=tsq, seq_len_kv=tskv,
                    paged_attention_k_table=tbt_k, paged_attention_v_table=tbt_v,
                    paged_attention_max_seq_len_kv=n_pages * PAGE, generate_stats=True,
                    stats_use_log2=VARIANT["log2"])
    to.set_output(True).set_dim(list(o.shape)).set_stride(list(o.stride()))
    tl.set_output(True).set_data_type(cudnn.data_type.FLOAT).set_dim(list(lse.shape)) \
        .set_stride(list(lse.stride()))
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    ws = torch.empty(max(1, g.get_workspace_size()), dtype=torch.uint8, device="cuda")
    bt2 = bt.clone()
    pack = {tq: q_packed, tk: kc, tv: vc, tbt_k: bt, tbt_v: bt2, tsq: sq, tskv: skv,
            to: o, tl: lse}

    def run():
        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
        g.execute(pack, ws, handle=handle)

    return run, o, lse


def reference(q_packed, k_pool, v_pool, table, ctx):
    k = k_pool[table].reshape(-1, HKV, D)[:ctx].permute(1, 0, 2).float()  # [Hkv, ctx, D]
    v = v_pool[table].reshape(-1, HKV, D)[:ctx].permute(1, 0, 2).float()
    s = q_packed[0].float() @ k.transpose(1, 2) * D ** -0.5  # [Hkv, R, ctx]
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1) / np.log(2)


def measure(ctx, n, mm_rate, handle) -> dict:
    sets = _point(ctx, n, HQ, HKV, PAGE, True, 3, torch, np)
    qs = [torch.randn(n, HQ, D, device="cuda", dtype=torch.bfloat16) for _ in sets]
    ours = _graph_us([lambda q=q, s=s: tree_attention_triton(q, *s, D ** -0.5)
                      for q, s in zip(qs, sets, strict=True)], 4, torch)
    tail_sets = _point(0, n, HQ, HKV, PAGE, True, 4, torch, np)
    tail = _graph_us([lambda s=s: tree_attention_triton(qs[0], *s, D ** -0.5)
                      for s in tail_sets], 4, torch)

    def pack(q):  # [N, Hq, D] -> [1, Hkv, N·G, D] (token, head-in-group) rows per KV head
        return q.view(n, HKV, HQ // HKV, D).permute(1, 0, 2, 3).reshape(1, HKV, -1, D)

    packs = [pack(q).contiguous() for q in qs]
    pack_us = _graph_us([lambda q=q: pack(q).contiguous() for q in qs], 4, torch)
    flop = 4 * HQ * n * ctx * D
    row = dict(ctx=ctx, n=n, ours_us=ours, ours_tail_only_us=tail, pack_us=pack_us,
               prefix_flop_floor_us=flop / mm_rate * 1e6, cudnn={})
    for splits in (1, 4, 16, 32) if ctx >= 8192 else (1, 4):
        runs = [cudnn_prefix(qp, k, v, b.block_table[0], ctx, handle, splits)
                for qp, (k, v, b) in zip(packs, sets, strict=True)]
        for run, _, _ in runs:
            run()
        torch.cuda.synchronize()
        o, lse = runs[0][1].float(), runs[0][2][..., 0]  # [S, Hkv, R, D], [S, Hkv, R]
        lse = lse * (1.0 if VARIANT["log2"] else 1 / np.log(2))
        m = lse.max(0).values
        w = torch.exp2(lse - m)  # the splits' merge, in torch (timed apart: not here)
        o = (o * w[..., None]).sum(0) / w.sum(0)[..., None]
        lse = m + torch.log2(w.sum(0))
        o_ref, l_ref = reference(packs[0], sets[0][0], sets[0][1], sets[0][2].block_table[0],
                                 ctx)
        err = float((o - o_ref).abs().max() / o_ref.abs().max())
        lse_err = float((lse - l_ref).abs().max())
        us = _graph_us([r for r, _, _ in runs], 4, torch)
        row["cudnn"][splits] = dict(us=us, tflops=flop / us / 1e6, err=err, lse_err=lse_err)
        print(f"ctx {ctx:6d} N {n:3d}: ours {ours:7.1f} us | cuDNN prefix, {splits:2d} splits "
              f"{us:7.1f} us ({flop / us / 1e6:.0f} TFLOP/s, floor "
              f"{row['prefix_flop_floor_us']:.1f}) + tail {tail:5.1f} + pack {pack_us:4.1f} | "
              f"err {err:.1e}, lse {lse_err:.1e}", flush=True)
        del runs
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="[(32768, 16), (32768, 64), (32768, 65), "
                                        "(131072, 16), (131072, 64), (131072, 65)]")
    ap.add_argument("--out", default=str(Path(os.environ.get("OUT", ".")) /
                                         "diag_cudnn_paged.json"))
    args = ap.parse_args()
    import cudnn

    handle = cudnn.create_handle()
    mm = _matmul_rate(torch, triton)
    print(f"# {torch.cuda.get_device_name()} cuDNN {cudnn.backend_version()} frontend "
          f"{cudnn.__version__}; matmul {mm / 1e12:.0f} TFLOP/s", flush=True)
    rows = []
    for log2, packed in ((True, False), (False, False), (True, True), (False, True)):
        VARIANT.update(log2=log2, packed_container=packed)
        try:
            rows.append(dict(variant=dict(VARIANT), **measure(1024, 65, mm, handle)))
            break
        except Exception as e:  # noqa: BLE001 — the next variant
            print(f"variant {VARIANT}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    print(f"# variant {VARIANT}", flush=True)
    for ctx, n in eval(args.shapes):  # noqa: S307 — our CLI
        try:
            rows.append(measure(ctx, n, mm, handle))
        except Exception as e:  # noqa: BLE001 — report, go on
            print(f"ctx {ctx} N {n}: {type(e).__name__}: {str(e)[:400]}", flush=True)
            rows.append(dict(ctx=ctx, n=n, error=f"{type(e).__name__}: {str(e)[:400]}"))
        torch.cuda.empty_cache()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(matmul_TFLOPs=mm / 1e12, rows=rows), indent=1))


if __name__ == "__main__":
    main()
