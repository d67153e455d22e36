"""Tree kernel with the merge inside it, and per-CTA timelines (H200 diagnostic, issues 5 and 9).

Three questions, one harness (bench_kernel.py's pools rotated beyond L2, 36-call CUDA graphs):
1. **Where a call's time goes**: each CTA of the attention kernel stamps %globaltimer when it
   became resident, at its start (after its PDL wait), when its part is done and (fused) when
   its merge is done, with its %smid — the ramp (last start − first), the drain (last end −
   median end), the merge, and how long after one call's last CTA the next call's CTAs were
   resident and started (each call of a graph cycle has its own stamps).
2. **A fused merge**: every CTA writes its partial and arrives at a per-(row block, request · kv
   head) counter; the last K to arrive (extra `last_k`; all of them by default) wait until
   all parts have arrived (a spin on an acquire load: every CTA of the one-wave grid is
   resident), then merge a share of the block's rows from L2 — no combine kernel; the others
   leave at once, and with `early` the next call, launched at this one's start, takes their
   SMs. The last merger out resets the counters for the next call.
3. **A bound**: extra `no_merge` leaves the partials unmerged (wrong output, printed anyway):
   the attention kernel alone, each call a direct dependent of the one before.
(Work stealing of the prefix's end was measured with this script at commit ea5a13e, the next
call's first prefix tiles prefetched into L2 before its wait at fdc6540; both removed:
BENCHMARKS.md, "per-CTA timelines" and "a no-merge bound".)

    PYTHONPATH=.:bench python experiments/diag_fused_merge.py [--out PATH]
        [--shapes "[(32768, 16)]"] [--variants "..."]

A variant: (name, fuse, cooperative launch, num_splits or None, config tuple or None[, extras])
with extras a dict of `last_k`, `early`, `no_merge` and launcher options (plan.OPTIONS, e.g.
{'combine_shot': 4}). Rows give µs per call next to the production launcher in the same run,
the max |diff| vs production and the error vs an fp32 reference (after ≥ 1000 graph calls
too). `split_timed` (no fusion) is the production kernel's arithmetic plus its combine.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import triton
import triton.language as tl

from specserve.kernels.tree_attention.kernel import _attend

STAMPS: tl.constexpr = tl.constexpr(5)  # per CTA: start, done, merged, smid, resident

VARIANTS = ("[('fused', True, True, None, None), ('fused_nocoop', True, False, None, None), "
            "('split_timed', False, False, None, None)]")


@triton.jit
def _now():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _smid():
    return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _merge_share(OPart, LsePart, Out, h, q0, n_rows, row0, share, n_shares, num_parts,
                 stride_os, stride_ot, stride_oh, stride_ls, stride_lt, stride_qt, stride_qh,
                 GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                 PB: tl.constexpr, MR: tl.constexpr):
    """Rows [row0 + share·per, …) of the block (per = cdiv(rows, n_shares)): all parts'
    partials (from L2, .cg: other SMs wrote them) merged and stored in the output dtype."""
    n_blk = tl.minimum(BLOCK_M, n_rows - row0)
    per = tl.cdiv(n_blk, n_shares)
    lo = row0 + share * per
    hi = tl.minimum(lo + per, row0 + n_blk)
    offs_p = tl.arange(0, PB)
    pmask = offs_p < num_parts
    offs_d = tl.arange(0, HEAD_DIM)
    for r0 in range(lo, hi, MR):
        r = r0 + tl.arange(0, MR)
        rmask = r < hi
        t = q0 + r // GROUP
        hd = h * GROUP + r % GROUP
        m2 = rmask[:, None] & pmask[None, :]
        lse = tl.load(LsePart + offs_p[None, :] * stride_ls + (t * stride_lt + hd)[:, None],
                      mask=m2, other=float("-inf"), cache_modifier=".cg")  # [MR, PB]
        o_off = (offs_p[None, :, None] * stride_os + (t * stride_ot + hd * stride_oh)[:, None, None]
                 + offs_d[None, None, :])
        o = tl.load(OPart + o_off, mask=m2[:, :, None], other=0.0,
                    cache_modifier=".cg")  # [MR, PB, HEAD_DIM], not waiting for the LSEs
        o = tl.where((lse > float("-inf"))[:, :, None], o, 0.0)
        m = tl.max(lse, 1)
        m = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp2(lse - m[:, None])
        l_sum = tl.sum(w, 1)
        out = tl.sum(o * w[:, :, None], 1) / tl.where(l_sum > 0.0, l_sum, 1.0)[:, None]
        o_ptr = Out + t[:, None] * stride_qt + hd[:, None] * stride_qh + offs_d[None, :]
        tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=rmask[:, None])


_NO_SPEC = ["window", "h_kv", "stride_bt", "stride_mt", "stride_ls", "stride_lt", "num_parts",
            "n_merge"]


@triton.jit
def _merge_last(OPart, LsePart, Out, Sync, h, q0, n_rows, row0, n_merge, num_parts, t_done,
                stride_os, stride_ot, stride_oh, stride_ls, stride_lt, stride_qt, stride_qh,
                GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                PB: tl.constexpr, MR: tl.constexpr):
    """Arrive at the block's counter (Sync[0]) once this CTA's partial is written; the last
    `n_merge` to arrive wait for all `num_parts`, merge a share of the block's rows each, and
    the last of them out resets the counters. Returns when this CTA's merge ended."""
    tl.debug_barrier()  # every thread's partial stores precede the release below
    ticket = tl.atomic_add(Sync, 1, sem="acq_rel", scope="gpu")
    t_merged = t_done
    if ticket >= num_parts - n_merge:
        seen = tl.atomic_add(Sync, 0, sem="acquire", scope="gpu")
        while seen < num_parts:
            seen = tl.atomic_add(Sync, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()
        if row0 < n_rows:
            _merge_share(OPart, LsePart, Out, h, q0, n_rows, row0, ticket - (num_parts - n_merge),
                         n_merge, num_parts, stride_os, stride_ot, stride_oh, stride_ls,
                         stride_lt, stride_qt, stride_qh, GROUP, HEAD_DIM, BLOCK_M, PB, MR)
        t_merged = _now()
        gone = tl.atomic_add(Sync + 1, 1, sem="acq_rel", scope="gpu")
        if gone == n_merge - 1:  # the last merger out: every merger has passed the wait
            tl.atomic_xchg(Sync, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(Sync + 1, 0, sem="relaxed", scope="gpu")
    return t_merged


@triton.jit(do_not_specialize=_NO_SPEC)
def _fused_kernel(
    Q, K, V, BlockTable, CuQ, CtxLens, Positions, TreeMask, OPart, LsePart, Out, Sync, Times,
    sm_scale_log2, window, h_kv, num_parts, n_merge,
    stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_bt, stride_mt,
    stride_os, stride_ot, stride_oh, stride_ls, stride_lt, stride_out_t, stride_out_h,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TAIL_N: tl.constexpr,
    HAS_TREE: tl.constexpr, DOT_PREC: tl.constexpr, ROW_WORDS: tl.constexpr,
    FUSE: tl.constexpr, PB: tl.constexpr, MR: tl.constexpr, USE_PDL: tl.constexpr,
    EARLY: tl.constexpr,
):
    t_resident = _now()
    rb = tl.program_id(0)
    bh = tl.program_id(1)
    part = tl.program_id(2)
    n_rb = tl.num_programs(0)
    b = bh // h_kv
    h = bh % h_kv
    q0 = tl.load(CuQ + b)
    q_len = tl.load(CuQ + b + 1) - q0
    row0 = rb * BLOCK_M
    idx = bh * n_rb + rb
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        if EARLY or not FUSE:  # fused + EARLY: the next call may fill SMs as CTAs leave
            tl.extra.cuda.gdc_launch_dependents()
    t_start = _now()
    if row0 < q_len * GROUP:
        _attend(Q, K, V, BlockTable, CtxLens, Positions, TreeMask, OPart, LsePart,
                sm_scale_log2, window, b, h, q0, q_len, row0, part, num_parts - 1,
                stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_bt, stride_mt,
                stride_os, stride_ot, stride_oh, stride_ls, stride_lt,
                GROUP, HEAD_DIM, PAGE_SIZE, BLOCK_M, BLOCK_N, TAIL_N, False, HAS_TREE,
                False, DOT_PREC, ROW_WORDS)
    t_done = _now()
    t_merged = t_done
    if FUSE:  # the last n_merge CTAs to arrive merge; the others leave at once
        t_merged = _merge_last(OPart, LsePart, Out, Sync + idx * 4, h, q0, q_len * GROUP, row0,
                               n_merge, num_parts, t_done, stride_os, stride_ot, stride_oh,
                               stride_ls, stride_lt, stride_out_t, stride_out_h, GROUP, HEAD_DIM,
                               BLOCK_M, PB, MR)
    cta = (part * tl.num_programs(1) + bh) * n_rb + rb
    tl.store(Times + cta * STAMPS, t_start)
    tl.store(Times + cta * STAMPS + 1, t_done)
    tl.store(Times + cta * STAMPS + 2, t_merged)
    tl.store(Times + cta * STAMPS + 3, _smid().to(tl.int64))
    tl.store(Times + cta * STAMPS + 4, t_resident)


def _launch(q, k_pool, v_pool, batch, scale, out, variant, sync, times):
    """One call of a variant: the fused kernel (merge inside) or it + the production combine."""
    import specserve.kernels.tree_attention.kernel as kmod
    from specserve.kernels.tree_attention.configs import Config
    from specserve.kernels.tree_attention.plan import OPTIONS, plan_launch, scratch

    _, fuse, coop, splits, cfg, *more = variant
    extra = dict(more[0]) if more else {}  # last_k, early, no_merge, launcher options
    opts = {k: v for k, v in extra.items() if k in OPTIONS}  # launcher options (the combine)
    key = ("diag_fused", q.shape, splits, cfg, tuple(sorted(opts.items())))
    plan = batch.memo.get(key)
    if plan is None:
        plan = batch.memo[key] = plan_launch(q, k_pool, batch, None, splits,
                                             None, Config(*cfg) if cfg else None, opts)
    o_part, lse_part = scratch(batch, plan.parts, *q.shape, q.device)
    c, d = plan.config, q.shape[2]
    pb = 1 << (plan.parts - 1).bit_length()
    n_merge = min(extra.get("last_k") or plan.parts, plan.parts)  # CTAs that merge a block
    per = -(-min(c.block_m, max(batch.q_lens) * q.shape[1] // plan.hkv) // n_merge)
    mr = max(1, min(1 << (per - 1).bit_length(), 16384 // (pb * d)))  # one round if it fits
    kmod.LAST_LAUNCH["fused"] = _fused_kernel[plan.grid](
        q, k_pool, v_pool, batch.block_table, batch.cu_q, batch.ctx_lens_t, batch.positions,
        plan.tree, o_part, lse_part, out, sync, times, scale * kmod.LOG2E, 0, plan.hkv,
        plan.parts, n_merge, q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1),
        k_pool.stride(2), batch.block_table.stride(0), plan.tree.stride(0), o_part.stride(0),
        o_part.stride(1), o_part.stride(2), lse_part.stride(0), lse_part.stride(1),
        out.stride(0), out.stride(1),
        GROUP=q.shape[1] // plan.hkv, HEAD_DIM=d, PAGE_SIZE=k_pool.shape[1], BLOCK_M=c.block_m,
        BLOCK_N=c.block_n, TAIL_N=plan.tail_n, HAS_TREE=batch.tree_mask is not None,
        DOT_PREC=plan.dot_prec, ROW_WORDS=plan.row_words, FUSE=fuse,
        PB=pb, MR=mr, USE_PDL=plan.use_pdl, EARLY=bool(extra.get("early", False)),
        num_warps=c.num_warps, num_stages=c.num_stages, launch_pdl=plan.use_pdl,
        launch_cooperative_grid=coop)
    if not fuse and not extra.get("no_merge"):  # no_merge: a bound (partials left unmerged)
        kmod.merge(plan, o_part, lse_part, out)
    return out, plan


def _stamps(times, n: int):
    """The first `n` CTAs' stamps as float64 [n, STAMPS] (host)."""
    import numpy as np

    return times.view(-1, STAMPS.value)[:n].cpu().numpy().astype(np.float64)


def _timeline(times, plan, fused: bool) -> dict:
    """µs stats of one call's CTA stamps, relative to the first start: the prefix splits' and
    the tree tails' (part S, the last grid[0]·grid[1] CTAs) end times and work spans."""
    import numpy as np

    n_tail = plan.grid[0] * plan.grid[1]
    n = n_tail * plan.grid[2]
    t = _stamps(times, n)
    t0 = t[:, 0].min()
    start, done, merged = (t[:, 0] - t0) / 1e3, (t[:, 1] - t0) / 1e3, (t[:, 2] - t0) / 1e3
    work = done - start
    span = float(done.max())
    pre, tail = slice(0, n - n_tail), slice(n - n_tail, n)
    slots = len(np.unique(t[:, 3])) * (2 if plan.config.block_m <= 64 else 1)
    pct = (lambda x, q: float(np.percentile(x, q)) if len(x) else None)  # noqa: E731
    out = dict(ctas=n, sms=int(len(np.unique(t[:, 3]))), ramp_us=float(start.max()),
               prefix_done_p10_us=pct(done[pre], 10), prefix_done_median_us=pct(done[pre], 50),
               prefix_done_max_us=pct(done[pre], 100), prefix_work_median_us=pct(work[pre], 50),
               tail_done_max_us=pct(done[tail], 100), tail_work_median_us=pct(work[tail], 50),
               done_max_us=span, busy_frac=float(work.sum() / (slots * span)) if span else None)
    if fused:
        out.update(merge_us=float(merged.max() - span), end_us=float(merged.max()))
    resident = (t[:, 4] - t0) / 1e3
    out.update(resident_p10_us=pct(resident, 10), resident_median_us=pct(resident, 50),
               resident_max_us=pct(resident, 100))
    return out


def _handoff(prev, cur, n: int) -> dict:
    """Between two consecutive calls' stamps (int64 [≥ n·5]): how long after the previous
    call's last CTA ended the next call's CTAs were resident and started (µs; negative: before
    it ended, i.e. overlapped)."""
    import numpy as np

    p, c = _stamps(prev, n), _stamps(cur, n)
    end = max(p[:, 1].max(), p[:, 2].max())
    return dict(next_resident_median_us=float((np.median(c[:, 4]) - end) / 1e3),
                next_start_first_us=float((c[:, 0].min() - end) / 1e3),
                next_start_median_us=float((np.median(c[:, 0]) - end) / 1e3),
                prev_done_median_to_end_us=float((end - np.median(p[:, 1])) / 1e3))


def compile_check() -> list[dict]:
    """The one-wave premise of the fused merge on sm_90: two 64-row CTAs per SM (shared memory
    ≤ 116,736 B each, registers ≤ 255) and no spills, with the merge's largest tiles."""
    import bench_kernel as bk

    ptr_types = dict(bk._PTR_TYPES, Sync="*i32", Times="*i64")
    bk._PTR_TYPES = ptr_types
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    out = []
    for fuse, pb, mr in [(True, 64, 2), (True, 8, 16), (False, 64, 2)]:
        cons = dict(GROUP=4, HEAD_DIM=128, PAGE_SIZE=16, BLOCK_M=64, BLOCK_N=64, TAIL_N=32,
                    HAS_TREE=True, DOT_PREC="tf32", ROW_WORDS=True, FUSE=fuse, PB=pb, MR=mr,
                    USE_PDL=True, EARLY=fuse)
        got = bk._compile(_fused_kernel, "bf16", cons, 4, 5, 90, str(ptxas))
        out.append(dict(fuse=fuse, parts_block=pb, merge_rows=mr, **got))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", default="[(1024, 65), (1024, 17), (4096, 65), (32768, 16), "
                                        "(32768, 1), (131072, 16), (131072, 1)]")
    ap.add_argument("--variants", default=VARIANTS, help="see the module docstring")
    ap.add_argument("--compile-check", action="store_true",
                    help="no GPU: cross-compile the fused and unfused kernel for sm_90 (64-row "
                         "block, 33 / 5 parts) and print shared memory, registers, spills")
    args = ap.parse_args()
    if args.compile_check:
        print(json.dumps(compile_check()))
        return

    import numpy as np
    import torch
    from bench_kernel import _copy_bw, _point
    from diag_kernel import _graph_us

    import specserve.kernels.tree_attention.kernel as kmod
    from specserve.kernels.tree_attention.configs import ctas_per_sm, sm_count
    from specserve.kernels.tree_attention.ref import tree_attention_ref

    hq, hkv, d, page = 32, 8, 128, 16
    copy_bw = _copy_bw(torch, triton)
    print(f"# {torch.cuda.get_device_name()}: copy {copy_bw / 1e9:.0f} GB/s")
    print("| ctx | N | variant | S | floor µs | graph×36 µs | % floor | diff vs prod | rel err | "
          "after graphs | ramp | prefix done p10 / med / max | tail done max | busy | merge | "
          "next call resident (median) / started, after this one ends |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for ctx, n in eval(args.shapes):  # noqa: S307 — our own CLI
        sets = _point(ctx, n, hq, hkv, page, True, 7, torch, np)
        qs = [torch.randn(n, hq, d, device="cuda", dtype=torch.bfloat16) for _ in sets]
        prod = [lambda q=q, s=s: kmod.tree_attention_triton(q, *s, d**-0.5)
                for q, s in zip(qs, sets, strict=True)]
        want = prod[0]()
        ref = tree_attention_ref(qs[0], *sets[0], d**-0.5).float()
        floor = 2 * ctx * hkv * d * 2 / copy_bw * 1e6
        g_prod = _graph_us(prod, 12, torch)
        rows.append(dict(ctx=ctx, n=n, variant="production", floor_us=floor, graph36_us=g_prod))
        print(f"| {ctx} | {n} | production | auto | {floor:.1f} | {g_prod:.1f} | "
              f"{100 * floor / g_prod:.0f}% | 0 | | | | | | | |", flush=True)
        for variant in eval(args.variants):  # noqa: S307
            row = _variant_row(variant, ctx, n, sets, qs, want, ref, floor, torch, _graph_us,
                               ctas_per_sm, sm_count)
            rows.append(row)
        del sets, qs, prod
        torch.cuda.empty_cache()
    out = Path(args.out or Path(os.environ.get("OUT", ".")) / "diag_fused_merge.json")
    out.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), copy_GBps=copy_bw / 1e9,
                                   rows=rows), separators=(",", ":")))  # stamps: compact
    print(f"wrote {out}")


def _variant_row(variant, ctx, n, sets, qs, want, ref, floor, torch, graph_us, ctas_per_sm,
                 sm_count) -> dict:
    import specserve.kernels.tree_attention.kernel as kmod

    name, fuse = variant[0], variant[1]
    d = qs[0].shape[2]
    outs = [torch.empty_like(q) for q in qs]
    n_sync = 4 * 8 * 64 * 8  # ≥ 4 ints per (row block, request · kv head)
    sync = torch.zeros(n_sync, dtype=torch.int32, device="cuda")
    times = [torch.zeros(STAMPS.value * 65536, dtype=torch.int64, device="cuda") for _ in qs]
    row = dict(ctx=ctx, n=n, variant=name, spec=repr(variant), floor_us=floor)
    try:
        _, plan = _launch(qs[0], *sets[0], d**-0.5, outs[0], variant, sync, times[0])
        ctas = plan.grid[0] * plan.grid[1] * plan.grid[2]
        if fuse and not variant[2] and ctas > sm_count(qs[0].device) * ctas_per_sm(plan.config):
            print(f"| {ctx} | {n} | {name} | skipped: {ctas} CTAs > one wave |")
            return row | dict(skipped=f"{ctas} CTAs > one wave")
        calls = [lambda q=q, s=s, o=o, t=t: _launch(q, *s, d**-0.5, o, variant, sync, t)
                 for q, s, o, t in zip(qs, sets, outs, times, strict=True)]
        torch.cuda.synchronize()
        got = outs[0].clone()
        g36 = graph_us(calls, 12, torch)
        torch.cuda.synchronize()
        tl_stats = _timeline(times[1], plan, fuse)  # a call with a call before it
        tl_stats.update(_handoff(times[0], times[1], ctas))
        outs[0].fill_(float("nan"))
        calls[0]()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 — a variant that does not build: say so, go on
        print(f"| {ctx} | {n} | {name} | failed: {e!r:.300} |", flush=True)
        return row | dict(error=repr(e)[:2000])
    diff = float((got.float() - want.float()).abs().max())
    err = float((got.float() - ref).abs().max() / ref.abs().max())
    after = float((outs[0].float() - got.float()).abs().max())
    row.update(splits=plan.parts - 1, graph36_us=g36, pct_floor=100 * floor / g36, max_diff=diff,
               rel_err=err, diff_after_graphs=after, timeline=tl_stats,
               n_regs=getattr(kmod.LAST_LAUNCH["fused"], "n_regs", None),
               n_spills=getattr(kmod.LAST_LAUNCH["fused"], "n_spills", None),
               stamps=[t[:STAMPS.value * ctas].tolist() for t in times[:2]])
    s = tl_stats
    print(f"| {ctx} | {n} | {name} | {plan.parts - 1} | {floor:.1f} | {g36:.1f} | "
          f"{row['pct_floor']:.0f}% | {diff:.1e} | {err:.1e} | {after:.1e} | {s['ramp_us']:.1f} | "
          f"{s['prefix_done_p10_us'] or 0:.1f} / {s['prefix_done_median_us'] or 0:.1f} / "
          f"{s['prefix_done_max_us'] or 0:.1f} | {s['tail_done_max_us'] or 0:.1f} | "
          f"{s['busy_frac']:.2f} | {s.get('merge_us', 0):.1f} | "
          f"{s['next_resident_median_us']:.1f} / {s['next_start_first_us']:.1f} |", flush=True)
    return row


if __name__ == "__main__":
    main()
