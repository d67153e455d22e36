"""Continuous batching: which requests run in the next forward, and how many tokens each.

Pure Python (no torch). Owns the BlockManager: which KV pages each request holds. Admission is
by what a request needs now: its tokens so far plus a step's draft scratch (its own budget's
tree rows; none for plain decoding), reserved there; a
request that could never fit the pool alone is rejected at once (`InvalidRequest`: no retry
helps), one that fits later waits in FIFO order, and the waiting queue is bounded
(`max_waiting`: past it, `CapacityExhausted`). Before each step every decoding request's
reservation grows to its length plus the scratch; when the pool cannot give that, the newest
running request is preempted: its pages are freed and it waits at the head of the queue to be
recomputed — a prefill of its prompt and the tokens it has generated (`Sequence.recompute_to`),
whose last sample is its next token, so its output goes on unchanged (`take_preempted` tells the
engine, which drops the request's drafter state). Each step takes one token from every decoding
request first, then fills the rest of the token budget with prefill chunks (chunked prefill),
oldest request first; with a `chunk_cost` (engine/chunk_cost.py), a chunk beside decoding
requests is cut further, to what the token budget's tokens cost at context 0, so their step does
not grow with the prompt's context. Requests that asked for prompt logprobs prefill at most
PROMPT_LOGPROB_ROWS tokens a step between them (each of their rows gets logits).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from specserve.engine.chunk_cost import MIN_SHARE, ChunkCost
from specserve.engine.sequence import Sequence, Status
from specserve.errors import CapacityExhausted, InvalidRequest
from specserve.kvcache.block_manager import BlockManager, pages_for

PROMPT_LOGPROB_ROWS = 512  # a prompt_logprobs request's chunk: its logits are [rows, vocab]


@dataclass(frozen=True, slots=True)
class Scheduled:
    seq: Sequence
    start: int  # first position processed (= seq.num_computed)
    num_tokens: int  # tokens processed this step


class Scheduler:
    def __init__(
        self, num_pages: int, page_size: int, max_num_seqs: int, max_num_batched_tokens: int,
        scratch: int, max_waiting: int | None = None, chunk_cost: ChunkCost | None = None,
    ) -> None:
        self.blocks = BlockManager(num_pages, page_size)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.scratch = scratch  # the most slots a request reserves for its draft trees
        self.max_waiting = max_waiting  # None: unbounded
        self.chunk_cost = chunk_cost  # None: chunks beside decodes are cut by tokens only
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preempted = 0
        self._preempted: list[Sequence] = []

    @classmethod
    def of(cls, config, num_pages: int, model_config) -> Scheduler:
        """The engine's scheduler: an `EngineConfig`'s limits over `num_pages` KV pages."""
        return cls(num_pages, config.page_size, config.max_num_seqs,
                   config.max_num_batched_tokens,
                   scratch=config.max_draft_tokens + 1 if config.max_draft_tokens else 0,
                   max_waiting=config.max_waiting,
                   chunk_cost=ChunkCost.of(model_config) if config.mixed_chunks == "cost"
                   else None)

    def scratch_of(self, seq: Sequence) -> int:
        """Slots past its tokens `seq` reserves for a step's tree: its budget + 1 rows (root
        and nodes; none for plain decoding), at most `scratch`."""
        return min(seq.budget + 1, self.scratch) if seq.budget else 0

    def check_fits(self, seq: Sequence) -> None:
        scratch = self.scratch_of(seq)
        need = pages_for(seq.reserve_tokens + scratch, self.blocks.page_size)
        if need > self.blocks.num_pages:  # never, not even alone: not a retry-later
            raise InvalidRequest(
                f"request {seq.request_id!r} needs {need} KV pages "
                f"({seq.reserve_tokens} tokens + {scratch} scratch) but the pool has only "
                f"{self.blocks.num_pages}: it can never run on this server (fewer prompt "
                "tokens or max_tokens; the server: more KV memory)", "max_tokens")

    def add(self, seq: Sequence) -> None:
        self.check_fits(seq)
        # those the next step starts (free running slots) are not waiting: a burst between two
        # steps is refused only past running slots + max_waiting
        queued = len(self.waiting) - max(self.max_num_seqs - len(self.running), 0)
        if self.max_waiting is not None and queued >= self.max_waiting:
            raise CapacityExhausted(
                f"the queue is full: {queued} requests are waiting (max_waiting); retry later")
        self.waiting.append(seq)

    def _admits_next(self) -> bool:
        """Whether the first waiting request can be admitted now: a free slot, and pages for
        its tokens and scratch (FIFO: nobody jumps the queue)."""
        if not self.waiting or len(self.running) >= self.max_num_seqs:
            return False
        seq = self.waiting[0]
        return self.blocks.can_reserve(seq.num_tokens + self.scratch_of(seq))

    def _admit(self) -> None:
        while self._admits_next():
            seq = self.waiting[0]
            self.blocks.reserve(seq.request_id, seq.num_tokens + self.scratch_of(seq))
            seq.status = Status.RUNNING
            self.running.append(self.waiting.popleft())

    def _grow(self) -> None:
        """Each decoding request's reservation to its length + scratch, preempting the newest
        running requests while the pool cannot give it."""
        for seq in sorted((s for s in self.running if not s.in_prefill), key=_arrival):
            need = seq.num_tokens + self.scratch_of(seq)
            while seq in self.running and not self.blocks.grow(seq.request_id, need):
                self._preempt(max(self.running, key=_arrival))

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.request_id)
        seq.status, seq.recompute_to, seq.num_computed = Status.WAITING, seq.num_tokens, 0
        seq.pending_context.clear()
        self.waiting.appendleft(seq)
        self.num_preempted += 1
        self._preempted.append(seq)

    def take_preempted(self) -> list[Sequence]:
        """Requests preempted since the last call (their drafter state is stale)."""
        out, self._preempted = self._preempted, []
        return out

    def schedule(self) -> list[Scheduled]:
        """The next forward's work; also allocates the pages it writes to."""
        self._admit()
        self._grow()
        budget = self.max_num_batched_tokens
        out: list[Scheduled] = []
        for seq in (s for s in self.running if not s.in_prefill):
            if budget == 0:
                break
            out.append(Scheduled(seq, seq.num_computed, 1))
            budget -= 1
        out += self._chunks(budget, mixed=bool(out))
        for item in out:
            self.blocks.ensure(item.seq.request_id, item.start + item.num_tokens)
        return out

    def _chunks(self, budget: int, mixed: bool) -> list[Scheduled]:
        """Prefill chunks for `budget` tokens, oldest request first; when `mixed` (decoding
        requests ride in the step) and costed, also for at most `budget` tokens' cost at
        context 0 — the step's first chunk at least 1/MIN_SHARE of the budget."""
        cost = float(budget) if mixed and self.chunk_cost is not None else None
        out: list[Scheduled] = []
        rows = PROMPT_LOGPROB_ROWS  # what the step's prompt_logprobs chunks may still take
        for seq in (s for s in self.running if s.in_prefill):
            n = min(seq.num_uncomputed, budget)
            logits = seq.params.prompt_logprobs is not None and \
                seq.prompt_logprob_count < len(seq.prompt_ids) - 1  # every row's
            if logits and (n := min(n, rows)) == 0:
                continue  # the next step's
            if cost is not None:
                least = 0 if out else min(n, max(1, self.max_num_batched_tokens // MIN_SHARE))
                n = max(least, self.chunk_cost.tokens_within(seq.num_computed, cost, n))
                cost -= self.chunk_cost(n, seq.num_computed)
            if n <= 0:
                break
            out.append(Scheduled(seq, seq.num_computed, n))
            budget, rows = budget - n, rows - (n if logits else 0)
        return out

    def finish(self, seq: Sequence) -> None:
        """Drop a request from the queues and return its pages."""
        seq.status = Status.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq.request_id)

    def make_room(self, seq: Sequence, end: int) -> None:
        """Pages for `seq`'s positions below `end` (a tree's rows past its committed tokens,
        and under CUDA graphs the pad rows to the step's rows bucket), as far as its
        reservation goes: pad rows past it are written to the trash page (graphs.py)."""
        held = self.blocks.reserved(seq.request_id) * self.blocks.page_size
        self.blocks.ensure(seq.request_id, min(end, held))

    def settle(self, seq: Sequence) -> None:
        """After a commit: `seq` keeps the pages of its computed tokens only (a finished
        request's are already free)."""
        if seq.request_id in self.blocks:
            self.blocks.truncate(seq.request_id, seq.num_computed)

    def slot(self, seq: Sequence, position: int) -> int:
        """The KV slot of `seq`'s `position`."""
        return self.blocks.slots(seq.request_id, position, position + 1)[0]

    @property
    def next_step_full(self) -> bool:
        """Whether the requests waiting already fill the next step: its free request slots, or
        its tokens with their prompts (so waiting for more would gain nothing)."""
        room = self.max_num_seqs - len(self.running)
        return len(self.waiting) >= room or \
            sum(s.num_uncomputed for s in self.waiting) >= self.max_num_batched_tokens

    @property
    def has_prompt_work(self) -> bool:
        """Whether the next step carries prompt tokens: a running request is still prefilling
        its prompt, or the first waiting one is admitted by it (one that waits for a slot or
        for pages is not: the running requests' steps stay decode steps meanwhile)."""
        return any(s.in_prefill for s in self.running) or self._admits_next()

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)


def _arrival(seq: Sequence) -> int:
    return seq.arrival
