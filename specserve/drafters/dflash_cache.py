"""The DFlash drafter's context cache: per request, paged K/V of the context rows only.

Owns the pages of two layer groups, each with its own pool and page tables: `full` layers keep
every context position; `sliding` layers keep only the positions a future block can still see
(the last `sliding_window − 1`), so their memory stays bounded at any context length — pages
whose positions all fell out of the window are freed (the page table keeps placeholder 0 for
them; the attention backend never reads below the window) and rows of a long chunk that are
already out of the window are never written. The block K/V of a draft call are written right
after the context and overwritten by the next call's context (the reference's crop to `start`).

One draft call is one `CacheStep` over all its requests (drafters/dflash_step.py: where each new
context row goes, and the block attention of every layer as one batched `AttnBatch` per
(group, causality)).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from specserve.attention import backend_for
from specserve.attention.base import AttentionBackend
from specserve.drafters.dflash_step import CacheStep, StepItem
from specserve.errors import CapacityExhausted
from specserve.kvcache.block_manager import pages_for
from specserve.kvcache.pool import KVPool, KVShape
from specserve.models.dflash_config import DFlashConfig

FULL, SLIDING = "full", "sliding"


@dataclass
class _Pages:
    """One group's pages of one request; leading pages out of the window are placeholders.
    `live` changes only through `_Group` (allocate / free_below / release), which calls
    `changed()`: the arrays below are built once per change, not per call (a long context's
    table is thousands of pages; BENCHMARKS.md, "Page tables as arrays on the graph paths" and
    "Figures formerly in source comments")."""

    dead: int = 0  # leading page-table entries freed or never allocated
    live: list[int] = field(default_factory=list)  # page ids of the entries after them
    _table_arr: np.ndarray | None = field(default=None, repr=False, compare=False)  # int32

    def changed(self) -> None:
        self._table_arr = None

    def table(self) -> list[int]:
        return [0] * self.dead + self.live

    def table_array(self) -> np.ndarray:  # [dead + len(live)] int32, read-only
        """`table()` as an array (cached until the pages change)."""
        if self._table_arr is None:
            arr = np.zeros(self.dead + len(self.live), dtype=np.int32)
            arr[self.dead :] = self.live
            arr.flags.writeable = False
            self._table_arr = arr
        return self._table_arr

    def slots(self, positions: np.ndarray, page_size: int) -> np.ndarray:  # [N] int64
        """Slots of `positions` (all at or after the first live page's)."""
        pages = self.table_array()[positions // page_size].astype(np.int64)
        return pages * page_size + positions % page_size


class _Group:
    """Layers sharing a retention rule: their pool, free pages and window."""

    def __init__(self, name: str, layers: Sequence[int], window: int | None, shape: KVShape,
                 num_pages: int, page_size: int, device, poison: bool) -> None:
        if num_pages <= 0:
            raise ValueError(f"{name} group needs a positive page count, got {num_pages}")
        self.name, self.layers, self.window, self.page_size = name, tuple(layers), window, page_size
        self.index = {layer: i for i, layer in enumerate(self.layers)}
        self.pool = KVPool(shape, num_pages, page_size, device=device, poison=poison)
        self.free: list[int] = list(range(num_pages))  # min-heap

    def keep_from(self, length: int) -> int:
        """First context position a block after `length` context positions can see."""
        return 0 if self.window is None else max(0, length - self.window + 1)

    def _below(self, pages: _Pages, keep_from: int) -> tuple[int, int]:
        """First page-table entry still needed, and how many live pages lie wholly below it."""
        first = keep_from // self.page_size
        return first, min(len(pages.live), max(0, first - pages.dead))

    def plan(self, pages: _Pages, keep_from: int, stop: int) -> tuple[int, int]:
        """(pages freed, pages allocated) to hold exactly positions [keep_from, stop)."""
        first, drop = self._below(pages, keep_from)
        held = max(pages.dead, first) + len(pages.live) - drop
        return drop, max(0, pages_for(stop, self.page_size) - held)

    def free_below(self, pages: _Pages, keep_from: int) -> None:
        """Free the leading pages whose positions all lie below `keep_from`."""
        first, drop = self._below(pages, keep_from)
        for page in pages.live[:drop]:
            heapq.heappush(self.free, page)
        if drop or first > pages.dead:
            pages.live = pages.live[drop:]
            pages.dead = max(pages.dead, first)
            pages.changed()

    def allocate(self, pages: _Pages, stop: int) -> None:
        """Allocate pages so that positions up to `stop` have slots."""
        while pages.dead + len(pages.live) < pages_for(stop, self.page_size):
            pages.live.append(heapq.heappop(self.free))
            pages.changed()

    def release(self, pages: _Pages) -> None:
        for page in pages.live:
            heapq.heappush(self.free, page)
        pages.live, pages.dead = [], 0
        pages.changed()


@dataclass
class _Request:
    length: int  # context positions appended so far
    pages: dict[str, _Pages]


class DFlashContextCache:
    """Paged context K/V of every request of one drafter."""

    def __init__(self, cfg: DFlashConfig, num_pages: int, page_size: int = 16, *,
                 sliding_num_pages: int | None = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", poison: bool = False) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.config, self.page_size, self.device = cfg, page_size, torch.device(device)
        self.attn_backend: AttentionBackend = backend_for(device)
        self.groups: dict[str, _Group] = {}
        for name in (FULL, SLIDING):
            layers = [i for i in range(cfg.num_layers) if (cfg.window(i) is None) == (name == FULL)]
            if not layers:
                continue
            shape = KVShape(len(layers), cfg.num_kv_heads, cfg.head_dim, dtype)
            pages = num_pages if name == FULL or sliding_num_pages is None else sliding_num_pages
            window = None if name == FULL else cfg.sliding_window
            self.groups[name] = _Group(name, layers, window, shape, pages, page_size, self.device,
                                       poison)
        self.group_of = {i: g for g in self.groups.values() for i in g.layers}
        self._requests: dict[str, _Request] = {}

    def pages(self) -> dict[str, tuple[int, int]]:
        """Per layer group ("full" / "sliding"): (pages in use, pages free)."""
        return {g.name: (g.pool.num_pages - len(g.free), len(g.free))
                for g in self.groups.values()}

    def length(self, request_id: str) -> int:
        """Context positions held for `request_id` (0 for an unknown request)."""
        entry = self._requests.get(request_id)
        return entry.length if entry is not None else 0

    def held_slots(self, request_id: str, layer: int) -> int:
        """Pool slots (context + block scratch) `request_id` holds in `layer`'s group."""
        entry = self._requests.get(request_id)
        group = self.group_of[layer]
        return len(entry.pages[group.name].live) * self.page_size if entry is not None else 0

    def pages_held(self, request_id: str) -> int:
        """Pages `request_id` holds, all layer groups together (0 for an unknown request)."""
        entry = self._requests.get(request_id)
        return sum(len(p.live) for p in entry.pages.values()) if entry is not None else 0

    @property
    def total_pages(self) -> int:
        return sum(g.pool.num_pages for g in self.groups.values())

    def num_free_pages(self, layer: int) -> int:
        return len(self.group_of[layer].free)

    def release(self, request_id: str) -> None:
        """Free every page of `request_id` (no-op if unknown)."""
        entry = self._requests.pop(request_id, None)
        if entry is not None:
            for name, pages in entry.pages.items():
                self.groups[name].release(pages)

    def begin(self, items: Sequence[StepItem]) -> CacheStep:
        """Allocate (all or nothing) and free pages for one draft call; lengths advance."""
        if len({it.request_id for it in items}) != len(items):
            raise ValueError("a draft call names the same request twice")
        entries = [self._requests.get(it.request_id) or _Request(0, {
            name: _Pages() for name in self.groups}) for it in items]
        lengths = [e.length + it.num_new for e, it in zip(entries, items, strict=True)]
        for group in self.groups.values():  # check every group before touching any
            plans = [group.plan(e.pages[group.name], group.keep_from(n), n + it.block_len)
                     for e, it, n in zip(entries, items, lengths, strict=True)]
            need = sum(new - drop for drop, new in plans)
            if need > len(group.free):
                raise CapacityExhausted(
                    f"drafter context cache ({group.name} layers) needs {need} more pages, "
                    f"{len(group.free)} of {group.pool.num_pages} are free")
        olds = [e.length for e in entries]
        for e, it, n in zip(entries, items, lengths, strict=True):
            self._requests[it.request_id] = e
            e.length = n
        for group in self.groups.values():  # all frees first, so any call that fits runs
            for e in entries:
                group.free_below(e.pages[group.name], group.keep_from(e.length))
            for e, it in zip(entries, items, strict=True):
                group.allocate(e.pages[group.name], e.length + it.block_len)
        return CacheStep(self, items, entries, olds)


__all__ = ["FULL", "SLIDING", "DFlashContextCache", "StepItem"]
