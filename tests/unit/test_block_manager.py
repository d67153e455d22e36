"""Block manager bookkeeping: reservations, lazy allocation, truncation, no double ownership."""

from __future__ import annotations

import random

import pytest

from specserve.errors import CapacityExhausted
from specserve.kvcache.block_manager import BlockManager, pages_for


def _check_invariants(bm: BlockManager, ids):
    for r in ids:  # the array view mirrors the list through every ensure / truncate
        assert bm.page_array(r).tolist() == bm.page_table(r)
    owned = [p for r in ids if r in bm for p in bm.page_table(r)]
    assert len(owned) == len(set(owned)), "a page has two owners"
    assert len(owned) + bm.num_free_pages == bm.num_pages
    assert bm.num_used_pages == len(owned)
    assert 0 <= bm.num_reserved_pages <= bm.num_pages


def test_reserve_ensure_truncate_free():
    bm = BlockManager(num_pages=10, page_size=16)
    bm.reserve("a", 70)  # 5 pages promised, none allocated
    assert bm.num_reserved_pages == 5 and bm.num_used_pages == 0
    bm.ensure("a", 33)
    assert bm.page_table("a") == [0, 1, 2] and bm.num_slots("a") == 48
    assert bm.slots("a", 15, 18) == [15, 16, 17]
    with pytest.raises(CapacityExhausted, match="beyond its reservation of 5 pages"):
        bm.ensure("a", 81)
    bm.truncate("a", 17)
    assert bm.page_table("a") == [0, 1] and bm.num_free_pages == 8
    assert not bm.can_reserve(6 * 16) and bm.can_reserve(5 * 16)
    with pytest.raises(CapacityExhausted, match="5 of 10 are unreserved"):
        bm.reserve("b", 6 * 16)
    with pytest.raises(ValueError, match="already holds"):
        bm.reserve("a", 1)
    bm.free("a")
    bm.free("a")  # idempotent
    assert bm.num_used_pages == 0 and bm.num_reserved_pages == 0


def test_page_array_is_a_read_only_view():
    bm = BlockManager(num_pages=8, page_size=4)
    bm.reserve("a", 24)
    bm.ensure("a", 9)
    arr = bm.page_array("a")
    assert arr.dtype.name == "int32" and arr.tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="read-only"):
        arr[0] = 5
    bm.truncate("a", 4)
    bm.reserve("b", 8)
    bm.ensure("b", 8)  # takes pages 1 and 2
    bm.ensure("a", 13)
    assert bm.page_array("a").tolist() == bm.page_table("a") == [0, 3, 4, 5]


def test_slots_follow_page_table_after_reuse():
    bm = BlockManager(num_pages=5, page_size=3)
    bm.reserve("x", 6)
    bm.ensure("x", 6)
    bm.reserve("y", 6)
    bm.ensure("y", 4)
    bm.free("x")
    bm.reserve("z", 9)
    bm.ensure("z", 7)  # x's freed pages first (lowest ids), then the never-used page 4
    table = bm.page_table("z")
    assert table == [0, 1, 4]
    assert bm.slots("z", 5, 7) == [table[1] * 3 + 2, table[2] * 3 + 0]


def test_random_workload_invariants():
    rng = random.Random(3)
    bm = BlockManager(num_pages=37, page_size=5)
    live: dict[str, int] = {}
    for step in range(3000):
        op = rng.random()
        if op < 0.3 and len(live) < 12:
            rid, cap = f"r{step}", rng.randint(1, 60)
            if bm.can_reserve(cap):
                bm.reserve(rid, cap)
                live[rid] = cap
        elif op < 0.8 and live:
            rid = rng.choice(list(live))
            bm.ensure(rid, rng.randint(0, live[rid]))
        elif op < 0.9 and live:
            rid = rng.choice(list(live))
            bm.truncate(rid, rng.randint(0, live[rid]))
        elif live:
            bm.free(live.popitem()[0])
        _check_invariants(bm, live)
    for rid in list(live):
        bm.free(rid)
    assert bm.num_free_pages == 37 and bm.num_reserved_pages == 0


@pytest.mark.parametrize("bad", [dict(num_pages=0, page_size=4), dict(num_pages=3, page_size=0)])
def test_bad_geometry(bad):
    with pytest.raises(ValueError):
        BlockManager(**bad)


def test_pages_for():
    assert [pages_for(n, 16) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]
