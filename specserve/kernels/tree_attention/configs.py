"""Launch-config tables of the tree-attention kernels, per GPU arch.

Owns the (BLOCK_M, BLOCK_N, num_warps, num_stages) choice keyed by `(arch, head_dim, rows bucket)`
where rows = max new tokens × GQA group (the packed query rows of one KV head). sm_90 (H200,
227 KB shared memory, wgmma for BLOCK_M ≥ 64) and sm_120 (RTX PRO 6000 / RTX 50xx: mma.sync only,
101,376 B of shared memory per block — every entry must fit, `bench/bench_kernel.py --sm120-check`
cross-compiles them all). Under TRITON_INTERPRET=1 (CPU) small tiles keep the interpreter quick.
The sm_90 D = 128 entries and the split heuristic are tuned on an H200 (experiments/
sweep_kernel.py; BENCHMARKS.md, the "Tree-verify attention kernel" sections); the rest fit the
cross-compile checks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SM120_SMEM_LIMIT = 101_376  # bytes of shared memory per block on sm_120 / sm_121
ROW_BUCKETS = (16, 32, 64, 128)  # packed query rows per KV head, rounded up (last = "more")
# Plans for contexts ≤ this are latency-bound: > 64 rows use the 64-row bucket's config (2 CTAs
# per SM) instead of the 128-row one and may split into chunks as short as a quarter of the
# context (H200, 1k context, sweep run 7: BENCHMARKS.md, "Tree-verify kernel — row-block and
# engine-tree sweeps"). The engine's CUDA graphs plan a class of short steps for it
# (specserve/engine/graphs.py).
SHORT_CONTEXT = 4096


@dataclass(frozen=True)
class Config:
    block_m: int  # packed (token, q head) rows per program
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int


# {head_dim: {rows bucket: Config}}; a bucket covers rows ≤ its key (the last one: all larger).
# num_stages and the paged gather: the K/V addresses come from a block-table load, so Triton's
# pipeliner gives each load (num_stages − 1) // 2 iterations of latency — 3 stages prefetch
# nothing (wait-all every tile), 5 keep two K/V tiles in flight, 7 three.
_SM90 = {
    64: {16: Config(16, 64, 4, 5), 32: Config(32, 64, 4, 5), 64: Config(64, 64, 4, 5),
         128: Config(128, 64, 8, 5)},
    # tuned on the H200 (experiments/sweep_kernel.py): 64 rows (64, 64, 4, 5) at S = 32; 256/1024
    # rows (128, 128, 8, 5) ahead of (128, 64, 8, 5) (230 KB shared, 1 CTA/SM, 2 B of spill).
    # BENCHMARKS.md, "Tree-verify attention kernel — second H200 run" and "Figures formerly in
    # source comments"
    128: {16: Config(16, 64, 4, 5), 32: Config(32, 64, 4, 5), 64: Config(64, 64, 4, 5),
          128: Config(128, 128, 8, 5)},
    256: {16: Config(16, 32, 8, 5), 32: Config(32, 32, 8, 5), 64: Config(32, 32, 8, 5),
          128: Config(32, 32, 8, 5)},  # (64, 32, 8, 5) spills 84 B on sm_90a
}
# sm_120: ≤ 101,376 B of shared memory per block; D ≥ 128 uses 8 warps (K/V tiles pass through
# registers: 4 warps spilled in the cross-compile check).
# Cross-compile checked (bench_kernel.py --sm120-check, page 16 / 64 / 1 + sliding): spill-free
# replacements of (16, 64, 8, 5) at D = 128 (16 B at page 64) and (32, 32, 8, 3) at D = 256 (20 B
# in the sliding variant; (32, 32, 8, 4) too).
_SM120 = {
    64: {16: Config(16, 64, 4, 5), 32: Config(32, 64, 4, 5), 64: Config(64, 32, 4, 5),
         128: Config(64, 64, 8, 5)},
    128: {16: Config(16, 64, 4, 5), 32: Config(32, 32, 8, 5), 64: Config(64, 16, 8, 5),
          128: Config(64, 16, 8, 5)},  # (64, 32, 8, 5) spills 16 B
    256: {16: Config(16, 32, 8, 3), 32: Config(32, 16, 8, 5), 64: Config(32, 16, 8, 5),
          128: Config(32, 16, 8, 5)},
}
# sm_120 fp32 (elem_size 4): ieee dots run on FMAs (no mma.sync), so registers, not shared memory,
# bound the tile. With an unmasked hot loop beside the masked last tile the FMA kernels needed
# ~2x the registers (D = 256 spilled 564 B even at (16, 16, 8, 3)); fp32 kernels therefore run
# every prefix tile masked through one loop body (kernel.py: MASK_ALL) and compile spill-free at
# 64-110 registers: D = 64 (16, 32, 8, 5) / (32, 16, 8, 5), D = 128 (16, 32, 8, 5) (its (16, 16,
# 8, 5) spills 8 B), D = 256 (16, 16, 8, 5).
_SM120_FP32 = {
    64: dict.fromkeys(ROW_BUCKETS[1:], Config(32, 16, 8, 5)) | {16: Config(16, 32, 8, 5)},
    128: dict.fromkeys(ROW_BUCKETS, Config(16, 32, 8, 5)),
    256: dict.fromkeys(ROW_BUCKETS, Config(16, 16, 8, 5)),
}
TABLES = {90: _SM90, 120: _SM120}
INTERPRET_CONFIG = Config(16, 16, 4, 1)  # CPU interpreter: tiny tiles, tiny test shapes


def tail_block_n(cfg: Config) -> int:
    """Key tile of the tree-tail part: ≤ 32, a divisor of 32 (one mask word per row per
    tile)."""
    return min(cfg.block_n, 32)


def tail_row_words(arch: int | None, cfg: Config) -> bool:
    """Whether the tree tail reads its mask as one word per row per tile (kernel.py ROW_WORDS):
    on sm_90 for 32-64-row blocks (the short-context and 16-64-node plans: fewer registers
    there) and in the CPU interpreter; not for 16- or 128-row blocks on sm_90 (ptxas spills 8 /
    136 B, vs 0 / 20 B the other way) nor on sm_120 (8-48 B of spill in 8 configs of the
    cross-compile check)."""
    return arch is None or (arch != 120 and 32 <= cfg.block_m <= 64)


COMBINE_LSE_BLOCK = 128  # ≥ the most parts the split heuristic makes (64 splits + the tail)


def combine_block_s(parts: int, head_dim: int, fixed: bool = True) -> tuple[int, int]:
    """(BLOCK_S, LSE_BLOCK) of the combine kernel: LSE_BLOCK ≥ `parts` (all LSEs in one load),
    BLOCK_S parts of [head_dim] fp32 per loop step (≤ 8192 elements, ≤ 64 registers/thread at 4
    warps: up to 64 parts at D = 128 load in one round trip).

    `fixed` (GPU): LSE_BLOCK is COMBINE_LSE_BLOCK for every split count up to it, so the kernel
    compiles once per head_dim, not once per context class (each new split count cost
    a compile inside a request's step). The CPU interpreter keeps the tight blocks."""
    lse_block = max(2, 1 << (parts - 1).bit_length())
    if fixed:
        lse_block = max(lse_block, COMBINE_LSE_BLOCK)
    return min(lse_block, max(1, 8192 // head_dim)), lse_block


# The row-block combine (combine.py `_combine_rows_kernel`) for plans of ≤ this many parts, 4
# (token, head) rows a program: faster than the per-row combine up to 12 parts, slower at 33 (its
# loop over the parts is serial). H200, experiments/diag_layout.py runs 5-6: BENCHMARKS.md,
# "Short-context verify: the combine by row blocks" and "Figures formerly in source comments".
COMBINE_ROWS_MAX_PARTS = 12
COMBINE_BLOCK_R = 4


def combine_rows_block(parts: int, override: int | None = None) -> int | None:
    """Rows per program of the row-block combine for `parts` parts, or None: the per-row
    combine. `override` (launcher option "combine_rows", A/B runs): 0 forces the per-row
    kernel, n > 0 blocks of n rows."""
    if override is not None:
        return int(override) or None
    return COMBINE_BLOCK_R if parts <= COMBINE_ROWS_MAX_PARTS else None


# One CTA per SM for the 64-row bucket at contexts in ONE_CTA_CONTEXTS (sm_90, D = 128, 16-bit
# inputs, a launch of ≤ SMs / 16 programs: one request's 8 KV heads): a 7-stage pipeline, 16
# splits, and the one-round combine (combine.py `_combine_shot_kernel`, 4 rows a program) launched
# early, waiting beside the attention CTAs, and letting the next kernel launch before its own
# wait. It beats the table's plan from 16k to 64k and loses beyond (H200, experiments/
# diag_layout.py run 15 and diag_fused_merge run 6: BENCHMARKS.md, "Kept: one CTA per SM with the
# one-round combine resident beside it").
ONE_CTA_CONFIG = Config(64, 64, 4, 7)
ONE_CTA_CONTEXTS = (16384, 65536)
ONE_CTA_SHOT_ROWS = 4
# The two-CTA plan of the same launches beyond those contexts merges with the one-round combine,
# 2 rows a program, triggered first: 96k 105.3 → 104.0, 128k 135.6 → 133.7 (run 15; 133.7 vs
# 135.0 in diag_fused_merge run 6). Not for smaller row buckets: 4 rows at 32k went 37.6 → 47.1
# (run 6: the next kernel's small CTAs became resident where the combine waited).
TWO_CTA_SHOT_ROWS = 2


def _shot_launch(arch: int | None, head_dim: int, rows: int, elem_size: int, max_ctx_len: int,
                 programs: int, sm_count: int) -> bool:
    """Whether a launch is of the kind the one-CTA / one-round-combine plans were measured on."""
    return (arch == 90 and head_dim == 128 and elem_size == 2 and rows_bucket(rows) == 64
            and max_ctx_len >= ONE_CTA_CONTEXTS[0] and 16 * programs <= sm_count)


def one_cta_splits(arch: int | None, head_dim: int, rows: int, elem_size: int,
                   max_ctx_len: int, programs: int, sm_count: int) -> int | None:
    """Splits of the one-CTA-per-SM plan (ONE_CTA_CONFIG), or None for the table plan: the
    largest power of two S ≤ 16 with S·programs ≤ SMs (one wave) and chunks ≥ max(256, 16·rows),
    for the launches `_shot_launch` admits at contexts in ONE_CTA_CONTEXTS."""
    lo, hi = ONE_CTA_CONTEXTS
    if not (_shot_launch(arch, head_dim, rows, elem_size, max_ctx_len, programs, sm_count)
            and lo <= max_ctx_len <= hi):
        return None
    s = 16
    while s > 1 and (s * programs > sm_count or max_ctx_len // s < max(256, 16 * rows)):
        s //= 2
    return s if s >= 8 else None


def combine_shot_rows(arch: int | None, head_dim: int, rows: int, elem_size: int,
                      max_ctx_len: int, programs: int, sm_count: int,
                      one_cta: bool) -> int | None:
    """Rows per program of the one-round combine (triggered first), or None for the others."""
    if one_cta and arch == 90:
        return ONE_CTA_SHOT_ROWS
    if _shot_launch(arch, head_dim, rows, elem_size, max_ctx_len, programs, sm_count):
        return TWO_CTA_SHOT_ROWS
    return None


def rows_bucket(rows: int) -> int:
    """The table bucket of `rows` packed query rows."""
    for bucket in ROW_BUCKETS:
        if rows <= bucket:
            return bucket
    return ROW_BUCKETS[-1]


def arch_key(capability: tuple[int, int]) -> int:
    """Table key of a CUDA compute capability: 120 for sm_12x, else 90 (sm_80/89/90/100)."""
    return 120 if capability[0] == 12 else 90


def pick_config(arch: int, head_dim: int, rows: int, elem_size: int,
                max_ctx_len: int | None = None) -> Config:
    """Config for `rows` packed rows at `head_dim` (64/128/256; smaller dims use the 64 row);
    for a plan whose longest context is ≤ SHORT_CONTEXT, at most the 64-row bucket's.

    fp32 inputs (elem_size 4) double every tile in shared memory: halve BLOCK_N (≥ 16) and use
    one stage fewer (≥ 1); sm_120 has its own fp32 table (_SM120_FP32: register-bound FMA dots).
    """
    table = _SM120_FP32 if arch == 120 and elem_size == 4 else TABLES[arch]
    if max_ctx_len is not None and max_ctx_len <= SHORT_CONTEXT:
        rows = min(rows, 64)
    cfg = table[min((d for d in table if d >= head_dim), default=max(table))][rows_bucket(rows)]
    if elem_size == 4 and arch != 120:
        cfg = Config(cfg.block_m, max(16, cfg.block_n // 2), cfg.num_warps,
                     max(1, cfg.num_stages - 1))
    return cfg


def all_configs(arch: int) -> list[tuple[int, Config, int]]:
    """Every distinct (head_dim, Config, elem_size) the launcher can pick on `arch`."""
    out: dict[tuple[int, Config, int], None] = {}
    for head_dim, buckets in TABLES[arch].items():
        for bucket in buckets:
            for elem in (2, 4):
                out[(head_dim, pick_config(arch, head_dim, bucket, elem), elem)] = None
    return list(out)


_SM_COUNT: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":  # CPU interpreter runs: pretend H200
        return 132
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def ctas_per_sm(cfg: Config) -> int:
    """Resident CTAs per SM the split heuristic plans for: 2 for ≤ 64-row blocks (sm_90:
    ≤ 115 KB shared, ≤ 246 registers × 128 threads), 1 for the 128-row blocks and for
    ONE_CTA_CONFIG (148 KB shared: its 16 splits of 8 KV heads fill 128 of 132 SMs)."""
    return 2 if cfg.block_m <= 64 and cfg != ONE_CTA_CONFIG else 1


def default_num_splits(max_ctx_len: int, rows: int, programs: int, sm_count: int,
                       ctas: int = 2) -> int:
    """Splits S of the prefix for `programs` (request, kv head, row block) programs.

    Chunks stay ≥ max(256, 16·rows) tokens: the floor keeps partial-result traffic
    (S·rows·(D+1) values per kv head, written and read) ≲ 12% of the KV it replaces.
    2 CTAs per SM (≤ 64-row blocks, memory-bound): the most S, a power of two ≤ 64, with
    S·`programs` ≤ one wave — measured on the H200 (32/8 heads, D = 128): 32k and 128k contexts
    with 4 or 64 rows are fastest at S = 32 (256 CTAs, 2 per SM).
    1 CTA per SM (128-row blocks, compute-bound): the smallest S ≤ 64 that keeps ≥ 95% of the
    SMs busy over its waves (S·programs / (waves · SMs)); if none does, the S that keeps the
    most busy, the smallest on a tie within 1%: 256 rows → S = 8 (128 CTAs), 1024 rows → S = 2,
    68 rows (a 17-node tree) → S = 16 (not the two full waves of S = 33: S = 16 is faster than
    S = 32 at 32k and 128k; BENCHMARKS.md, "Tree-verify kernel — row-block and engine-tree
    sweeps", run 7), and 260 rows (a 65-node tree: 3 row blocks) → S = 11 at 128k (264 CTAs: two
    full waves) where a one-wave power of two left 36 of 132 SMs idle and was slower
    (BENCHMARKS.md, "Tree-verify attention kernel — third H200 run", and "Figures formerly in
    source comments").
    """
    min_chunk = max(256, 16 * rows)
    if max_ctx_len <= SHORT_CONTEXT:  # latency-bound: up to 4 splits whatever the rows
        min_chunk = max(256, min(min_chunk, max_ctx_len // 4))
    s_max = max(1, min(64, max_ctx_len // min_chunk))
    if ctas == 1:
        def busy(s: int) -> float:
            return s * programs / (-(-s * programs // sm_count) * sm_count)
        full = [s for s in range(1, s_max + 1) if busy(s) >= 0.95]
        if full:
            return full[0]
        best = max(busy(s) for s in range(1, s_max + 1))
        return min(s for s in range(1, s_max + 1) if busy(s) >= best - 0.01)
    s = 1
    while s < 64 and 2 * s * programs <= ctas * sm_count and max_ctx_len // (2 * s) >= min_chunk:
        s *= 2
    return s
