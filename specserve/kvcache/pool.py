"""KV memory: one tensor `[2, layers, num_pages, page_size, kv_heads, head_dim]` holding K and V
of every layer, with per-layer views `k[l]` / `v[l]` `[num_pages, page_size, kv_heads, head_dim]`.

Memory only — which request owns which page is `kvcache.block_manager`'s business. The pool is
sized from a byte budget (`num_pages_for_budget`) so a deployment states how much memory the cache
may take, not a page count.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specserve.attention.base import to_device


@dataclass(frozen=True, slots=True)
class KVShape:
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def bytes_per_token(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.kv_heads * self.head_dim * elem


def num_pages_for_budget(shape: KVShape, page_size: int, budget_bytes: int) -> int:
    """How many pages of `page_size` tokens fit in `budget_bytes` (ValueError if not even one)."""
    per_page = shape.bytes_per_token() * page_size
    num_pages = budget_bytes // per_page
    if num_pages < 1:
        raise ValueError(
            f"kv memory budget of {budget_bytes} B holds no page of {page_size} tokens "
            f"({per_page} B each)"
        )
    return int(num_pages)


class KVPool:
    """The paged K/V tensors of every layer."""

    def __init__(
        self,
        shape: KVShape,
        num_pages: int,
        page_size: int,
        device: torch.device | str = "cpu",
        poison: bool = False,
    ) -> None:
        self.shape = shape
        self.num_pages = num_pages
        self.page_size = page_size
        dims = (2, shape.num_layers, num_pages, page_size, shape.kv_heads, shape.head_dim)
        # One tensor holds K and V of every layer, so commit compaction (`copy_slots`) is one
        # gather + one scatter for the whole model instead of two ops per layer and pool.
        # poison=True fills with NaN so a read of a never-written slot shows up in tests.
        self.kv = (torch.full(dims, float("nan"), dtype=shape.dtype, device=device) if poison
                   else torch.empty(dims, dtype=shape.dtype, device=device))
        # per-layer views (indexing, not unbind: unbind's views refuse in-place writes under grad)
        self.k = [self.kv[0, i] for i in range(shape.num_layers)]  # each [P, S, Hkv, D]
        self.v = [self.kv[1, i] for i in range(shape.num_layers)]  # each [P, S, Hkv, D]
        rows = (num_pages * page_size, shape.kv_heads, shape.head_dim)
        self._flat_k = [t.view(rows) for t in self.k]  # [slots, Hkv, D] views (write)
        self._flat_v = [t.view(rows) for t in self.v]
        self._flat_all = self.kv.view(2 * shape.num_layers, *rows)  # [2L, slots, Hkv, D]
        # tensor parallel: rank 0's pool tells the other ranks' pools to make the same copy
        # (`copy_slots` calls it first with the host / device indices it was given)
        self.on_copy = None

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new K/V rows: slots `[T]` int64, k/v `[T, Hkv, D]` (any strides). The cache is
        never differentiated through: K/V computed with autograd on are stored detached."""
        flat_k, flat_v = self._flat_k[layer], self._flat_v[layer]
        if k.requires_grad or v.requires_grad:
            k, v = k.detach(), v.detach()
        flat_k.index_copy_(0, slots, k if k.dtype == flat_k.dtype else k.to(flat_k.dtype))
        flat_v.index_copy_(0, slots, v if v.dtype == flat_v.dtype else v.to(flat_v.dtype))

    def all_layer_slots(self, slots: np.ndarray) -> np.ndarray:  # [2·layers·T] int64
        """Rows of the flat `[2·layers·slots]` view that `write_all` fills for slots `[T]`."""
        base = np.arange(2 * self.shape.num_layers, dtype=np.int64)[:, None] * self.num_slots
        return (base + np.asarray(slots, dtype=np.int64)[None, :]).reshape(-1)

    def write_all(self, flat: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new K/V rows of every layer in one scatter: k/v `[layers, T, Hkv, D]` (any
        strides), `flat` = `all_layer_slots(slots)` on the pool's device."""
        rows = torch.stack([k, v]).to(self.kv.dtype).reshape(-1, *self.kv.shape[-2:])
        self._flat_all.view(-1, *self.kv.shape[-2:]).index_copy_(0, flat, rows)

    def copy_slots(self, src, dst) -> None:
        """Copy K/V of slots `src [N]` to slots `dst [N]` in every layer (commit compaction).

        `src` / `dst`: int64 tensors on the pool's device, or host sequences of ints (sent in one
        transfer). All sources are read before any destination is written, so overlapping
        src / dst sets are fine. Two kernels for the whole model, whatever the layer count.
        """
        if not isinstance(src, torch.Tensor) or not isinstance(dst, torch.Tensor):
            if len(src) != len(dst):
                raise ValueError(f"copy_slots: {len(src)} sources but {len(dst)} destinations")
            if len(src) == 0:
                return
            if self.on_copy is not None:  # host indices: sent on as they are (no device sync)
                self.on_copy(src, dst)
            src, dst = to_device([np.asarray(src, dtype=np.int64),
                                  np.asarray(dst, dtype=np.int64)], self.kv.device)
        elif src.numel() == 0:
            return
        elif self.on_copy is not None:
            self.on_copy(src, dst)
        flat = self._flat_all
        flat.index_copy_(1, dst, flat.index_select(1, src))
