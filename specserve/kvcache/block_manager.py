"""KV page bookkeeping: which pages each request owns. No torch (numpy for the page arrays).

Policy lives here, memory lives in `kvcache.pool`. A request *reserves* pages (the sum of
reservations never exceeds the pool): what it needs at admission, then more as it grows (`grow`:
the scheduler preempts another request when that fails); pages are *allocated* lazily within
the reservation as its length grows and freed when it shrinks (speculative scratch) or
finishes.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from specserve.errors import CapacityExhausted


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


@dataclass
class _Entry:
    reserved: int  # pages promised to this request
    pages: list[int] = field(default_factory=list)  # allocated page ids, in position order
    # [reserved] int32, pages[i] at i (what page_array views)
    array: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.array = np.zeros(self.reserved, dtype=np.int32)


class BlockManager:
    """Allocates fixed-size KV pages to requests.

    Slot of token position `p` of a request = `pages[p // page_size] * page_size + p % page_size`.
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        # a min-heap: handing out low ids first keeps runs of pages contiguous
        self._free: list[int] = list(range(num_pages))
        self._entries: dict[str, _Entry] = {}
        self._num_reserved = 0

    # ---- counts ------------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def num_reserved_pages(self) -> int:
        return self._num_reserved

    @property
    def num_unreserved_pages(self) -> int:
        return self.num_pages - self._num_reserved

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries

    # ---- admission ---------------------------------------------------------------------------
    def can_reserve(self, num_tokens: int) -> bool:
        return pages_for(num_tokens, self.page_size) <= self.num_unreserved_pages

    def reserve(self, request_id: str, num_tokens: int) -> None:
        """Promise `request_id` pages for up to `num_tokens` slots.

        Raises CapacityExhausted when the promise cannot be made now (the caller may queue the
        request) and ValueError for a duplicate id.
        """
        if request_id in self._entries:
            raise ValueError(f"request {request_id!r} already holds a reservation")
        need = pages_for(num_tokens, self.page_size)
        if need > self.num_unreserved_pages:
            raise CapacityExhausted(
                f"request {request_id!r} needs {need} KV pages for {num_tokens} tokens; "
                f"{self.num_unreserved_pages} of {self.num_pages} are unreserved"
            )
        self._entries[request_id] = _Entry(reserved=need)
        self._num_reserved += need

    def grow(self, request_id: str, num_tokens: int) -> bool:
        """Raise `request_id`'s reservation to cover `num_tokens` slots; False (and nothing
        changed) if the pool's unreserved pages do not allow it."""
        entry = self._entries[request_id]
        need = pages_for(num_tokens, self.page_size)
        if need <= entry.reserved:
            return True
        if need - entry.reserved > self.num_unreserved_pages:
            return False
        array = np.zeros(need, dtype=np.int32)
        array[: len(entry.pages)] = entry.pages
        self._num_reserved += need - entry.reserved
        entry.reserved, entry.array = need, array
        return True

    def reserved(self, request_id: str) -> int:
        """Pages promised to `request_id`."""
        return self._entries[request_id].reserved

    # ---- growth and shrinkage ----------------------------------------------------------------
    def ensure(self, request_id: str, num_tokens: int) -> None:
        """Allocate pages so that slots for positions [0, num_tokens) exist."""
        entry = self._entries[request_id]
        need = pages_for(num_tokens, self.page_size)
        if need > entry.reserved:
            raise CapacityExhausted(
                f"request {request_id!r} grew to {num_tokens} tokens ({need} pages), beyond its "
                f"reservation of {entry.reserved} pages"
            )
        while len(entry.pages) < need:
            entry.array[len(entry.pages)] = page = heapq.heappop(self._free)
            entry.pages.append(page)

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Free the pages not needed to hold positions [0, num_tokens)."""
        entry = self._entries[request_id]
        keep = pages_for(num_tokens, self.page_size)
        while len(entry.pages) > keep:
            heapq.heappush(self._free, entry.pages.pop())

    def free(self, request_id: str) -> None:
        """Return every page and the reservation of `request_id` (no-op if unknown)."""
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return
        for page in entry.pages:
            heapq.heappush(self._free, page)
        self._num_reserved -= entry.reserved

    # ---- lookups -----------------------------------------------------------------------------
    def page_table(self, request_id: str) -> list[int]:
        return list(self._entries[request_id].pages)

    def page_array(self, request_id: str) -> np.ndarray:  # [pages] int32
        """`page_table` as a read-only array view, no copy (a long context's table is thousands
        of pages: converting the list per step cost the host; BENCHMARKS.md, "Page tables as
        arrays on the graph paths");
        valid until the request's pages next change."""
        entry = self._entries[request_id]
        view = entry.array[: len(entry.pages)]
        view.flags.writeable = False
        return view

    def num_slots(self, request_id: str) -> int:
        return len(self._entries[request_id].pages) * self.page_size

    def slots(self, request_id: str, start: int, stop: int) -> list[int]:
        """Pool slot ids of positions [start, stop) of a request (pages must be allocated)."""
        pages, ps = self._entries[request_id].pages, self.page_size
        return [pages[p // ps] * ps + p % ps for p in range(start, stop)]
