"""The attention backend interface: a ragged batch of new query tokens over a paged KV cache.

Every request `b` in a batch brings `q_lens[b]` new tokens (a prefill chunk, one decode token, a
draft tree, a drafter block). They attend to the request's committed prefix — `ctx_lens[b]` tokens
in the paged pool, always fully visible — plus to the new tokens themselves under a per-request
mask: causal (`tree_mask is None`) or an ancestor bitmask (bit j of row i: new token j is visible
to new token i). The new tokens' K/V are written to `slot_mapping` first, so the new tokens sit in
the pool right after the prefix (positions ctx_len .. ctx_len + q_len − 1 of the page table).

Per-step metadata is built once (`AttnBatch.build`) and passed to every layer explicitly — no module
globals (FlashInfer's plan/run split). Backends: `torch_ref` (CPU, the reference) and the Triton
kernel in `specserve/kernels/tree_attention` (GPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch


def to_device(arrays: Sequence[np.ndarray], device: torch.device | str) -> list[torch.Tensor]:
    """Host arrays → tensors on `device` in ONE host-to-device copy (no sync).

    On CUDA the arrays are packed into one pinned staging buffer (16-byte aligned slots, see
    `packed_offsets`) that is copied with `non_blocking=True`; the results are typed views of the
    one device buffer. Eight
    separate `.to(device)` calls from pageable memory would be eight synchronising copies. The
    pinned buffer comes from torch's caching host allocator, which keeps it alive until the copy
    has run. On the CPU the arrays are wrapped without a copy.
    """
    arrays = [np.ascontiguousarray(a) for a in arrays]
    device = torch.device(device)
    if device.type != "cuda":
        return [torch.from_numpy(a).to(device) for a in arrays]
    offsets, total = packed_offsets(a.nbytes for a in arrays)
    staging = torch.empty(max(total, 8), dtype=torch.uint8, pin_memory=True)
    host = staging.numpy()
    for a, off in zip(arrays, offsets, strict=True):
        host[off : off + a.nbytes] = a.reshape(-1).view(np.uint8)
    buf = staging.to(device, non_blocking=True)
    return [buf[off : off + a.nbytes].view(torch_dtype(a.dtype)).view(a.shape)
            for a, off in zip(arrays, offsets, strict=True)]


def packed_offsets(sizes) -> tuple[list[int], int]:
    """Byte offsets of arrays of `sizes` bytes packed into one buffer, and its size. Slots are
    16-byte aligned: Triton specialises pointer arguments on 16-byte divisibility, so views at
    8-byte offsets that vary from step to step made it compile new kernel variants in the middle
    of requests (the H200 probe's first steps at each new context; BENCHMARKS.md,
    "Figures formerly in source comments")."""
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += (n + 15) // 16 * 16
    return offsets, total


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    """The torch dtype of a numpy dtype."""
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


_CAUSAL = {"bits": np.zeros((0, 0), np.uint32)}  # the largest table made so far (read-only)


def causal_bits(n: int) -> np.ndarray:  # [n, W] uint32 lower-triangular bitmask, read-only
    """The ancestor bitmask of a causal run of n tokens (bit j of row i set for j ≤ i): a view
    of one table kept for the longest run asked so far (a prefill chunk riding with verify
    trees gets one every step; built densely it cost seconds of host time at 8k rows)."""
    table = _CAUSAL["bits"]
    if n > table.shape[0]:
        width = (n + 31) // 32
        rows = np.arange(n, dtype=np.int64)[:, None]
        ones = np.clip(rows - 32 * np.arange(width, dtype=np.int64)[None, :] + 1, 0, 32)
        table = ((np.uint64(1) << ones.astype(np.uint64)) - np.uint64(1)).astype(np.uint32)
        table.setflags(write=False)
        _CAUSAL["bits"] = table
    return table[:n, : (n + 31) // 32]


@dataclass(frozen=True, eq=False)
class AttnBatch:
    q_lens: tuple[int, ...]  # host copy: new tokens per request
    ctx_lens: tuple[int, ...]  # host copy: committed prefix per request
    cu_q: torch.Tensor  # [B+1] int32 offsets of each request's rows in the flat batch
    ctx_lens_t: torch.Tensor  # [B] int32
    block_table: torch.Tensor  # [B, max_pages] int32, rows padded with 0
    slot_mapping: torch.Tensor  # [T] int64 pool slot of each new token
    positions: torch.Tensor  # [T] int64 absolute position of each new token (RoPE, windows)
    tree_mask: torch.Tensor | None  # [T, W] int32 ancestor bits over the request's new tokens
    page_size: int
    # With a tree_mask: per request, whether its rows are plain causal (their bits are the
    # lower triangle); None without one (all causal) or when the builder did not say.
    causal: tuple[bool, ...] | None = None
    # Per-step memo of backends (validated metadata, launch plans, scratch buffers): the batch is
    # immutable and shared by every layer of a forward, so anything derived from it is computed
    # once per step, not once per layer.
    memo: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return int(self.cu_q.shape[0] and sum(self.q_lens))

    @property
    def batch_size(self) -> int:
        return len(self.q_lens)

    @staticmethod
    def build(
        q_lens: Sequence[int],
        ctx_lens: Sequence[int],
        page_tables: Sequence[Sequence[int]],
        positions: Sequence[int] | np.ndarray,
        page_size: int,
        tree_masks: Sequence[np.ndarray] | None = None,
        device: torch.device | str = "cpu",
    ) -> AttnBatch:
        """Assemble the metadata of one forward from host lists.

        `tree_masks[b]` is `[q_lens[b], W_b]` uint32 (from `spec.tree.verify_layout`), or None
        for a causal request (its rows get the lower triangle, `batch.causal[b]` is True); rows
        are padded to the widest W. `tree_masks=None` means causal for every request.
        """
        return AttnBatch.build_with(q_lens, ctx_lens, page_tables, positions, page_size,
                                    tree_masks, device)[0]

    @staticmethod
    def build_with(
        q_lens: Sequence[int],
        ctx_lens: Sequence[int],
        page_tables: Sequence[Sequence[int]],
        positions: Sequence[int] | np.ndarray,
        page_size: int,
        tree_masks: Sequence[np.ndarray] | None = None,
        device: torch.device | str = "cpu",
        extra: Sequence[np.ndarray] = (),
    ) -> tuple[AttnBatch, list[torch.Tensor]]:
        """`build`, plus `extra` host arrays (e.g. the token ids) moved to `device` in the same
        single host-to-device copy; returns (batch, extra tensors)."""
        b = len(q_lens)
        cu = np.zeros(b + 1, dtype=np.int32)
        cu[1:] = np.cumsum(q_lens)
        table, slots = _table_and_slots(page_tables, ctx_lens, q_lens, cu, page_size)
        arrays = [cu, np.asarray(ctx_lens, dtype=np.int32).reshape(b), table, slots,
                  np.asarray(positions, dtype=np.int64).reshape(-1)]
        causal = None
        if tree_masks is not None:
            causal = tuple(m is None for m in tree_masks)
            arrays.append(_packed_masks(tree_masks, q_lens, cu))
        got = to_device(arrays + [np.asarray(x) for x in extra], device)
        batch = AttnBatch(
            q_lens=tuple(int(x) for x in q_lens),
            ctx_lens=tuple(int(x) for x in ctx_lens),
            cu_q=got[0],
            ctx_lens_t=got[1],
            block_table=got[2],
            slot_mapping=got[3],
            positions=got[4],
            tree_mask=got[5] if tree_masks is not None else None,
            page_size=page_size,
            causal=causal,
        )
        return batch, got[len(arrays):]


def _table_and_slots(page_tables: Sequence[Sequence[int]], ctx_lens: Sequence[int],
                     q_lens: Sequence[int], cu: np.ndarray, page_size: int
                     ) -> tuple[np.ndarray, np.ndarray]:
    """The padded block table [b, max_pages] and each query row's KV slot [sum(q_lens)]."""
    max_pages = max((len(t) for t in page_tables), default=0) or 1
    table = np.zeros((len(q_lens), max_pages), dtype=np.int32)
    slots = np.empty(int(cu[-1]), dtype=np.int64)
    for i, pages in enumerate(page_tables):
        table[i, : len(pages)] = pages
        pos = np.arange(ctx_lens[i], ctx_lens[i] + q_lens[i])
        slots[cu[i] : cu[i + 1]] = table[i, pos // page_size] * page_size + pos % page_size
    return table, slots


def _packed_masks(tree_masks: Sequence[np.ndarray | None], q_lens: Sequence[int],
                  cu: np.ndarray) -> np.ndarray:
    """Every sequence's mask words in one [total_q, width] int32 array (None: causal rows)."""
    masks = [causal_bits(n) if m is None else m for m, n in zip(tree_masks, q_lens, strict=True)]
    width = max(m.shape[1] for m in masks)
    mask = np.zeros((int(cu[-1]), width), dtype=np.uint32)  # [total_q, width]
    for i, m in enumerate(masks):
        mask[cu[i] : cu[i + 1], : m.shape[1]] = m
    return mask.view(np.int32)


class AttentionBackend(Protocol):
    """Computes attention of the new tokens of an `AttnBatch` over a paged K/V pool."""

    def __call__(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k_pool: torch.Tensor,  # [P, S, Hkv, D] (new tokens' K already written)
        v_pool: torch.Tensor,  # [P, S, Hkv, D]
        batch: AttnBatch,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:  # [T, Hq, D]
        ...
