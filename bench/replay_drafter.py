"""BENCHMARK-ONLY replay drafter — never a serving option.

On random weights no real drafter is ever right, so speculative speed at a realistic acceptance
cannot be measured with one. This drafter cheats on purpose: it is handed the target's own greedy
continuation of the prompt (`set_reference`, computed beforehand by plain autoregressive decoding
of the same prompt) and proposes it as a chain of `budget` tokens, corrupted so that each chain
position is right with probability `p`, independently (the first wrong one ends the acceptance
walk). `p` is solved from the wanted mean commit length (accepted draft tokens + the bonus):

    E[commit_len] = 1 + sum_{k=1..B} p^k          (B = chain length)

The accepted depth of a step is drawn by the inverse CDF of that truncated geometric law from a
low-discrepancy sequence (golden-ratio steps) instead of a PRNG, so the mean over the ~10–20 steps
of a short benchmark lands on its target (±1) instead of wandering by ±2. `mode="fixed"` makes
every step accept exactly `commit_len − 1` draft tokens.

It lives in bench/ and is imported by bench/bench_e2e.py only; nothing in `specserve` knows it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from specserve.drafters.base import Drafter, DraftRequest
from specserve.spec.tree import DraftTree, chain_tree

GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0  # 0.618…: additive-recurrence step of the u sequence


def expected_commit(p: float, budget: int) -> float:
    """Mean commit length of a `budget`-long chain whose positions are right with prob. `p`."""
    return 1.0 + sum(p**k for k in range(1, budget + 1))


def solve_p(commit_len: float, budget: int) -> float:
    """The per-position correctness `p` with `expected_commit(p, budget) == commit_len`."""
    if not 1.0 <= commit_len <= budget + 1:
        raise ValueError(f"commit_len must be in [1, {budget + 1}] for a chain of {budget}, "
                         f"got {commit_len}")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_commit(mid, budget) < commit_len else (lo, mid)
    return (lo + hi) / 2


class ReplayDrafter(Drafter):
    """`Drafter` proposing the target's own (pre-computed) greedy continuation, corrupted."""

    needs_context = False  # no target features: it replays tokens

    def __init__(self, vocab_size: int, budget: int, commit_len: float = 8.0,
                 mode: str = "geometric") -> None:
        if mode not in ("geometric", "fixed"):
            raise ValueError(f"mode must be 'geometric' or 'fixed', got {mode!r}")
        if mode == "fixed" and (commit_len != int(commit_len) or not 1 <= commit_len <= budget + 1):
            raise ValueError(f"fixed mode needs an integer commit_len in [1, {budget + 1}]")
        self.vocab, self.budget, self.commit_len, self.mode = vocab_size, budget, commit_len, mode
        self.p = solve_p(commit_len, budget) if mode == "geometric" else None
        self.refs: dict[str, tuple[int, list[int]]] = {}  # request id -> (prompt len, reference)
        self.diverged_at: dict[str, int] = {}  # request id -> first output index off the ref
        self.reset()

    def set_reference(self, request_id: str, prompt_len: int, continuation: Sequence[int]) -> None:
        """The target's greedy continuation (output tokens only) of request `request_id`."""
        self.refs[request_id] = (int(prompt_len), [int(t) for t in continuation])
        self.diverged_at.pop(request_id, None)

    def reset(self) -> None:
        """Restart the depth schedule (two runs with the same references draft alike)."""
        self.calls = 0
        self.scheduled: list[int] = []  # accepted depth planned per drafted tree

    def planned_depth(self, room: int) -> int:
        """Draft tokens the next tree will get accepted (≤ room), from the schedule."""
        self.calls += 1
        if self.mode == "fixed":
            depth = int(self.commit_len) - 1
        else:
            u = (0.5 + self.calls * GOLDEN) % 1.0  # in (0, 1), low discrepancy
            depth = self.budget if self.p >= 1.0 else int(math.log(u) / math.log(self.p))
        depth = min(depth, self.budget, room)
        self.scheduled.append(depth)
        return depth

    def draft(self, requests: Sequence[DraftRequest]) -> list[DraftTree]:
        return [self._one(r) for r in requests]

    def _one(self, req: DraftRequest) -> DraftTree:
        if req.request_id not in self.refs or req.history is None:
            return DraftTree.empty()
        prompt_len, ref = self.refs[req.request_id]
        done = list(req.history[prompt_len:])  # outputs committed so far (the root is the last)
        if req.request_id not in self.diverged_at and done != ref[: len(done)]:
            self.diverged_at[req.request_id] = next(
                (i for i, (a, b) in enumerate(zip(done, ref, strict=False)) if a != b),
                min(len(done), len(ref)))
        room = min(req.budget, req.max_depth, self.budget, len(ref) - len(done))
        if room <= 0:
            return DraftTree.empty()
        tokens = np.asarray(ref[len(done) : len(done) + room], dtype=np.int64)
        depth = self.planned_depth(room)
        if depth < room:  # the first wrong token ends the walk; later ones stay as they are
            tokens[depth] = (tokens[depth] + 1) % self.vocab
        return chain_tree(tokens)

    def release(self, request_id: str) -> None:
        self.refs.pop(request_id, None)
