"""Continuous batching: which requests run in the next forward, and how many tokens each.

Pure Python (no torch). Admission is by KV pages: a request is admitted only when the pages it
can ever need are reservable, so a running request never runs out of pages; a request that
could never fit is rejected at once (`CapacityExhausted`), one that fits later waits in FIFO order.
Each step takes one token from every decoding request first, then fills the rest of the token
budget with prefill chunks (chunked prefill), oldest request first.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from specserve.engine.sequence import Sequence, Status
from specserve.errors import CapacityExhausted
from specserve.kvcache.block_manager import BlockManager, pages_for


@dataclass(frozen=True, slots=True)
class Scheduled:
    seq: Sequence
    start: int  # first position processed (= seq.num_computed)
    num_tokens: int  # tokens processed this step


class Scheduler:
    def __init__(
        self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, scratch: int
    ) -> None:
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.scratch = scratch  # extra slots reserved per request for draft trees
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def check_fits(self, seq: Sequence) -> None:
        need = pages_for(seq.reserve_tokens + self.scratch, self.blocks.page_size)
        if need > self.blocks.num_pages:
            raise CapacityExhausted(
                f"request {seq.request_id!r} needs {need} KV pages "
                f"({seq.reserve_tokens} tokens + {self.scratch} scratch) but the pool has only "
                f"{self.blocks.num_pages}"
            )

    def add(self, seq: Sequence) -> None:
        self.check_fits(seq)
        self.waiting.append(seq)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self.blocks.can_reserve(seq.reserve_tokens + self.scratch):
                return  # FIFO: nobody jumps the queue
            self.blocks.reserve(seq.request_id, seq.reserve_tokens + self.scratch)
            seq.status = Status.RUNNING
            self.running.append(self.waiting.popleft())

    def schedule(self) -> list[Scheduled]:
        """The next forward's work; also allocates the pages it writes to."""
        self._admit()
        budget = self.max_num_batched_tokens
        out: list[Scheduled] = []
        for seq in (s for s in self.running if not s.in_prefill):
            if budget == 0:
                break
            out.append(Scheduled(seq, seq.num_computed, 1))
            budget -= 1
        for seq in (s for s in self.running if s.in_prefill):
            if budget == 0:
                break
            n = min(seq.num_uncomputed, budget)
            out.append(Scheduled(seq, seq.num_computed, n))
            budget -= n
        for item in out:
            self.blocks.ensure(item.seq.request_id, item.start + item.num_tokens)
        return out

    def finish(self, seq: Sequence) -> None:
        """Drop a request from the queues and return its pages."""
        seq.status = Status.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq.request_id)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
