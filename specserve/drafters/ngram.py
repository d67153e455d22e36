"""Prompt-lookup (n-gram) drafting: propose what followed an earlier copy of the current suffix.

Owns the weight-free drafter: find the longest n-gram ending the history that also occurs
earlier, and turn the tokens that followed it into a chain, or a small tree when different
earlier occurrences continue differently. Matching is vectorised with numpy in
O(len(history) * max_ngram), so 100k-token histories stay cheap. It does not tokenize, verify
or keep state between steps; callers pass the full history (prompt + generated tokens) each time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specserve.drafters.base import Drafter, DraftRequest
from specserve.spec.tree import DraftTree, check_budget


def _check_ngram_range(max_ngram: int, min_ngram: int) -> None:
    if not 1 <= min_ngram <= max_ngram:
        raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")


def _longest_match(history: np.ndarray, max_ngram: int, min_ngram: int) -> np.ndarray | None:
    """End offsets (exclusive, ascending) of earlier copies of the longest matching suffix n-gram.

    An occurrence ending at e is history[e - n:e] with n <= e <= len - 1, so at least one token
    follows it and it starts before the suffix itself. None when no n in [min, max] matches.
    """
    size = history.shape[0]
    if size < 2:
        return None
    # alive[t] <=> history[t + 1 - j] == history[size - j] for j = 1..n: the copy ending at
    # e = t + 1 matches the last n tokens. Growing n by one adds one shifted comparison.
    alive = np.ones(size - 1, dtype=bool)  # [size-1] bool, index t = e - 1
    best: np.ndarray | None = None
    for n in range(1, min(max_ngram, size - 1) + 1):
        alive[n - 1 :] &= history[: size - n] == history[size - n]
        alive[: n - 1] = False
        if not alive.any():
            break
        if n >= min_ngram:
            best = np.flatnonzero(alive) + 1  # [num_matches] int64 end offsets
    return best


def find_ngram_continuation(
    history: Sequence[int] | np.ndarray,
    max_ngram: int = 4,
    min_ngram: int = 1,
    num_tokens: int = 8,
) -> list[int]:
    """Up to `num_tokens` tokens that followed the most recent earlier copy of the longest suffix.

    Tries n from max_ngram down to min_ngram (the longest match wins) and, among the copies of that
    n-gram, takes the most recent one. Returns [] when nothing matches.
    """
    _check_ngram_range(max_ngram, min_ngram)
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be non-negative, got {num_tokens}")
    tokens = np.asarray(history, dtype=np.int64).reshape(-1)  # [len] int64
    ends = _longest_match(tokens, max_ngram, min_ngram)
    if ends is None or num_tokens == 0:
        return []
    end = int(ends[-1])
    return tokens[end : end + num_tokens].tolist()


def ngram_tree(
    history: Sequence[int] | np.ndarray,
    budget: int,
    max_ngram: int = 4,
    min_ngram: int = 1,
    max_depth: int = 15,
) -> DraftTree:
    """A small draft tree from prompt lookup.

    The first chain is the continuation of the most recent match (= find_ngram_continuation).
    Remaining budget goes, most recent first, to other copies of the same n-gram whose first
    continuation token is new at depth 1; each adds a depth-1 sibling with its own chain.
    Never more than `budget` nodes nor deeper than `max_depth`; empty when nothing matches.
    """
    check_budget(budget)
    _check_ngram_range(max_ngram, min_ngram)
    if max_depth < 1:
        raise ValueError(f"max_depth must be >= 1, got {max_depth}")
    tokens = np.asarray(history, dtype=np.int64).reshape(-1)  # [len] int64
    ends = _longest_match(tokens, max_ngram, min_ngram)
    if ends is None or budget == 0:
        return DraftTree.empty()
    return _tree_from_chains(_branch_chains(tokens, ends, budget, max_depth))


def _branch_chains(
    tokens: np.ndarray, ends: np.ndarray, budget: int, max_depth: int
) -> list[list[int]]:
    """Continuations of the matches at `ends`, most recent first, one per distinct first token."""
    chains: list[list[int]] = []
    first_tokens: set[int] = set()
    remaining = budget
    for end in ends[::-1].tolist():
        if remaining == 0:
            break
        chain = tokens[end : end + min(max_depth, remaining)].tolist()
        if chain[0] not in first_tokens:
            first_tokens.add(chain[0])
            chains.append(chain)
            remaining -= len(chain)
    return chains


def _tree_from_chains(chains: list[list[int]]) -> DraftTree:
    """Depth-1 siblings (one per chain) each with its chain below it, in chain order."""
    node_tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    for chain in chains:
        for depth, token in enumerate(chain, start=1):
            # The chain's head hangs off the root; every later token off the row just added.
            parents.append(0 if depth == 1 else len(node_tokens))
            node_tokens.append(token)
            depths.append(depth)
    return DraftTree(
        token_ids=np.asarray(node_tokens, dtype=np.int64),  # [n] int64
        parents=np.asarray(parents, dtype=np.int32),  # [n] int32
        depths=np.asarray(depths, dtype=np.int32),  # [n] int32
    )


@dataclass(frozen=True)
class NgramDrafter(Drafter):
    """Prompt-lookup drafter settings; `propose` turns a token history into a DraftTree."""

    max_ngram: int = 4  # longest suffix n-gram tried
    min_ngram: int = 1  # shortest suffix n-gram accepted
    max_depth: int = 15  # deepest draft node

    def __post_init__(self) -> None:
        _check_ngram_range(self.max_ngram, self.min_ngram)
        if self.max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {self.max_depth}")

    def propose(self, history: Sequence[int] | np.ndarray, budget: int) -> DraftTree:
        """Draft tree of at most `budget` nodes for the next step after `history`."""
        return ngram_tree(history, budget, self.max_ngram, self.min_ngram, self.max_depth)

    # -- the Drafter contract (specserve.drafters.base): works from token history alone --
    def draft(self, requests: Sequence[DraftRequest]) -> list[DraftTree]:
        """One prompt-lookup tree per request, within its budget and max_depth."""
        out = []
        for r in requests:
            depth = min(self.max_depth, r.max_depth)
            ok = r.history is not None and depth > 0 and r.budget > 0
            out.append(ngram_tree(r.history, r.budget, self.max_ngram, self.min_ngram, depth)
                       if ok else DraftTree.empty())
        return out
