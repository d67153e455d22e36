"""Launch-config tables of the tree-attention kernels, per GPU arch.

Owns the (BLOCK_M, BLOCK_N, num_warps, num_stages) choice keyed by `(arch, head_dim, rows bucket)`
where rows = max new tokens × GQA group (the packed query rows of one KV head). sm_90 (H200,
227 KB shared memory, wgmma for BLOCK_M ≥ 64) and sm_120 (RTX PRO 6000 / RTX 50xx: mma.sync only,
101,376 B of shared memory per block — every entry must fit, `bench/bench_kernel.py --sm120-check`
cross-compiles them all). Under TRITON_INTERPRET=1 (CPU) small tiles keep the interpreter quick.
Nothing here has been tuned on hardware yet: the entries follow kernels.md §6.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SM120_SMEM_LIMIT = 101_376  # bytes of shared memory per block on sm_120 / sm_121
ROW_BUCKETS = (16, 32, 64, 128)  # packed query rows per KV head, rounded up (last = "more")


@dataclass(frozen=True)
class Config:
    block_m: int  # packed (token, q head) rows per program
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int


# {head_dim: {rows bucket: Config}}; a bucket covers rows ≤ its key (the last one: all larger).
_SM90 = {
    64: {16: Config(16, 64, 4, 3), 32: Config(32, 64, 4, 3), 64: Config(64, 64, 4, 3),
         128: Config(128, 64, 8, 3)},
    128: {16: Config(16, 64, 8, 3), 32: Config(32, 64, 8, 3), 64: Config(64, 64, 8, 3),
          128: Config(64, 64, 8, 3)},  # (128, 64, 8, 3) spilled 76 B in an sm_90a compile
    256: {16: Config(16, 32, 8, 2), 32: Config(32, 32, 8, 2), 64: Config(64, 32, 8, 2),
          128: Config(64, 32, 8, 2)},
}
# sm_120: ≤ ~48 KB for 2 CTAs/SM where possible; D ≥ 128 uses 8 warps (K/V tiles pass through
# registers: 4 warps spilled in the cross-compile check).
_SM120 = {
    64: {16: Config(16, 64, 4, 2), 32: Config(32, 64, 4, 2), 64: Config(64, 32, 4, 2),
         128: Config(64, 64, 8, 2)},
    128: {16: Config(16, 64, 8, 2), 32: Config(32, 32, 8, 2), 64: Config(64, 32, 8, 2),
          128: Config(64, 32, 8, 2)},
    256: {16: Config(16, 32, 8, 2), 32: Config(32, 32, 8, 2), 64: Config(32, 32, 8, 2),
          128: Config(32, 32, 8, 2)},
}
TABLES = {90: _SM90, 120: _SM120}
INTERPRET_CONFIG = Config(16, 16, 4, 1)  # CPU interpreter: tiny tiles, tiny test shapes


def tail_block_n(cfg: Config) -> int:
    """Key tile of the tree-tail/combine kernel: ≤ 32 (few keys; mask words cost registers)."""
    return min(cfg.block_n, 32)


def rows_bucket(rows: int) -> int:
    """The table bucket of `rows` packed query rows."""
    for bucket in ROW_BUCKETS:
        if rows <= bucket:
            return bucket
    return ROW_BUCKETS[-1]


def arch_key(capability: tuple[int, int]) -> int:
    """Table key of a CUDA compute capability: 120 for sm_12x, else 90 (sm_80/89/90/100)."""
    return 120 if capability[0] == 12 else 90


def pick_config(arch: int, head_dim: int, rows: int, elem_size: int) -> Config:
    """Config for `rows` packed rows at `head_dim` (64/128/256; smaller dims use the 64 row).

    fp32 inputs (elem_size 4) double every tile in shared memory: halve BLOCK_N (≥ 16) and use
    one stage fewer (≥ 1) so sm_120 entries still fit.
    """
    table = TABLES[arch]
    cfg = table[min((d for d in table if d >= head_dim), default=max(table))][rows_bucket(rows)]
    if elem_size == 4:
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


def default_num_splits(max_ctx_len: int, rows: int, programs: int, sm_count: int) -> int:
    """Splits S (power of two ≤ 64): ≥ 2 waves of `programs`·S CTAs, chunks ≥ max(256, 20·rows).

    The chunk floor keeps partial-result traffic (S·rows·(D+1)·8 B per kv head) ≲ 10% of the KV.
    """
    min_chunk = max(256, 20 * rows)
    s = 1
    while s < 64 and s * programs < 2 * sm_count and max_ctx_len // (2 * s) >= min_chunk:
        s *= 2
    return s
