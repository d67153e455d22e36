"""One DFlash draft call's view of the drafter's context cache (drafters/dflash_cache.py).

Owns `CacheStep` — where each new context row of the call goes (positions and slots in every
layer group, one batched write per group) and the block attention of every layer as one
`AttnBatch` per (layer group, causality) — with the call's items (`StepItem`) and the packed
bidirectional block masks (`block_mask`). The cache places the pages (`begin`); a step writes
the call's K/V into them and builds the attention metadata.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np
import torch

from specserve.attention.base import AttnBatch, to_device
from specserve.spec.tree import MASK_WORD_BITS, num_mask_words

if TYPE_CHECKING:
    from specserve.drafters.dflash_cache import DFlashContextCache, _Group, _Request


@lru_cache(maxsize=256)
def block_mask(n: int, window: int | None, valid: int | None = None) -> np.ndarray:  # [n, W]
    """Bidirectional mask among `n` block tokens (|i − j| < window when a window is given),
    packed in uint32 words. `valid`: a block of `valid` tokens run padded to `n` — its rows
    see only its first `valid` columns; the padding rows past it keep theirs (never a row
    without a key)."""
    rows = np.arange(n)
    dense = np.ones((n, n), dtype=bool) if window is None else (
        np.abs(rows[:, None] - rows[None, :]) < window)
    if valid is not None:
        dense[:valid, valid:] = False
    words = num_mask_words(n)
    bits = np.zeros((n, words * MASK_WORD_BITS), dtype=np.uint64)  # [n, W*32]
    bits[:, :n] = dense
    shifts = np.arange(MASK_WORD_BITS, dtype=np.uint64)
    return (bits.reshape(n, words, MASK_WORD_BITS) << shifts).sum(-1).astype(np.uint32)


@dataclass(frozen=True)
class StepItem:
    request_id: str
    num_new: int  # context rows appended this call (positions [length, length + num_new))
    block_len: int  # block tokens run after them (0 = context only)

    def __post_init__(self) -> None:
        if self.num_new < 0 or self.block_len < 0:
            raise ValueError(f"request {self.request_id!r}: num_new and block_len must be "
                             f"non-negative, got {self.num_new}, {self.block_len}")


class CacheStep:
    """One draft call's view of the cache: context-row placement and batched block attention."""

    def __init__(self, cache: DFlashContextCache, items: Sequence[StepItem],
                 entries: Sequence[_Request], olds: Sequence[int]) -> None:
        self.cache = cache
        self._context: dict[str, tuple[torch.Tensor, ...]] = {}  # group -> rows, positions,
        # slots, all-layer slots
        self._batches: dict[tuple[str, bool], AttnBatch] = {}
        offsets = np.cumsum([0] + [it.num_new for it in items])
        self._items, self._entries, self._olds, self._offsets = items, entries, olds, offsets

    def subset(self, idx: Sequence[int]) -> CacheStep:
        """The same call restricted to requests `idx` (call order kept): its pages are already
        placed, so the drafter graphs can replay only the requests that run a block."""
        return CacheStep(self.cache, [self._items[i] for i in idx],
                         [self._entries[i] for i in idx], [self._olds[i] for i in idx])

    def _context_rows(self, group: _Group) -> tuple[torch.Tensor, ...]:
        if group.name not in self._context:
            rows, positions, slots = [], [], []
            for e, old, off in zip(self._entries, self._olds, self._offsets, strict=False):
                pos = np.arange(max(old, group.keep_from(e.length)), e.length)  # [R_b] int64
                rows.append(off + pos - old)
                positions.append(pos)
                slots.append(e.pages[group.name].slots(pos, group.page_size))
            host = [np.concatenate(a).astype(np.int64) for a in (rows, positions, slots)]
            host.append(group.pool.all_layer_slots(host[2]))  # the group's one-scatter write
            self._context[group.name] = tuple(to_device(host, self.cache.device))  # one copy
        return self._context[group.name]

    def write_group_context(self, name: str, fused: torch.Tensor, model) -> None:
        """Context K/V of every layer of group `name` from the call's fused context rows
        `[N, hidden]`: one stacked k|v GEMM (`model.context_kv_layers`) and one scatter."""
        group = self.cache.groups[name]
        rows, positions, _, flat = self._context_rows(group)
        if rows.shape[0] == 0:
            return
        k, v = model.context_kv_layers(group.layers, fused[rows], positions)
        group.pool.write_all(flat, k, v)

    def context_slots(self, name: str, rows: int, pad: np.ndarray) -> tuple[np.ndarray, ...]:
        """Positions and slots `[R·rows]` int64 of the call's new context rows in group `name`,
        request-major with `rows` per request — request i's c-th new row at i·rows + c (the
        drafter graphs' static layout, drafters/dflash_graphs.py). Rows past a request's new
        ones, and rows the group does not keep (below a sliding window), get `pad`'s slot."""
        group = self.cache.groups[name]
        positions, slots = np.zeros(len(self._entries) * rows, np.int64), pad.copy()
        for i, (e, old) in enumerate(zip(self._entries, self._olds, strict=True)):
            pos = np.arange(old, e.length)  # [n_i] the request's new context positions
            positions[i * rows : i * rows + len(pos)] = pos
            kept = np.nonzero(pos >= group.keep_from(e.length))[0]
            slots[i * rows + kept] = e.pages[name].slots(pos[kept], group.page_size)
        return positions, slots

    def block_layout(self) -> list[tuple[int, dict[str, np.ndarray], dict[str, np.ndarray]]]:
        """Per request with a block (call order): its context length, its page table and its
        block slots `[block_len]` per layer group — the host metadata of the block batches
        (for the drafter's CUDA graphs, drafters/dflash_graphs.py)."""
        out = []
        for e, it in zip(self._entries, self._items, strict=True):
            if not it.block_len:
                continue
            pos = np.arange(e.length, e.length + it.block_len)
            out.append((e.length, {g: e.pages[g].table_array() for g in self.cache.groups},
                        {g: e.pages[g].slots(pos, grp.page_size)
                         for g, grp in self.cache.groups.items()}))
        return out

    def block_positions(self) -> torch.Tensor:  # [T] int64
        return to_device([np.concatenate([np.zeros(0, dtype=np.int64)] + [
            np.arange(e.length, e.length + it.block_len)
            for e, it in zip(self._entries, self._items, strict=True)])], self.cache.device)[0]

    def _batch(self, group: _Group, causal: bool) -> AttnBatch:
        key = (group.name, causal)
        if key not in self._batches:
            run = [(e, it.block_len) for e, it in zip(self._entries, self._items, strict=True)
                   if it.block_len]
            self._batches[key] = AttnBatch.build(
                q_lens=[n for _, n in run], ctx_lens=[e.length for e, _ in run],
                page_tables=[e.pages[group.name].table() for e, _ in run],
                positions=np.concatenate([np.arange(e.length, e.length + n) for e, n in run]),
                page_size=group.page_size,
                tree_masks=None if causal else [block_mask(n, group.window) for _, n in run],
                device=self.cache.device)
        return self._batches[key]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float) -> torch.Tensor:  # [T, Hq, D]
        """Write the block K/V after the context, then attend (the model's `BlockAttention`)."""
        group = self.cache.group_of[layer]
        batch = self._batch(group, self.cache.config.causal[layer])
        pool, i = group.pool, group.index[layer]
        pool.write(i, batch.slot_mapping, k, v)
        return self.cache.attn_backend(q, pool.k[i], pool.v[i], batch, scale, group.window)
