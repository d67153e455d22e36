"""The combine kernels of the tree attention: log-sum-exp merge of the per-part partial results.

Three kernels, one result; `configs.combine_shot_rows` and `configs.combine_rows_block` pick one
per plan. `_combine_shot_kernel` (the measured long-context 64-row plans): BLOCK_R rows a
program, every part's LSE and O in one round — a grid small and light enough to sit, launched
early, beside a one-CTA-per-SM attention kernel (BENCHMARKS.md, "a resident combine").
`_combine_rows_kernel` (few parts, ≤ configs.COMBINE_ROWS_MAX_PARTS): each program takes BLOCK_R
consecutive (token, q head) rows of the contiguous partials `[parts, T·Hq, D]` and merges the
parts online, one [BLOCK_R, D] tile per part; the loads of different parts do not depend on
each other (an empty part's O is loaded and discarded), and a handful of programs per SM
replaces one per (token, head) — at 1k context for a 65-node tree (2080 rows, 5 parts) 520
four-row programs instead of 2080 one-row ones (BENCHMARKS.md, "Short-context verify: the combine
by row blocks").
`_combine_kernel` (many parts: 32k-128k contexts split 16-64 ways), grid (token, q head): one
program per row, ONE_SHOT (S + 1 ≤ BLOCK_S, the common case): every part's LSE and partial O
in one round of loads. Otherwise all LSEs in one load, then the partials in chunks of BLOCK_S
parts (independent loads, no serial chain). Parts with lse = −inf (empty splits, e.g. a graph
planned for a long context replayed at a short one) load no partial O. With USE_PDL either
kernel is launched as a programmatic dependent of the attention kernel: it becomes resident
while that kernel runs and waits (griddepcontrol.wait) for its results, so the launch gap
between the two is hidden. `merge_pair` (`_merge_pair_kernel`) merges two results given as
separate tensors with natural-log LSEs — the two halves of a prefill chunk from a library
attention kernel (specserve/attention/prefill.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

from specserve.kernels.tree_attention import fix_interpreter_index


@triton.jit
def _pdl_enter(USE_PDL: tl.constexpr, TRIGGER_FIRST: tl.constexpr):
    """Programmatic dependent launch: wait for the kernel before (its results are then
    complete and visible) and let the next kernel launch. TRIGGER_FIRST lets it launch before
    the wait, so its programs can become resident while this one waits."""
    if USE_PDL:
        if TRIGGER_FIRST:
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
        if not TRIGGER_FIRST:
            tl.extra.cuda.gdc_launch_dependents()


@triton.jit(do_not_specialize=["num_parts", "stride_ls", "stride_lt"])
def _combine_kernel(
    OPart, LsePart, Out, num_parts,
    stride_os, stride_ot, stride_oh, stride_ls, stride_lt, stride_qt, stride_qh,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, LSE_BLOCK: tl.constexpr,
    ONE_SHOT: tl.constexpr, USE_PDL: tl.constexpr, TRIGGER_FIRST: tl.constexpr,
):
    _pdl_enter(USE_PDL, TRIGGER_FIRST)  # then the attention kernel's partials are visible
    t = tl.program_id(0)
    hd = tl.program_id(1)
    lse_base = LsePart + t * stride_lt + hd
    o_base = OPart + t * stride_ot + hd * stride_oh
    offs_d = tl.arange(0, HEAD_DIM)
    if ONE_SHOT:
        offs_s = tl.arange(0, BLOCK_S)
        smask = offs_s < num_parts
        lse = tl.load(lse_base + offs_s * stride_ls, mask=smask, other=float("-inf"))
        live = lse > float("-inf")  # empty parts (short contexts, graph plans) read no O
        o = tl.load(o_base + offs_s[:, None] * stride_os + offs_d[None, :], mask=live[:, None],
                    other=0.0)  # [BLOCK_S, HEAD_DIM]
        m = tl.max(lse, 0)
        w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
        l_sum = tl.sum(w, 0)
        acc = tl.sum(o * w[:, None], 0)
    else:
        offs_all = tl.arange(0, LSE_BLOCK)  # every part's LSE at once (LSE_BLOCK ≥ num_parts)
        lse_all = tl.load(lse_base + offs_all * stride_ls, mask=offs_all < num_parts,
                          other=float("-inf"))
        m = tl.max(lse_all, 0)
        m = tl.where(m == float("-inf"), 0.0, m)
        l_sum = tl.sum(tl.exp2(lse_all - m), 0)
        offs_s = tl.arange(0, BLOCK_S)
        acc = tl.zeros([HEAD_DIM], tl.float32)
        for s0 in range(0, num_parts, BLOCK_S):  # independent loads: no chain through `acc`
            sp = s0 + offs_s
            smask = sp < num_parts
            lse = tl.load(lse_base + sp * stride_ls, mask=smask, other=float("-inf"))
            w = tl.exp2(lse - m)
            o = tl.load(o_base + sp[:, None] * stride_os + offs_d[None, :],
                        mask=(lse > float("-inf"))[:, None], other=0.0)
            acc += tl.sum(o * w[:, None], 0)
    out = acc / tl.where(l_sum > 0.0, l_sum, 1.0)
    tl.store(Out + t * stride_qt + hd * stride_qh + offs_d, out.to(Out.dtype.element_ty))


@triton.jit(do_not_specialize=["num_parts", "n_rows", "stride_os", "stride_ls"])
def _combine_rows_kernel(
    OPart, LsePart, Out, num_parts, n_rows, stride_os, stride_ls,
    HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, USE_PDL: tl.constexpr,
    TRIGGER_FIRST: tl.constexpr,
):
    """BLOCK_R consecutive (token, q head) rows of contiguous partials `[parts, T·Hq, D]`, the
    parts merged online; loads of different parts are independent (no LSE → O chain)."""
    _pdl_enter(USE_PDL, TRIGGER_FIRST)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    valid = rows < n_rows
    offs = rows[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]  # [BLOCK_R, HEAD_DIM]
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, HEAD_DIM], tl.float32)
    for p in range(num_parts):
        lse = tl.load(LsePart + p * stride_ls + rows, mask=valid, other=float("-inf"))
        o = tl.load(OPart + p * stride_os + offs, mask=valid[:, None], other=0.0)
        m_new = tl.maximum(m, lse)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_use)
        w = tl.exp2(lse - m_use)
        live = (lse > float("-inf"))[:, None]  # an empty part's O (maybe never written) adds 0
        acc = acc * alpha[:, None] + tl.where(live, o * w[:, None], 0.0)
        l_sum = l_sum * alpha + w
        m = m_new
    out = acc / tl.where(l_sum > 0.0, l_sum, 1.0)[:, None]
    tl.store(Out + offs, out.to(Out.dtype.element_ty), mask=valid[:, None])


@triton.jit(do_not_specialize=["num_parts", "n_rows", "stride_os", "stride_ls"])
def _combine_shot_kernel(
    OPart, LsePart, Out, num_parts, n_rows, stride_os, stride_ls,
    HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr,
    USE_PDL: tl.constexpr, TRIGGER_FIRST: tl.constexpr,
):
    """BLOCK_R consecutive (token, q head) rows of contiguous partials `[parts, T·Hq, D]`, every
    part's LSE and O in one round of loads (parts ≤ BLOCK_S): a small grid, each program
    light enough to sit beside a one-CTA-per-SM attention kernel while it runs."""
    _pdl_enter(USE_PDL, TRIGGER_FIRST)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    valid = rows < n_rows
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    m2 = valid[:, None] & (offs_s < num_parts)[None, :]  # [BLOCK_R, BLOCK_S]
    lse = tl.load(LsePart + offs_s[None, :] * stride_ls + rows[:, None], mask=m2,
                  other=float("-inf"))
    o_off = offs_s[None, :, None] * stride_os + rows[:, None, None] * HEAD_DIM + offs_d
    o = tl.load(OPart + o_off, mask=m2[:, :, None], other=0.0)  # not waiting for the LSEs
    live = (lse > float("-inf"))[:, :, None]
    m = tl.max(lse, 1)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m)[:, None])
    l_sum = tl.sum(w, 1)
    acc = tl.sum(tl.where(live, o, 0.0) * w[:, :, None], 1)  # an empty part may hold garbage
    out = acc / tl.where(l_sum > 0.0, l_sum, 1.0)[:, None]
    tl.store(Out + rows[:, None] * HEAD_DIM + offs_d[None, :], out.to(Out.dtype.element_ty),
             mask=valid[:, None])


def _flat_rows(o_part, lse_part, out, kernel: str) -> int:
    """(token, head) rows of `out`, after checking the row-block combines' layout: `out` and
    each part of `o_part` / `lse_part` contiguous (the launcher's scratch and output are)."""
    if not out.is_cuda:
        fix_interpreter_index()
    t, hq, d = out.shape
    if not (out.is_contiguous() and o_part.stride()[1:] == (hq * d, d, 1)
            and lse_part.stride()[1:] == (hq, 1)):
        raise ValueError(f"{kernel} needs out and each part of o_part / lse_part contiguous")
    return t * hq


def combine_shot(o_part, lse_part, out, parts: int, block_r: int, use_pdl: bool,
                 trigger_first: bool = False) -> None:
    """`combine` by blocks of `block_r` rows, all parts in one round (`_combine_shot_kernel`);
    contiguous tensors as for `combine_rows`."""
    n_rows, d = _flat_rows(o_part, lse_part, out, "combine_shot"), out.shape[2]
    _combine_shot_kernel[(triton.cdiv(n_rows, block_r),)](
        o_part, lse_part, out, parts, n_rows, o_part.stride(0), lse_part.stride(0),
        HEAD_DIM=d, BLOCK_R=block_r, BLOCK_S=max(2, 1 << (parts - 1).bit_length()),
        USE_PDL=use_pdl, TRIGGER_FIRST=trigger_first, num_warps=4, num_stages=1,
        launch_pdl=use_pdl,
    )


def combine_rows(o_part, lse_part, out, parts: int, block_r: int, use_pdl: bool,
                 trigger_first: bool = False) -> None:
    """`combine` by blocks of `block_r` (token, head) rows; `o_part [≥parts, T, Hq, D]`,
    `lse_part [≥parts, T, Hq]` and `out [T, Hq, D]` contiguous (the launcher's scratch and
    output are)."""
    n_rows, d = _flat_rows(o_part, lse_part, out, "combine_rows"), out.shape[2]
    _combine_rows_kernel[(triton.cdiv(n_rows, block_r),)](
        o_part, lse_part, out, parts, n_rows, o_part.stride(0), lse_part.stride(0),
        HEAD_DIM=d, BLOCK_R=block_r, USE_PDL=use_pdl, TRIGGER_FIRST=trigger_first,
        num_warps=4, num_stages=2,
        launch_pdl=use_pdl,
    )


def combine(o_part, lse_part, out, parts: int, block_s: int, lse_block: int,
            use_pdl: bool, trigger_first: bool = False) -> None:
    """Merge `parts` partials `o_part [≥parts, T, Hq, D]`, `lse_part [≥parts, T, Hq]` into
    `out [T, Hq, D]`."""
    if not out.is_cuda:
        fix_interpreter_index()
    t, hq, d = out.shape
    _combine_kernel[(t, hq)](
        o_part, lse_part, out, parts,
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0),
        lse_part.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=d, BLOCK_S=block_s, LSE_BLOCK=lse_block, ONE_SHOT=parts <= block_s,
        USE_PDL=use_pdl, TRIGGER_FIRST=trigger_first, num_warps=4, num_stages=1,
        launch_pdl=use_pdl,
    )




