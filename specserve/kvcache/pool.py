"""KV memory: one K and one V tensor per layer, `[num_pages, page_size, kv_heads, head_dim]`.

Memory only — which request owns which page is `kvcache.block_manager`'s business. The pool is
sized from a byte budget (`num_pages_for_budget`) so a deployment states how much memory the cache
may take, not a page count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
        dims = (num_pages, page_size, shape.kv_heads, shape.head_dim)
        # poison=True fills with NaN so a read of a never-written slot shows up in tests.
        make = (lambda: torch.full(dims, float("nan"), dtype=shape.dtype, device=device)) if (
            poison
        ) else (lambda: torch.empty(dims, dtype=shape.dtype, device=device))
        self.k = [make() for _ in range(shape.num_layers)]  # each [P, S, Hkv, D]
        self.v = [make() for _ in range(shape.num_layers)]  # each [P, S, Hkv, D]

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new K/V rows: slots `[T]` int64, k/v `[T, Hkv, D]`."""
        flat_k = self.k[layer].view(self.num_slots, *self.k[layer].shape[2:])
        flat_v = self.v[layer].view(self.num_slots, *self.v[layer].shape[2:])
        flat_k.index_copy_(0, slots, k.to(flat_k.dtype))
        flat_v.index_copy_(0, slots, v.to(flat_v.dtype))

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy K/V of slots `src [N]` to slots `dst [N]` in every layer (commit compaction).

        Callers guarantee no dst is read as a src later in the same call (true for compaction of
        an accepted path: dst positions are strictly below the remaining src positions).
        """
        if src.numel() == 0:
            return
        for layer in range(self.shape.num_layers):
            for pool in (self.k[layer], self.v[layer]):
                flat = pool.view(self.num_slots, *pool.shape[2:])
                flat.index_copy_(0, dst, flat.index_select(0, src))
