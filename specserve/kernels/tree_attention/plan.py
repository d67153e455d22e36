"""Launch planning of the tree attention: config, split count, grid and scratch per batch.

Owns `Plan` (everything about a launch that depends on the batch and the shapes, not on the
layer), `plan_launch` (made once per batch and memoised by the launcher in `batch.memo`) and
`scratch` (the batch's fp32 partial-result buffers, shared by every layer). The kernels and the
launcher are kernel.py; the tables and heuristics configs.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from specserve.kernels.tree_attention import fix_interpreter_index
from specserve.kernels.tree_attention.configs import (
    INTERPRET_CONFIG,
    ONE_CTA_CONFIG,
    Config,
    arch_key,
    combine_block_s,
    combine_rows_block,
    combine_shot_rows,
    ctas_per_sm,
    default_num_splits,
    one_cta_splits,
    pick_config,
    sm_count,
    tail_block_n,
    tail_row_words,
)

# Launcher options (A/B runs; the defaults are the measured choices): "pdl" — programmatic
# dependent launch on sm_90+; "row_words" — the tree tail's mask load (configs.tail_row_words);
# "combine_rows" — rows per program of the row-block combine, 0 for the per-row kernel
# (configs.combine_rows_block); "one_cta" — False keeps the table plan where the one-CTA plan
# would run (configs.one_cta_splits); "combine_shot" — rows per program of the one-round
# combine, 0 for none (configs.combine_shot_rows); "trigger_first" — the combine lets the next
# kernel launch before its wait (default: with the one-round combine).
OPTIONS = ("pdl", "row_words", "combine_rows", "one_cta", "combine_shot", "trigger_first")


@dataclass(frozen=True)
class Plan:
    """Everything about a launch that depends on the batch and the shapes, not on the layer."""

    config: Config
    grid: tuple[int, int, int]
    parts: int  # S prefix splits + the tree tail
    hkv: int
    window: int
    dot_prec: str
    tail_n: int
    block_s: int
    lse_block: int
    use_pdl: bool  # programmatic dependent launch (sm_90+): launch gaps hidden
    row_words: bool  # the tree tail's mask: one word per row per tile (configs.tail_row_words)
    combine_rows: int | None  # rows per program of the row-block combine; None: per-row kernel
    trigger_first: bool  # the combine lets the next kernel launch before its PDL wait
    combine_shot: int | None  # rows per program of the one-round combine; None: the others
    tree: torch.Tensor  # the batch's tree mask, or a dummy (cu_q) when causal


def plan_launch(q, k_pool, batch, sliding_window, num_splits, max_ctx_len, config, opts) -> Plan:
    unknown = set(opts) - set(OPTIONS)
    if unknown:
        raise ValueError(f"unknown tree-attention options {sorted(unknown)}; known: {OPTIONS}")
    t, hq, d = q.shape
    hkv = k_pool.shape[2]
    if not q.is_cuda:
        fix_interpreter_index()
    rows = max(batch.q_lens) * (hq // hkv)
    cap = torch.cuda.get_device_capability(q.device) if q.is_cuda else None
    arch = None if cap is None else arch_key(cap)
    use_pdl = bool(opts.get("pdl", True)) and cap is not None and cap[0] >= 9
    longest = max(batch.ctx_lens) if max_ctx_len is None else max_ctx_len
    # measured shapes only: the one-CTA plan and the one-round combine (configs) skip windows
    shape = (arch if sliding_window is None else None, d, rows, q.element_size(), longest)
    config, num_splits, shot = _choose(shape, batch.batch_size * hkv, sm_count(q.device),
                                       config, num_splits, opts, arch)
    nb = batch.batch_size
    row_blocks = triton.cdiv(rows, config.block_m)
    parts = int(num_splits) + 1
    dot_prec = "ieee" if q.dtype == torch.float32 else "tf32"
    if not q.is_cuda:
        dot_prec = "interpret"
    block_s, lse_block = combine_block_s(parts, d, fixed=q.is_cuda)
    return Plan(config=config, grid=(row_blocks, nb * hkv, parts), parts=parts, hkv=hkv,
                 window=int(sliding_window) if sliding_window is not None else 0,
                 dot_prec=dot_prec, tail_n=tail_block_n(config), block_s=block_s,
                 lse_block=lse_block, use_pdl=use_pdl,
                 row_words=bool(opts.get("row_words", tail_row_words(arch, config))),
                 combine_rows=combine_rows_block(parts, opts.get("combine_rows")),
                 combine_shot=int(shot) if shot else None,
                 trigger_first=bool(opts.get("trigger_first", bool(shot))) and use_pdl,
                 tree=batch.tree_mask if batch.tree_mask is not None else batch.cu_q)


def _choose(shape, heads, sms, config, num_splits, opts, arch) -> tuple[Config, int, int | None]:
    """(config, splits, rows of the one-round combine or None) for `shape` = (arch or None when
    no measured plan applies, head_dim, rows, element size, longest context), `heads`
    (requests · KV heads) and the device's `arch` (None: the CPU interpreter): the one-CTA plan
    where it was measured faster and nothing is forced, else the table's config and the split
    heuristic."""
    _, d, rows, elem, longest = shape
    one_cta = None
    if config is None and num_splits is None and opts.get("one_cta", True):
        one_cta = one_cta_splits(*shape, heads, sms)
    if one_cta is not None:
        config, num_splits = ONE_CTA_CONFIG, one_cta
    elif config is None:
        config = INTERPRET_CONFIG if arch is None else pick_config(arch, d, rows, elem, longest)
    programs = heads * triton.cdiv(rows, config.block_m)
    if num_splits is None:
        num_splits = default_num_splits(longest, rows, programs, sms, ctas_per_sm(config))
    shot = opts.get("combine_shot",
                    combine_shot_rows(*shape, programs, sms, config == ONE_CTA_CONFIG))
    if shot and (int(shot) < 1 or int(shot) & (int(shot) - 1)):
        raise ValueError(f"combine_shot must be a power of two (rows a program), got {shot}")
    return config, int(num_splits), shot


def scratch(batch, parts, t, hq, d, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's fp32 partial O `[parts, T, Hq, D]` and LSE `[parts, T, Hq]` (grown on demand;
    plans with fewer parts use a leading slice — same strides, same base). Partials in the input
    dtype were measured slower on the H200 (the store's conversion; BENCHMARKS.md, "Tree-verify
    attention kernel — third H200 run") and made ptxas spill on sm_120."""
    key = ("scratch", t, hq, d, device)
    got = batch.memo.get(key)
    if got is None or got[0].shape[0] < parts:
        got = batch.memo[key] = (
            torch.empty((parts, t, hq, d), dtype=torch.float32, device=device),
            torch.empty((parts, t, hq), dtype=torch.float32, device=device))
    if got[0].shape[0] == parts:
        return got
    return got[0][:parts], got[1][:parts]