_MERGE_INTS = ["n_rows", "s_o1t", "s_o1h", "s_o2t", "s_o2h", "s_l1t", "s_l1h", "s_l2t", "s_l2h",
               "s_ot", "s_oh"]


@triton.jit(do_not_specialize=_MERGE_INTS)  # one compile for every chunk length and layout
def _merge_pair_kernel(
    O1, L1, O2, L2, Out, n_rows,
    s_o1t, s_o1h, s_o2t, s_o2h, s_l1t, s_l1h, s_l2t, s_l2h, s_ot, s_oh,
    HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T] rows of head h
    h = tl.program_id(1)
    valid = t < n_rows
    offs_d = tl.arange(0, HEAD_DIM)
    l1 = tl.load(L1 + t * s_l1t + h * s_l1h, mask=valid, other=0.0)
    l2 = tl.load(L2 + t * s_l2t + h * s_l2h, mask=valid, other=0.0)
    m = tl.maximum(l1, l2)
    w1 = tl.exp(l1 - m)
    w2 = tl.exp(l2 - m)
    rows = valid[:, None]
    o1 = tl.load(O1 + t[:, None] * s_o1t + h * s_o1h + offs_d[None, :], mask=rows, other=0.0)
    o2 = tl.load(O2 + t[:, None] * s_o2t + h * s_o2h + offs_d[None, :], mask=rows, other=0.0)
    o = (o1.to(tl.float32) * w1[:, None] + o2.to(tl.float32) * w2[:, None]) / (w1 + w2)[:, None]
    tl.store(Out + t[:, None] * s_ot + h * s_oh + offs_d[None, :], o.to(Out.dtype.element_ty),
             mask=rows)


def merge_pair(o1, lse1, o2, lse2, out) -> None:
    """out `[T, H, D]` = the log-sum-exp merge of two normalised attention results over disjoint
    key sets: `o1`, `o2` `[T, H, D]` (any strides, head_dim contiguous) with natural-log LSEs
    `lse1`, `lse2` `[T, H]` (any strides; both finite — every row saw a key in each part)."""
    if not out.is_cuda:
        fix_interpreter_index()
    t, h, d = out.shape
    block_t = 16 if out.is_cuda else 512  # the interpreter pays per program: few, big ones
    _merge_pair_kernel[(triton.cdiv(t, block_t), h)](
        o1, lse1, o2, lse2, out, t,
        o1.stride(0), o1.stride(1), o2.stride(0), o2.stride(1), lse1.stride(0), lse1.stride(1),
        lse2.stride(0), lse2.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=d, BLOCK_T=block_t, num_warps=4,
    )


__all__ = ["combine", "combine_rows", "combine_shot", "merge_pair"]
