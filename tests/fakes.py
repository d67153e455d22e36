"""Drafters for tests: they propose arbitrary trees, so tests can prove the output never depends
on what is proposed (only commit_len does)."""

from __future__ import annotations

import numpy as np
import torch

from specserve.drafters.base import Drafter
from specserve.spec.ddtree import build_ddtree, topk_logprobs
from specserve.spec.tree import DraftTree


class RandomTreeDrafter(Drafter):
    """Random trees: random parents, random tokens (distinct among siblings), random size."""

    needs_context = False

    def __init__(self, vocab: int, seed: int = 0, hint: float = 0.0) -> None:
        self.vocab, self.rng, self.hint = vocab, np.random.default_rng(seed), hint
        self.released: list[str] = []

    def draft(self, requests):
        return [self._tree(r) for r in requests]

    def _tree(self, req) -> DraftTree:
        n = int(self.rng.integers(0, req.budget + 1))
        parents, depths, tokens, used = [], [], [], {}
        for i in range(n):
            parent = int(self.rng.integers(0, i + 1))
            depth = 1 if parent == 0 else depths[parent - 1] + 1
            if depth > req.max_depth:
                break
            taken = used.setdefault(parent, set())
            free = [t for t in range(self.vocab) if t not in taken]
            token = int(self.rng.choice(free))
            taken.add(token)
            parents.append(parent)
            depths.append(depth)
            tokens.append(token)
        return DraftTree(np.array(tokens, dtype=np.int64), np.array(parents, dtype=np.int32),
                         np.array(depths, dtype=np.int32))

    def release(self, request_id: str) -> None:
        self.released.append(request_id)


class RandomDDTreeDrafter(Drafter):
    """DDTree over random per-position distributions (a stand-in for a real drafter)."""

    needs_context = False

    def __init__(self, vocab: int, depth: int = 4, seed: int = 0) -> None:
        self.vocab, self.depth = vocab, depth
        self.gen = torch.Generator().manual_seed(seed)

    def draft(self, requests):
        out = []
        for r in requests:
            depth = min(self.depth, r.max_depth)
            if depth == 0 or r.budget == 0:
                out.append(DraftTree.empty())
                continue
            logits = torch.randn(depth, self.vocab, generator=self.gen) * 2
            lp, ids = topk_logprobs(logits, min(r.budget, self.vocab))
            out.append(build_ddtree(lp, ids, r.budget))
        return out

    def release(self, request_id: str) -> None:
        pass


class FailingDrafter(Drafter):
    needs_context = False

    def draft(self, requests):
        raise RuntimeError("drafter exploded")

    def release(self, request_id: str) -> None:
        pass
