"""The drafter interface: one batched call per step proposes a draft tree per request.

A drafter is whatever turns a request's state into a `DraftTree` below its bonus token: the
DFlash block drafter (fed with the target's context features), the n-gram prompt-lookup drafter
(fed with the token history), or nothing. Returning an empty tree is always allowed and means a
plain autoregressive step — never an error.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from specserve.spec.tree import DraftTree


@dataclass(frozen=True, eq=False)
class DraftRequest:
    request_id: str
    bonus_token: int  # the root: last committed token
    start: int  # the root's absolute position (= committed tokens before it)
    budget: int  # draft nodes wanted (0 = no drafting)
    max_depth: int  # deepest node allowed (e.g. tokens left before max_tokens)
    # [n_new, n_taps * hidden] target features of positions [start - n_new, start) not sent before
    context: torch.Tensor | None = None
    history: Sequence[int] | None = None  # committed token ids, ending with the root (n-gram)
    # `context` is already the drafter's fused rows [n_new, hidden] (`hidden_norm(fc(x))`,
    # computed by the sender: what crosses hosts instead of the taps)
    context_fused: bool = False


class Drafter(Protocol):
    def draft(self, requests: Sequence[DraftRequest]) -> list[DraftTree]:
        """One tree per request, in order; an empty tree for a request it cannot serve."""
        ...

    def release(self, request_id: str) -> None:
        """Forget a request's state (finished or cancelled). Unknown ids are a no-op."""
        ...

    # Optional: `feed(requests)` takes context rows of prefill chunks ahead of the first draft
    # (budget-0 requests, nothing returned); drafters without it get them with the first draft.
