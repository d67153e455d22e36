"""The drafter contract: one batched call per step proposes a draft tree per request.

A drafter is whatever turns a request's state into a `DraftTree` below its bonus token: the
DFlash block drafter (fed with the target's context features), the n-gram prompt-lookup drafter
(fed with the token history), the verifier's client of a drafter service, or nothing. Returning
an empty tree is always allowed and means a plain autoregressive step — never an error. The
`Drafter` base class declares everything the engine, the warm-up and the services call; a
drafter overrides what it has (the defaults say "none of that"). Which drafter serves a request
travels in its `DraftRequest.kind` (drafters/registry.py names them).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the contract imports no torch: clients name drafters without it
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
    kind: str | None = None  # which drafter (registry name); None: the drafter's default
    # the drafter's argmax chain of `budget` nodes, scored, instead of its tree (a DDTree
    # drafter skips its tree stage; drafters without one answer as they always do)
    chain: bool = False


class Drafter(ABC):
    """What callers use of a drafter; the defaults are those of a drafter that reads only the
    token history, keeps no state and has no CUDA graphs."""

    needs_context = False  # True: requests carry the target's tap-layer features
    graphs = None  # the drafter's CUDA-graph runner (warm-up captures it), or None
    asynchronous = False  # True: `submit` drafts while the caller works on (engine/overlap.py)

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        """Target layers whose outputs are the context features (() without context)."""
        return ()

    @abstractmethod
    def draft(self, requests: Sequence[DraftRequest]) -> list[DraftTree]:
        """One tree per request, in order; an empty tree for a request it cannot serve."""

    def submit(self, requests: Sequence[DraftRequest], ahead: bool = False
               ) -> Callable[[], list[DraftTree]]:
        """Start drafting now; the returned call waits for the trees (`asynchronous` only).
        `ahead`: asked during a step for the request's next one — in its commit (drafts
        sent ahead) or while the request sits the step out (overlap's other group) (traces)."""
        raise NotImplementedError(f"{type(self).__name__} drafts synchronously")

    def feed(self, requests: Sequence[DraftRequest]) -> bool:
        """Take prefill context rows ahead of the first draft (budget-0 requests, nothing
        returned). False: not taken, they go with the first draft instead."""
        return False

    def release(self, request_id: str) -> None:
        """Forget a request's state (finished or cancelled). Unknown ids are a no-op."""
        return None

    def take_entry_errors(self) -> dict[str, str]:
        """request id → why its last draft came back empty for a drafter-side reason (shown
        in the request's step stats); cleared by reading."""
        return {}
